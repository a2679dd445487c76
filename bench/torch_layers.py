"""PyTorch baseline for the layer benchmark (layer_bench, bench/src/bin/layer_bench.rs).

The sequence-parallel MLP block y = ReduceScatter(act(AllGather(x) W1) W2) and the gated
block y = RS((silu(AG(x) Wg) * (AG(x) Wu)) Wd) on the same shapes as ours, one process
per GPU: the components alone (NCCL all-gather and reduce-scatter, each GEMM, the
activation), the sequential block (NCCL + cuBLAS), and PyTorch's async tensor parallelism
(torch.ops.symm_mem.fused_all_gather_matmul, the activation, fused_matmul_reduce_scatter;
NVLink multicast off). CUDA-event medians with all ranks released together; the slowest
rank's median. Async-TP is checked against the sequential result first. JSON lines
(rank 0) go to --out.

    python3 bench/torch_layers.py --out torch-layers.jsonl
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from torch_baseline import Bench, relerr  # event-timed medians, slowest rank

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def uniform(shape, scale, gen):
    t = torch.rand(shape, device="cuda", dtype=torch.float32, generator=gen) * 2 - 1
    return (t * scale).to(torch.bfloat16)


class Block:
    """One block on one shape: its tensors, and the ways to run it."""

    def __init__(self, gated, m, h, f, world, group, gen):
        self.gated, self.group = gated, group
        rows, cols = m // world, f // world
        self.x = uniform((rows, h), 1.0, gen)
        ups = 2 if gated else 1
        self.w_up = [uniform((h, cols), h ** -0.5, gen) for _ in range(ups)]
        self.w_down = uniform((cols, h), f ** -0.5, gen)
        self.gathered = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
        self.partial = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(rows, h, device="cuda", dtype=torch.bfloat16)
        self.hidden = [torch.empty(m, cols, device="cuda", dtype=torch.bfloat16) for _ in range(ups)]

    def act(self, hs):
        if self.gated:
            return F.silu(hs[0]) * hs[1]
        return F.gelu(hs[0], approximate="tanh")

    def sequential(self):
        dist.all_gather_into_tensor(self.gathered, self.x)
        for w, h in zip(self.w_up, self.hidden):
            torch.matmul(self.gathered, w, out=h)
        torch.matmul(self.act(self.hidden), self.w_down, out=self.partial)
        dist.reduce_scatter_tensor(self.out, self.partial)
        return self.out

    def async_tp(self):
        name = self.group.group_name
        _, hs = torch.ops.symm_mem.fused_all_gather_matmul(self.x, self.w_up, gather_dim=0, group_name=name)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            self.act(hs), self.w_down, "sum", scatter_dim=0, group_name=name
        )


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.group.WORLD
    out = open(args.out, "w") if rank == 0 else None

    def emit(**row):
        if out is not None:
            row.update(source="torch", D=world, dtype="bf16")
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()

    symm_ok = True
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group.group_name)
    except Exception as ex:  # older PyTorch or no symmetric memory: sequential only
        symm_ok = False
        emit(op="setup", case="symm_mem", error=repr(ex)[:300])
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + 7919 * rank)
    for shape in args.shapes.split(";"):
        m, h, f = (int(v) for v in shape.split(","))
        for block in args.blocks.split(","):
            gated = block == "gated"
            base = dict(op="GatedMLP" if gated else "MLP", M=m, H=h, F=f)
            try:
                b = Block(gated, m, h, f, world, group, gen)
                t = Bench(args.iters, args.warmup).median_ms
                emit(**base, case="torch_ag_alone", ms=t(lambda: dist.all_gather_into_tensor(b.gathered, b.x)))
                emit(**base, case="torch_rs_alone", ms=t(lambda: dist.reduce_scatter_tensor(b.out, b.partial)))
                emit(**base, case="torch_gemm_up_alone",
                     ms=t(lambda: torch.matmul(b.gathered, b.w_up[0], out=b.hidden[0])))
                emit(**base, case="torch_act_alone", ms=t(lambda: b.act(b.hidden)))
                emit(**base, case="torch_gemm_down_alone",
                     ms=t(lambda: torch.matmul(b.hidden[0], b.w_down, out=b.partial)))
                reference = b.sequential().clone()
                emit(**base, case="torch_sequential", ms=t(b.sequential))
                if symm_ok:
                    try:
                        err = relerr(b.async_tp(), reference)
                        emit(**base, case="torch_async_tp", ms=t(b.async_tp), relerr=err)
                    except Exception as ex:
                        emit(**base, case="torch_async_tp", error=repr(ex)[:300])
                del b
                torch.cuda.empty_cache()
            except Exception as ex:
                emit(**base, case="error", error=repr(ex)[:300])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="torch-layers.jsonl")
    p.add_argument("--shapes", default="8192,4096,14336;8192,8192,28672;16384,8192,28672")
    p.add_argument("--blocks", default="mlp,gated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    a = p.parse_args()
    n = torch.cuda.device_count()
    mp.spawn(run, args=(n, a), nprocs=n)
