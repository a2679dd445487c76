#!/bin/bash
# One GPU: Nsight Compute (full set, line info) of the plain kernel, the ReduceScatter entry
# own-first (way 2) and interleaved (way 4) aimed at the GPU itself at 8192,8192,2048 (the
# local GEMM of the D = 4 row 8192^3). reps 1: problem 1 launches 5 plain + 10 rs.
set -u
mkdir -p "$OUT"
cd bench/hopper_gemm
nvcc -std=c++17 -O3 -lineinfo -cudart shared -cudadevrt none -gencode=arch=compute_90a,code=sm_90a self_harness.cu -lcublas -lcuda -o /tmp/self > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
/tmp/self 20 > "$OUT/self.log" 2>&1; tail -12 "$OUT/self.log"
timeout 400 ncu -k regex:'hopper_gemm_(rs_)?bf16_nn' --launch-skip 15 --launch-count 3 --set full --import-source yes \
  -o "$OUT/prof" /tmp/self 1 > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"
ncu --import "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
ncu --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
grep -E "hopper_gemm|^    Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Compute \(SM\)|Issued Warp|No Eligible|Stall|Warp Cycles Per Issued" "$OUT/details.txt" | head -60
ls -la "$OUT"
xz -T0 "$OUT/sass.csv"; gzip "$OUT/details.txt"
