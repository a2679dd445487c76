"""The backward tables from one run's JSON lines (backward_bench and torch_backward.py).

    python3 bench/report_backward.py FILE.jsonl [FILE.jsonl ...]

Files of both sources and of any device counts may be given together; rows are matched
by layer, shape and D.

Table 1, the backward: ours in its saving form (`backward`: the derived backward fed the
GEMM results its forward saved, called with default options, its plan tuned at its first
call), the gradient GEMMs alone (every GEMM it runs, at its whole shape), ours / those,
ours in its recomputing form (`backward_recompute`, which for the MLP block computes the
forward's first GEMM again), every GEMM it runs alone, recomputing / those, the
collectives alone, PyTorch's eager autograd backward (NCCL; what autograd saved in the
forward is not recomputed), each of ours / PyTorch, the gradients' relative errors, and
the saving backward's plan.

Table 2, a training step without the optimizer (forward, then backward), ours against
PyTorch's: ours saving (`forward_saving`, which also returns the saved values, then
`backward_saved`) and recomputing (the plain `forward`, then the recomputing backward),
PyTorch's (its forward records the graph and saves the tensors its backward reads), with
each forward alone.

Rows of a run from before the saving form (no `forward_saving` row) are read as what they
were: their `backward` and `step` were the recomputing form's.
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
    for cases in out["ours"].values():
        if "forward_saving" not in cases and "backward_recompute" not in cases:
            for case in ("backward", "step"):
                if case in cases:
                    cases[case + "_recompute"] = cases.pop(case)
    return out["ours"], out["torch"]


def ms(rows, case):
    r = rows.get(case)
    return None if r is None else r.get("ms")


def sum_ms(rows, keep):
    xs = [r["ms"] for r in rows.values() if keep(r) and "ms" in r]
    return sum(xs) if xs else None


def errors(*rows):
    x = [r.get("relerr") for r in rows if r is not None and r.get("relerr") is not None]
    return " / ".join(f"{v:.1e}" for v in x) if x else "-"


def backward_table(ours, torch):
    header("layer", "shape", "D", "ours", "gradient GEMMs", "ours / GEMMs",
           "ours, recomputing", "all GEMMs", "recomputing / GEMMs", "collectives", "PyTorch",
           "ours / PyTorch", "recomputing / PyTorch",
           "rel. error (ours / recomputing / PyTorch)", "plan", "tuning ms")
    for k in sorted(set(ours) | set(torch), key=sort_key):
        o, t = ours.get(k, {}), torch.get(k, {})
        bw, rbw, tbw = o.get("backward"), o.get("backward_recompute"), t.get("backward")
        gemms = sum_ms(o, lambda r: r.get("kind") == "gemm")
        grads = sum_ms(o, lambda r: r.get("kind") == "gemm" and not r.get("recompute"))
        comm = sum_ms(o, lambda r: r.get("kind") == "comm")
        ours_ms, rec_ms, torch_ms = ms(o, "backward"), ms(o, "backward_recompute"), ms(t, "backward")
        plan = "-" if bw is None else f"{bw.get('plan', '-')} ({bw.get('plan_source', '-')})"
        tuning = None if bw is None else bw.get("tuning_ms")
        print(f"| {k[0]} | {k[1]} | {k[2]} | {fmt(ours_ms)} | {fmt(grads)} | {fmt(ratio(ours_ms, grads), 2)} "
              f"| {fmt(rec_ms)} | {fmt(gemms)} | {fmt(ratio(rec_ms, gemms), 2)} | {fmt(comm)} "
              f"| {fmt(torch_ms)} | {fmt(ratio(ours_ms, torch_ms), 2)} | {fmt(ratio(rec_ms, torch_ms), 2)} "
              f"| {errors(bw, rbw, tbw)} | {plan} | {fmt(tuning, 0)} |")


def step_table(ours, torch):
    header("layer", "shape", "D", "ours: forward_saving", "ours: step",
           "ours: forward", "ours: step, recomputing", "PyTorch: forward", "PyTorch: step",
           "step: ours / PyTorch", "step, recomputing: ours / PyTorch")
    for k in sorted(set(ours) | set(torch), key=sort_key):
        o, t = ours.get(k, {}), torch.get(k, {})
        step, rstep, tstep = ms(o, "step"), ms(o, "step_recompute"), ms(t, "step")
        print(f"| {k[0]} | {k[1]} | {k[2]} | {fmt(ms(o, 'forward_saving'))} | {fmt(step)} "
              f"| {fmt(ms(o, 'forward'))} | {fmt(rstep)} | {fmt(ms(t, 'forward'))} | {fmt(tstep)} "
              f"| {fmt(ratio(step, tstep), 2)} | {fmt(ratio(rstep, tstep), 2)} |")


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
