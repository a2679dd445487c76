"""Compares the overlap benchmark in one process driving every GPU against the same run with
one process per GPU (a launched world), variant by variant, from one run on one machine.

    python3 bench/compare_layouts.py SINGLE.jsonl LAUNCHED.jsonl

Target: every row within 5% of the single-process time (launched / single <= 1.05).
Rows: each (op, shape) with its default variant (the P2P pipeline over the copy engines) and
each layout's fastest variant; every common variant is listed in the detail table.
"""
import json
import sys


def load(path):
    rows = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if "op" in r:
                rows[(r["op"], r["M"], r["K"], r["N"], r["D"], r["case"])] = r
    return rows


def main(single_path, launched_path):
    single, launched = load(single_path), load(launched_path)
    common = sorted(set(single) & set(launched))
    shapes = sorted({k[:5] for k in common})
    print("| op | M, K, N | D | variant | one process (ms) | process per GPU (ms) | ratio | within 5% |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for s in shapes:
        d = s[4]
        default = f"p2p_ce_push_peer_n{d}"
        mine = {k[5]: (single[k]["ms"], launched[k]["ms"]) for k in common if k[:5] == s}
        measured = {c: v for c, v in mine.items() if c not in ("comm_alone", "gemm_alone")
                    and not c.startswith("gemm_alone_rows")}
        picks = []
        if default in measured:
            picks.append(("default " + default, measured[default]))
        if measured:
            best_s = min(measured, key=lambda c: measured[c][0])
            best_l = min(measured, key=lambda c: measured[c][1])
            picks.append((f"best ({best_s} / {best_l})", (measured[best_s][0], measured[best_l][1])))
        for name, (a, b) in picks:
            ratio = b / a
            worst = max(worst, ratio)
            print(f"| {s[0]} | {s[1]}, {s[2]}, {s[3]} | {d} | {name} | {a:.3f} | {b:.3f} | {ratio:.3f} | {'yes' if ratio <= 1.05 else 'NO'} |")
    print()
    print("Every common variant:")
    print()
    print("| op | M, K, N | variant | one process | process per GPU | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in common:
        a, b = single[k]["ms"], launched[k]["ms"]
        print(f"| {k[0]} | {k[1]}, {k[2]}, {k[3]} | {k[5]} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    print()
    print(f"worst ratio of the rows above: {worst:.3f} ({'all within 5%' if worst <= 1.05 else 'some row over 5%'})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
