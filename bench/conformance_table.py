"""Summarizes a GPU conformance run (`conformance.jsonl`, written by the conformance tests
when FUSION_RESULTS is set) as a markdown table: per case and dtype, the device counts
run, the largest relative error, the tolerance and whether every check passed.

    python3 bench/conformance_table.py conformance.jsonl
"""
import collections
import json
import sys


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    groups = collections.OrderedDict()
    for r in rows:
        groups.setdefault((r["case"], r["dtype"]), []).append(r)
    checks = len(rows)
    failed = [r for r in rows if not r["pass"]]
    print(f"{checks} checks, {checks - len(failed)} within tolerance, {len(failed)} failed")
    print()
    print("| case | dtype | devices | max relative error | tolerance | pass |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (case, dtype), rs in groups.items():
        devices = ",".join(str(d) for d in sorted({r["devices"] for r in rs}))
        worst = max(r["rel_error"] for r in rs)
        ok = all(r["pass"] for r in rs)
        print(f"| {case} | {dtype} | {devices} | {worst:.2e} | {rs[0]['tolerance']:g} | "
              f"{'yes' if ok else 'NO'} |")
    for r in failed:
        print(f"FAILED: {json.dumps(r)}")


if __name__ == "__main__":
    main(sys.argv[1])
