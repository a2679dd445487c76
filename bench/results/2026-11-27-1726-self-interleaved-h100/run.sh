#!/bin/bash
# Session 59, call D: the communicating entries aimed at the GPU itself (self_harness.cu),
# now with the ReduceScatter entry's interleaved walk (the runtime's), on one GPU.
set -u
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/machine.txt" 2>&1
cd bench/hopper_gemm
nvcc -std=c++17 -O3 -cudart shared -cudadevrt none -gencode=arch=compute_90a,code=sm_90a self_harness.cu -lcublas -lcuda -o /tmp/self > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
timeout 300 /tmp/self 20 > "$OUT/self.log" 2>&1; echo "rc=$?" >> "$OUT/self.log"
cat "$OUT/machine.txt"; sed -n '/^    M     N/,$p' "$OUT/self.log"
