"""The layer table of docs/PERFORMANCE.md from one run's JSON lines.

    python3 bench/report_layers.py OURS.jsonl TORCH.jsonl

Bound = max(our AllGather + ReduceScatter alone, our GEMMs alone), all measured in the same
run (the activation is in the first GEMM's epilogue, so it is not in the bound; the gated
block counts its two up projections). "ours" is our fastest pipelined variant, "default"
the fusion without options. PyTorch's best is the faster of its sequential block and
async-TP. Targets (the MLP block): ours <= 1.05x the bound and <= 0.92x
PyTorch's best; the gated rows are reported beside them.
"""
import collections
import json
import sys


def load(path):
    rows = []
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
    return (r.get("op"), r.get("M"), r.get("H"), r.get("F"), r.get("D"))


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def main(ours_path, torch_path):
    ours, torch = collections.defaultdict(dict), collections.defaultdict(dict)
    for r in load(ours_path):
        if "ms" in r:
            ours[key(r)][r["case"]] = r
    for r in load(torch_path):
        if "ms" in r:
            torch[key(r)][r["case"]] = r
    print("| block | M, H, F | D | AG + RS | GEMMs | bound | ours | our variant | ours / bound "
          "| default / bound | PyTorch sequential | PyTorch async-TP | ours / PyTorch best "
          "| max rel. error | targets met |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    order = {"MLP": 0, "GatedMLP": 1}
    for k in sorted(ours, key=lambda k: (k[1], k[2], k[3], order.get(k[0], 9))):
        rows = ours[k]
        ms = lambda c: rows[c]["ms"] if c in rows else None
        needed = ("ag_alone", "rs_alone", "gemm_up_alone", "gemm_down_alone")
        if any(ms(c) is None for c in needed):
            continue
        ups = 2 if k[0] == "GatedMLP" else 1
        comm = ms("ag_alone") + ms("rs_alone")
        gemms = ups * ms("gemm_up_alone") + ms("gemm_down_alone")
        bound = max(comm, gemms)
        piped = [r for c, r in rows.items() if c.startswith("pipelined")]
        if not piped:
            continue
        best = min(piped, key=lambda r: r["ms"])
        t = torch.get(k, {})
        tseq = t.get("torch_sequential", {}).get("ms")
        ttp = t.get("torch_async_tp", {}).get("ms")
        tbest = min([x for x in (tseq, ttp) if x is not None], default=None)
        err = max(r.get("relerr", 0.0) for r in piped)
        over = ratio(best["ms"], bound)
        vs = ratio(best["ms"], tbest)
        if k[0] == "MLP":
            met = "yes" if over is not None and over <= 1.05 and vs is not None and vs <= 0.92 else "NO"
        else:
            met = "-"
        print(f"| {k[0]} | {k[1]}, {k[2]}, {k[3]} | {k[4]} | {fmt(comm)} | {fmt(gemms)} | {fmt(bound)} "
              f"| {fmt(best['ms'])} | {best['case']} | {fmt(over, 2)} | {fmt(ratio(ms('pipelined'), bound), 2)} "
              f"| {fmt(tseq)} | {fmt(ttp)} | {fmt(vs, 2)} | {err:.1e} | {met} |")
    for k, rows in torch.items():
        for c, r in rows.items():
            if "error" in r:
                print(f"PyTorch {c} {k}: {r['error']}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
