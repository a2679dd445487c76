#!/usr/bin/env bash
# Builds the Hopper GEMM's standalone check and benchmark (needs nvcc 12.3+ and cuBLAS).
set -eu
cd "$(dirname "$0")"
OUTDIR=${1:-.}
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v harness.cu \
    -lcublas -lcuda -o "$OUTDIR/hopper_gemm_bench" 2>&1 | grep -v "^$" | grep -E "hopper_gemm|registers|spill|error|warning" || true
test -x "$OUTDIR/hopper_gemm_bench"
