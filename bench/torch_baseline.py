"""PyTorch baseline for the overlap benchmark (overlap_bench, bench/src/bin/overlap_bench).

Runs in the same run as our benchmark, on the same machine, on the same shapes, one process per GPU:
AG+GEMM and GEMM+RS done sequentially, as NCCL collectives pipelined over chunks and
streams, as a P2P ring (batch_isend_irecv), and with PyTorch's async-TP fused ops
(torch.ops.symm_mem.fused_*; NVLink multicast stays off). Plus the host cost of one tiny
AG+GEMM P2P step in eager mode. Writes JSON lines (rank 0) to --out.

    python3 bench/torch_baseline.py --out torch.jsonl
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


class Bench:
    """Event-timed medians with all ranks released together; reports the slowest rank."""

    def __init__(self, iters, warmup):
        self.iters, self.warmup = iters, warmup

    def median_ms(self, step):
        for _ in range(self.warmup):
            step()
        samples = []
        for _ in range(self.iters):
            torch.cuda.synchronize()
            dist.barrier()
            begin = torch.cuda.Event(enable_timing=True)
            finish = torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            finish.record()
            finish.synchronize()
            samples.append(begin.elapsed_time(finish))
        slowest = torch.tensor([statistics.median(samples)], device="cuda")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()


def relerr(x, ref):
    x, ref = x.float(), ref.float()
    e = torch.tensor([((x - ref).norm() / ref.norm()).item()], device="cuda")
    dist.all_reduce(e, op=dist.ReduceOp.MAX)
    return e.item()


def over_streams(streams, count, body):
    """Runs body(i) for i < count, iteration i on streams[i % len(streams)], joined after."""
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    for i in range(count):
        with torch.cuda.stream(streams[i % len(streams)]):
            body(i)
    for s in streams:
        main.wait_stream(s)


def ag_gemm(b, emit, rank, world, m, k, n, dtype, streams, symm):
    shard = torch.randn(m // world, k, device="cuda", dtype=dtype)
    w = torch.randn(k, n, device="cuda", dtype=dtype)
    gathered = torch.empty(m, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    emit("comm_alone", b.median_ms(lambda: dist.all_gather_into_tensor(gathered, shard)))
    emit("gemm_alone", b.median_ms(lambda: torch.matmul(gathered, w, out=out)))

    def sequential():
        dist.all_gather_into_tensor(gathered, shard)
        torch.matmul(gathered, w, out=out)

    emit("sequential", b.median_ms(sequential))
    sequential()
    reference = out.clone()
    for chunks in (2, 4, 8):
        rows = m // (world * chunks)
        pieces = shard.view(chunks, rows, k)
        slots = torch.empty(chunks, world, rows, k, device="cuda", dtype=dtype)
        result = torch.empty(chunks, world * rows, n, device="cuda", dtype=dtype)
        for ns in (2, 4):
            def pipelined():
                def step(c):
                    dist.all_gather_into_tensor(slots[c], pieces[c])
                    torch.matmul(slots[c].view(world * rows, k), w, out=result[c])
                over_streams(streams[:ns], chunks, step)
            emit(f"nccl_pipeline_s{chunks}_n{ns}", b.median_ms(pipelined))
        pipelined()
        check = result.view(chunks, world, rows, n).transpose(0, 1).reshape(m, n)
        emit(f"nccl_pipeline_s{chunks}_check", None, relerr(check, reference))
    blocks = torch.empty(world, m // world, k, device="cuda", dtype=dtype)
    result = torch.empty(world, m // world, n, device="cuda", dtype=dtype)
    for ns in (2, world):
        def ring():
            def step(i):
                src, dst = (rank - i) % world, (rank + i) % world
                if i == 0:
                    blocks[rank].copy_(shard, non_blocking=True)
                else:
                    ops = [dist.P2POp(dist.irecv, blocks[src], src), dist.P2POp(dist.isend, shard, dst)]
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()
                torch.matmul(blocks[src], w, out=result[src])
            over_streams(streams[:ns], world, step)
        emit(f"p2p_ring_n{ns}", b.median_ms(ring))
    ring()
    emit("p2p_ring_check", None, relerr(result.view(m, n), reference))
    if symm:
        fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [w], gather_dim=0, group_name=dist.group.WORLD.group_name)
        emit("symm_mem_fused_all_gather_matmul", b.median_ms(fused))
        _, [c] = fused()
        emit("symm_mem_check", None, relerr(c, reference))


def gemm_rs(b, emit, rank, world, m, k, n, dtype, streams, symm):
    a = torch.randn(m, k // world, device="cuda", dtype=dtype)
    w = torch.randn(k // world, n, device="cuda", dtype=dtype)
    partial = torch.empty(m, n, device="cuda", dtype=dtype)
    out = torch.empty(m // world, n, device="cuda", dtype=dtype)
    emit("gemm_alone", b.median_ms(lambda: torch.matmul(a, w, out=partial)))
    emit("comm_alone", b.median_ms(lambda: dist.reduce_scatter_tensor(out, partial)))

    def sequential():
        torch.matmul(a, w, out=partial)
        dist.reduce_scatter_tensor(out, partial)

    emit("sequential", b.median_ms(sequential))
    sequential()
    reference = out.clone()
    for chunks in (2, 4, 8):
        rows = m // (world * chunks)
        # chunk c holds rows j*(m/world) + c*rows + i of every destination j
        a_c = a.view(world, chunks, rows, k // world)
        parts = torch.empty(chunks, world, rows, n, device="cuda", dtype=dtype)
        res = torch.empty(chunks, rows, n, device="cuda", dtype=dtype)

        def pipelined():
            def step(c):
                torch.matmul(a_c[:, c], w, out=parts[c])
                dist.reduce_scatter_tensor(res[c], parts[c])
            over_streams(streams[:2], chunks, step)

        emit(f"nccl_pipeline_s{chunks}_n2", b.median_ms(pipelined))
        pipelined()
        emit(f"nccl_pipeline_s{chunks}_check", None, relerr(res.reshape(m // world, n), reference))
    if symm:
        fused = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", scatter_dim=0, group_name=dist.group.WORLD.group_name)
        emit("symm_mem_fused_matmul_reduce_scatter", b.median_ms(fused))
        emit("symm_mem_check", None, relerr(fused(), reference))


def host_overhead(emit, rank, world, dtype, streams):
    """Host time of one tiny AG+GEMM P2P ring in eager PyTorch (enqueue only), per call and
    per host-side operation (each stream switch or join, copy, P2P batch, wait, matmul)."""
    shard = torch.randn(8, 8, device="cuda", dtype=dtype)
    w = torch.randn(8, 8, device="cuda", dtype=dtype)
    blocks = torch.empty(world, 8, 8, device="cuda", dtype=dtype)
    result = torch.empty(world, 8, 8, device="cuda", dtype=dtype)
    ops = [0]

    def step_all():
        def step(i):
            src, dst = (rank - i) % world, (rank + i) % world
            ops[0] += 2  # entering and leaving the iteration's stream
            if i == 0:
                blocks[rank].copy_(shard, non_blocking=True)
                ops[0] += 1
            else:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, blocks[src], src), dist.P2POp(dist.isend, shard, dst)])
                ops[0] += 1
                for req in reqs:
                    req.wait()
                    ops[0] += 1
            torch.matmul(blocks[src], w, out=result[src])
            ops[0] += 1
        ops[0] += 2 * min(len(streams), world)  # the fork and join of the streams
        over_streams(streams[:world], world, step)

    for _ in range(5):
        step_all()
    samples = []
    for _ in range(200):
        torch.cuda.synchronize()
        dist.barrier()
        ops[0] = 0
        t = time.perf_counter()
        step_all()
        samples.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    emit("host_overhead_us_per_call", statistics.median(samples), ops[0])


def worker(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    streams = [torch.cuda.Stream() for _ in range(max(4, world))]
    symm = True
    try:
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    except Exception as err:  # reported, then the other variants still run
        symm = False
        if rank == 0:
            print(json.dumps({"case": "symm_mem_unavailable", "error": repr(err)[:300]}), flush=True)
    lines = []
    b = Bench(args.iters, args.warmup)
    for shape in args.shapes.split(";"):
        m, k, n = (int(x) for x in shape.split(","))
        for op in args.ops.split(","):
            def emit(case, ms, err=None, op=op, m=m, k=k, n=n):
                if rank == 0:
                    row = {"op": "AG+GEMM" if op == "ag" else "GEMM+RS", "M": m, "K": k, "N": n, "D": world,
                           "dtype": args.dtype, "case": case}
                    if ms is not None:
                        row["ms"] = ms
                    if err is not None:
                        row["relerr"] = err
                    lines.append(row)
                    print(json.dumps(row), flush=True)
            try:
                (ag_gemm if op == "ag" else gemm_rs)(b, emit, rank, world, m, k, n, dtype, streams, symm)
            except Exception as err:
                emit("error", None)
                if rank == 0:
                    lines[-1]["error"] = repr(err)[:300]
            torch.cuda.empty_cache()
    host_overhead(lambda case, us, ops: lines.append({"case": case, "D": world, "us": us, "ops": ops,
                                                      "us_per_op": us / ops}) if rank == 0 else None,
                  rank, world, dtype, streams)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            for row in lines:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="16384,8192,2048;8192,8192,8192;16384,8192,8192")
    p.add_argument("--ops", default="ag,rs")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    world = torch.cuda.device_count()
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)
