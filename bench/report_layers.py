"""The layer tables of docs/PERFORMANCE.md from one run's JSON lines.

    python3 bench/report_layers.py OURS.jsonl TORCH.jsonl [SECOND.jsonl]

Table 1, against the bound and PyTorch. Bound = max(our AllGather + ReduceScatter alone,
our GEMMs alone), all measured in the same run (the activation is in the first GEMM's
epilogue, so it is not in the bound; the gated block counts its two up projections).
"ours" is our fastest pipelined variant, "default" the block called with default options
(its plan chosen at the first call; older runs without that row: the pipelined variant).
PyTorch's best is the faster of its sequential block and async-TP. Targets (the MLP
block): ours <= 1.05x the bound and <= 0.92x PyTorch's best; the gated rows are reported
beside them.

Table 2, what a user gets: the default call against the best variant any options set by
hand give (sequential, pipelined*, plan_<candidate>, and the default itself), the plan
the default call ran, why (tuned, file, model, only_candidate, none), the host time of
tuning and of the whole first call; with SECOND.jsonl (a second process given the same
plan file) its plan source and first call; and the default call against the fastest
variant set by hand timed again in alternation (rows ab_default, ab_best), which the
verdict uses where present (measurements minutes apart drift by a few percent). Target:
default <= 1.02x the best.

Table 3, the MLP block written in other equivalent ways (`form_<name>` rows, default
options), each against the row it names as its baseline (the project's form, i.e. the
`default` row, or the first bias form), and against it timed in alternation (ab_ratio),
which the verdict uses where present. Target: <= 1.03x.
"""
import collections
import json
import sys

ORDER = {"MLP": 0, "GatedMLP": 1}


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


def sort_key(k):
    return (k[4] or 0, k[1], k[2], k[3], ORDER.get(k[0], 9))


def by_key(path):
    out = collections.defaultdict(dict)
    for r in load(path) if path else []:
        if "ms" in r or "error" in r:
            out[key(r)][r["case"]] = r
    return out


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def is_option_variant(case):
    return (case in ("sequential", "default") or case.startswith("pipelined")
            or case.startswith("plan_"))


def header(*columns):
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))


def within(x, limit):
    return "-" if x is None else ("yes" if x <= limit else "NO")


def bound_table(ours, torch):
    header("block", "M, H, F", "D", "AG + RS", "GEMMs", "bound", "ours", "our variant",
           "ours / bound", "default / bound", "PyTorch sequential", "PyTorch async-TP",
           "ours / PyTorch best", "max rel. error", "targets met")
    for k in sorted(ours, key=sort_key):
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
        default = ms("default") if "default" in rows else ms("pipelined")
        if k[0] == "MLP":
            met = "yes" if over is not None and over <= 1.05 and vs is not None and vs <= 0.92 else "NO"
        else:
            met = "-"
        print(f"| {k[0]} | {k[1]}, {k[2]}, {k[3]} | {k[4]} | {fmt(comm)} | {fmt(gemms)} | {fmt(bound)} "
              f"| {fmt(best['ms'])} | {best['case']} | {fmt(over, 2)} | {fmt(ratio(default, bound), 2)} "
              f"| {fmt(tseq)} | {fmt(ttp)} | {fmt(vs, 2)} | {err:.1e} | {met} |")


def default_table(ours, second):
    header("block", "M, H, F", "D", "best option variant", "best", "default", "default / best",
           "plan", "plan source", "tuning ms", "first call ms",
           "2nd process: source, tuning ms, first call ms", "default / best, alternating",
           "default rel. error", "default <= 1.02x best")
    for k in sorted(ours, key=sort_key):
        rows = ours[k]
        d = rows.get("default")
        if d is None:
            continue
        options = [r for c, r in rows.items() if is_option_variant(c) and "ms" in r]
        best = min(options, key=lambda r: r["ms"])
        over = ratio(d["ms"], best["ms"])
        ab_d, ab_b = rows.get("ab_default"), rows.get("ab_best")
        ab = None if ab_d is None or ab_b is None else ratio(ab_d["ms"], ab_b["ms"])
        ab_text = "-" if ab is None else f"{fmt(ab)} ({ab_b.get('best_variant', '?')})"
        verdict = ab if ab is not None else over
        s = second.get(k, {}).get("default")
        again = "-" if s is None else (
            f"{s.get('plan_source', '-')}, {fmt(s.get('tuning_ms'), 1)}, {fmt(s.get('first_call_ms'), 1)}")
        print(f"| {k[0]} | {k[1]}, {k[2]}, {k[3]} | {k[4]} | {best['case']} | {fmt(best['ms'])} "
              f"| {fmt(d['ms'])} | {fmt(over)} | {d.get('plan', '-')} | {d.get('plan_source', '-')} "
              f"| {fmt(d.get('tuning_ms'), 1)} | {fmt(d.get('first_call_ms'), 1)} | {again} "
              f"| {ab_text} | {d.get('relerr', 0.0):.1e} | {within(verdict, 1.02)} |")


def forms_table(ours, second):
    header("block", "M, H, F", "D", "form", "ms", "compared with", "its ms", "form / it",
           "form / it, alternating", "plan", "plan source", "tuning ms", "2nd process source",
           "rel. error", "<= 1.03x")
    for k in sorted(ours, key=sort_key):
        rows = ours[k]
        for c, r in rows.items():
            base = r.get("baseline")
            if not c.startswith("form_") or base is None:
                continue
            b = rows.get(base, {}).get("ms")
            x = ratio(r["ms"], b)
            ab = r.get("ab_ratio")
            limit = "reference" if base == c else within(ab if ab is not None else x, 1.03)
            s = second.get(k, {}).get(c, {}).get("plan_source", "-")
            print(f"| {k[0]} | {k[1]}, {k[2]}, {k[3]} | {k[4]} | {c[5:]} | {fmt(r['ms'])} | {base} "
                  f"| {fmt(b)} | {fmt(x)} | {fmt(ab)} | {r.get('plan', '-')} | {r.get('plan_source', '-')} "
                  f"| {fmt(r.get('tuning_ms'), 1)} | {s} | {r.get('relerr', 0.0):.1e} | {limit} |")


def main(ours_path, torch_path, second_path=None):
    ours, torch, second = by_key(ours_path), by_key(torch_path), by_key(second_path)
    bound_table(ours, torch)
    if any("default" in rows for rows in ours.values()):
        print()
        default_table(ours, second)
    if any(c.startswith("form_") for rows in ours.values() for c in rows):
        print()
        forms_table(ours, second)
    for k, rows in torch.items():
        for c, r in rows.items():
            if "error" in r:
                print(f"PyTorch {c} {k}: {r['error']}")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(*sys.argv[1:])
