"""PyTorch's Allreduce latency at decode sizes, under torchrun (one process per GPU).

NCCL (`dist.all_reduce`) and PyTorch's symmetric-memory kernels over peer memory (no
multicast): `one_shot_all_reduce_copy` (input copied into the symmetric buffer) and
`two_shot_all_reduce_` (in place in the symmetric buffer). Each timed two ways: eager, and
`--calls` calls captured in one CUDA graph and replayed; microseconds per call, the
slowest rank's median of 20 samples. bf16.

    torchrun --nproc-per-node 4 bench/torch_allreduce.py
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

SIZES = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else
         "4096,8192,16384,32768,65536,131072,262144,1048576,4194304,16777216,67108864").split(",")]
CALLS, SAMPLES = 50, 20

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=dev)
world = dist.get_world_size()
group = dist.group.WORLD.group_name
largest = max(SIZES) // 2
sym = symm_mem.empty(largest, dtype=torch.bfloat16, device=dev)
symm_mem.rendezvous(sym, group)
src = torch.randn(largest, dtype=torch.bfloat16, device=dev)


def say(*a):
    if rank == 0:
        print(*a, flush=True)


def slowest(us):
    t = torch.tensor([us], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def op(name, n):
    x, s = src[:n], sym[:n]
    if name == "nccl":
        return lambda: dist.all_reduce(x)
    if name == "one_shot":
        return lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(s, x, "sum", group)
    return lambda: torch.ops.symm_mem.two_shot_all_reduce_(s, "sum", group)


def timed(run):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(SAMPLES):
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(out)


def eager(f):
    for _ in range(5):
        f()
    return timed(lambda: [f() for _ in range(CALLS)])


def graphed(f):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(CALLS):
            f()
    torch.cuda.synchronize()
    g.replay()
    return timed(g.replay)


say(f"torch_allreduce: world {world} torch {torch.__version__} nccl {torch.cuda.nccl.version()} "
    f"{torch.cuda.get_device_name()} NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
names = ["nccl", "one_shot", "two_shot"]
say("bytes " + " ".join(f"{n}_eager {n}_graph" for n in names))
for b in SIZES:
    row = [f"{b}"]
    for name in names:
        try:
            f = op(name, b // 2)
            row += [f"{slowest(eager(f)):.2f}", f"{slowest(graphed(f)):.2f}"]
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            row += ["err", "err"]
            say(f"{name} {b}: {type(e).__name__}: {str(e)[:120]}")
    say("torch " + " ".join(row))
dist.barrier()
dist.destroy_process_group()
