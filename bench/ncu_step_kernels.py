"""The kernels of a profiled program's last steps, from Nsight Compute's CSV.

`ncu --csv --metrics gpu__time_duration.sum --graph-profiling node --log-file F.csv PROGRAM`
profiles every kernel (inside replayed CUDA graphs too, node by node) in launch order. For
`candle_llama`, whose run ends with the f32 reference layer on one device, the last kernels
in bf16 or f16 before that reference are the last timed step; this prints them with their grid, block and
duration (us), and their sum.

Usage: python3 bench/ncu_step_kernels.py F.csv [kernels]   (default: 30 kernels)

Under ncu every kernel runs alone, so a kernel that waits for other GPUs (a peer-memory or
NCCL collective of a profiled rank) shows the others' time: read collectives elsewhere.
"""

import csv
import sys


def kernels(path):
    lines = (line for line in open(path) if line.startswith('"'))
    rows = list(csv.reader(lines))
    head, rows = rows[0], rows[1:]
    name, value, unit = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
    grid, block = head.index("Grid Size"), head.index("Block Size")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    for r in rows:
        us = float(r[value].replace(",", "")) * scale.get(r[unit], 1e-3)
        yield r[name], r[grid], r[block], us


def main():
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    all_kernels = list(kernels(path))
    # The f32 reference layer: from its first f32 GEMM back over its own f32 kernels
    # (weight conversions, the first RMSNorm) to the step's last low-precision kernel.
    reference = next(
        (i for i, k in enumerate(all_kernels) if "f32f32" in k[0] or "sgemm" in k[0]),
        len(all_kernels),
    )
    marks = ("bf16", "f16", "nvjet", "fusion_", "peer_", "nccl")
    while reference > 0 and not any(m in all_kernels[reference - 1][0] for m in marks):
        reference -= 1
    step = all_kernels[max(0, reference - count):reference]
    total = 0.0
    for kernel, grid, block, us in step:
        total += us
        print(f"{us:9.2f}  {grid:>14} {block:>12}  {kernel[:80]}")
    print(f"{total:9.2f}  in all ({len(step)} kernels; {len(all_kernels)} profiled)")


if __name__ == "__main__":
    main()
