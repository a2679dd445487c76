"""The backward tables from one run's JSON lines (backward_bench and torch_backward.py).

    python3 bench/report_backward.py FILE.jsonl [FILE.jsonl ...]

Files of both sources and of any device counts may be given together; rows are matched
by layer, shape and D.

Table 1, the backward: ours (the derived backward called with default options, its plan
tuned at its first call), our GEMMs alone (every GEMM our backward runs, at its whole
shape: the gradient GEMMs, and for the MLP block the first GEMM it recomputes, since the
backward saves nothing from the forward), ours / GEMMs, the gradient GEMMs alone, the
collectives alone, PyTorch's eager autograd backward (NCCL; what autograd saved in the
forward is not recomputed), ours / PyTorch, the gradients' relative errors, and the plan.

Table 2, a training step without the optimizer (forward, then backward), ours against
PyTorch's (PyTorch's forward records the graph and saves the tensors its backward reads;
ours computes the output alone and the backward recomputes what it needs), with each
forward alone.
"""
import collections
import json
import sys

ORDER = {"MLP": 0, "AG+GEMM": 1, "GEMM+RS": 2}


def load(paths):
    rows = []
    for path in paths:
        try:
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError:
                            pass
        except OSError as e:
            print(f"(cannot read {path}: {e})", file=sys.stderr)
    return rows


def key(r):
    return (r.get("op"), r.get("shape"), r.get("D"))


def sort_key(k):
    dims = tuple(int(v) for v in (k[1] or "0,0,0").split(","))
    return (-(k[2] or 0), ORDER.get(k[0], 9), dims)


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def header(*columns):
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))


def split(rows):
    """{(op, shape, D): {case: row}} per source."""
    out = {"ours": collections.defaultdict(dict), "torch": collections.defaultdict(dict)}
    for r in rows:
        src = out.get(r.get("source"))
        if src is not None and "case" in r:
            src[key(r)][r["case"]] = r
    return out["ours"], out["torch"]


def ms(rows, case):
    r = rows.get(case)
    return None if r is None else r.get("ms")


def sum_ms(rows, keep):
    xs = [r["ms"] for r in rows.values() if keep(r) and "ms" in r]
    return sum(xs) if xs else None


def errors(a, b):
    x = [r.get("relerr") for r in (a, b) if r is not None and r.get("relerr") is not None]
    return " / ".join(f"{v:.1e}" for v in x) if x else "-"


def backward_table(ours, torch):
    header("layer", "shape", "D", "ours", "GEMMs", "ours / GEMMs", "gradient GEMMs",
           "collectives", "PyTorch", "ours / PyTorch", "rel. error (ours / PyTorch)", "plan",
           "tuning ms")
    for k in sorted(set(ours) | set(torch), key=sort_key):
        o, t = ours.get(k, {}), torch.get(k, {})
        bw, tbw = o.get("backward"), t.get("backward")
        gemms = sum_ms(o, lambda r: r.get("kind") == "gemm")
        grads = sum_ms(o, lambda r: r.get("kind") == "gemm" and not r.get("recompute"))
        comm = sum_ms(o, lambda r: r.get("kind") == "comm")
        ours_ms, torch_ms = ms(o, "backward"), ms(t, "backward")
        plan = "-" if bw is None else f"{bw.get('plan', '-')} ({bw.get('plan_source', '-')})"
        tuning = None if bw is None else bw.get("tuning_ms")
        print(f"| {k[0]} | {k[1]} | {k[2]} | {fmt(ours_ms)} | {fmt(gemms)} | {fmt(ratio(ours_ms, gemms), 2)} "
              f"| {fmt(grads)} | {fmt(comm)} | {fmt(torch_ms)} | {fmt(ratio(ours_ms, torch_ms), 2)} "
              f"| {errors(bw, tbw)} | {plan} | {fmt(tuning, 0)} |")


def step_table(ours, torch):
    header("layer", "shape", "D", "ours: forward", "ours: step", "PyTorch: forward",
           "PyTorch: step", "step: ours / PyTorch")
    for k in sorted(set(ours) | set(torch), key=sort_key):
        o, t = ours.get(k, {}), torch.get(k, {})
        step, tstep = ms(o, "step"), ms(t, "step")
        print(f"| {k[0]} | {k[1]} | {k[2]} | {fmt(ms(o, 'forward'))} | {fmt(step)} "
              f"| {fmt(ms(t, 'forward'))} | {fmt(tstep)} | {fmt(ratio(step, tstep), 2)} |")


def main(paths):
    ours, torch = split(load(paths))
    print("Backward (ms, bf16; the slowest rank's median):\n")
    backward_table(ours, torch)
    print("\nTraining step without the optimizer (forward + backward, ms):\n")
    step_table(ours, torch)
    for k, rows in sorted(torch.items(), key=lambda kv: sort_key(kv[0])):
        for c, r in rows.items():
            if "error" in r:
                print(f"PyTorch {c} {k}: {r['error']}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
