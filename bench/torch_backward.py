"""PyTorch baseline for the backward benchmark (backward_bench, bench/src/bin/backward_bench.rs).

PyTorch eager autograd with NCCL, bf16, one process per GPU, on the same layers and shapes
as ours: the sequence-parallel MLP block y = RS(gelu_tanh(AG(x) W1) W2) (M, H, F), AG+GEMM
y = AG(x) W with W this rank's column block (M, K, N: x [M/D, K], W [K, N]) and GEMM+RS
y = RS(a W) with a this rank's column block and W its row block (M, K, N: a [M, K/D],
W [K/D, N]). AG and RS are torch.autograd.Functions over all_gather_into_tensor and
reduce_scatter_tensor, each the other's backward. Cases (same names as ours):
  forward   the forward with autograd recording (what a training step runs: the graph
            and the tensors its backward reads are saved);
  backward  torch.autograd.grad of the output with a given output gradient, for every
            input, on a forward's kept graph (nothing recomputed: autograd saved it);
  step      forward then backward, a training step without the optimizer.
CUDA-event medians of --iters calls after --warmup, all ranks released together, the
slowest rank's median. The gradients of the first backward are checked against the same
products written by hand (relerr). JSON lines (rank 0) go to --out.

    python3 bench/torch_backward.py --out torch-backward.jsonl
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from torch_baseline import Bench, relerr  # event-timed medians, slowest rank

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def gather_rows(x):
    out = torch.empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]), device=x.device, dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def scatter_rows(x):
    out = torch.empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]), device=x.device, dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out


class AllGather(torch.autograd.Function):
    """Rows gathered from every rank; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x):
        return gather_rows(x)

    @staticmethod
    def backward(ctx, g):
        return scatter_rows(g)


class ReduceScatter(torch.autograd.Function):
    """Partial sums reduced and scattered by rows; the backward gathers the gradient."""

    @staticmethod
    def forward(ctx, x):
        return scatter_rows(x)

    @staticmethod
    def backward(ctx, g):
        return gather_rows(g)


def uniform(shape, scale, gen):
    t = torch.rand(shape, device="cuda", dtype=torch.float32, generator=gen) * 2 - 1
    return (t * scale).to(torch.bfloat16).requires_grad_()


class Layer:
    """One layer on one shape: its inputs, output gradient, forward and hand-written
    gradients."""

    def __init__(self, op, m, k, n, world, gen):
        self.op = op
        if op == "MLP":  # (M, H, F)
            self.inputs = [uniform((m // world, k), 1.0, gen), uniform((k, n // world), k ** -0.5, gen),
                           uniform((n // world, k), n ** -0.5, gen)]
            dy = (m // world, k)
        elif op == "AG+GEMM":
            self.inputs = [uniform((m // world, k), 1.0, gen), uniform((k, n), k ** -0.5, gen)]
            dy = (m, n)
        else:  # GEMM+RS
            self.inputs = [uniform((m, k // world), 1.0, gen), uniform((k // world, n), k ** -0.5, gen)]
            dy = (m // world, n)
        self.dy = uniform(dy, 1.0, gen).detach()

    def forward(self):
        if self.op == "MLP":
            x, w1, w2 = self.inputs
            act = F.gelu(AllGather.apply(x) @ w1, approximate="tanh")
            return ReduceScatter.apply(act @ w2)
        if self.op == "AG+GEMM":
            x, w = self.inputs
            return AllGather.apply(x) @ w
        a, w = self.inputs
        return ReduceScatter.apply(a @ w)

    def backward(self, y, keep=True):
        return torch.autograd.grad(y, self.inputs, self.dy, retain_graph=keep)

    @torch.no_grad()
    def by_hand(self):
        """The gradients written out (dX = RS(dY W^T), dW = AG(X)^T dY, ...)."""
        if self.op == "MLP":
            x, w1, w2 = self.inputs
            xg, dyg = gather_rows(x), gather_rows(self.dy)
            h = (xg @ w1).float()
            t = torch.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3))
            act = (0.5 * h * (1 + t)).to(x.dtype)
            grad = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * h * h)
            dh = ((dyg @ w2.t()).float() * grad).to(x.dtype)
            return [scatter_rows(dh @ w1.t()), xg.t() @ dh, act.t() @ dyg]
        if self.op == "AG+GEMM":
            x, w = self.inputs
            return [scatter_rows(self.dy @ w.t()), gather_rows(x).t() @ self.dy]
        a, w = self.inputs
        dyg = gather_rows(self.dy)
        return [dyg @ w.t(), a.t() @ dyg]


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.backends.cuda.matmul.allow_tf32 = False
    out = open(args.out, "w") if rank == 0 else None

    def emit(**row):
        if out is not None:
            row.update(source="torch", D=world, dtype="bf16")
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()

    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + 7919 * rank)
    names = {"mlp": "MLP", "ag": "AG+GEMM", "rs": "GEMM+RS"}
    for key in args.ops.split(","):
        op = names[key]
        shapes = args.mlp_shapes if op == "MLP" else args.shapes
        for shape in shapes.split(";"):
            m, k, n = (int(v) for v in shape.split(","))
            dims = ("M", "H", "F") if op == "MLP" else ("M", "K", "N")
            base = dict(op=op, shape=f"{m},{k},{n}", **dict(zip(dims, (m, k, n))))
            split = {"MLP": (m, n), "AG+GEMM": (m,), "GEMM+RS": (m, k)}[op]
            if any(v % world for v in split):
                emit(**base, case="skipped", error=f"does not split over {world} devices")
                continue
            try:
                layer = Layer(op, m, k, n, world, gen)
                t = Bench(args.iters, args.warmup).median_ms
                y = layer.forward()
                err = max(relerr(g, r) for g, r in zip(layer.backward(y), layer.by_hand()))
                emit(**base, case="backward", ms=t(lambda: layer.backward(y)), relerr=err)
                del y
                emit(**base, case="forward", ms=t(layer.forward))
                emit(**base, case="step", ms=t(lambda: layer.backward(layer.forward(), keep=False)))
                del layer
                torch.cuda.empty_cache()
            except Exception as ex:
                emit(**base, case="error", error=repr(ex)[:300])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="torch-backward.jsonl")
    p.add_argument("--ops", default="mlp,ag,rs")
    p.add_argument("--shapes", default="8192,8192,8192;16384,8192,2048;16384,8192,8192")
    p.add_argument("--mlp-shapes", default="8192,4096,14336;8192,8192,28672;16384,8192,28672")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    a = p.parse_args()
    n = torch.cuda.device_count()
    mp.spawn(run, args=(n, a), nprocs=n)
