#!/usr/bin/env bash
# Builds the Hopper GEMM's standalone checks and benchmarks (nvcc 12.3+, cuBLAS):
#   hopper_gemm_bench     one GPU, the GEMM against cuBLAS (harness.cu)
#   hopper_gemm_rs_bench  D GPUs of one process, GEMM+ReduceScatter in the epilogue
#   hopper_gemm_ag_bench  D GPUs of one process, AllGather+GEMM on ready words
#   hopper_gemm_self_bench one GPU, the communicating entries aimed at the GPU itself
# Usage: build.sh [output directory]
set -eu
# The output directory is taken relative to the caller's directory, then the sources' own.
OUTDIR=$(mkdir -p "${1:-$(dirname "$0")}" && cd "${1:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")"
FLAGS="-std=c++17 -O3 -cudart shared -cudadevrt none -gencode=arch=compute_90a,code=sm_90a"
LIBS="-lcublas -lcuda"
[ -n "${CUDA_LIB:-}" ] && LIBS="-L$CUDA_LIB $LIBS"
nvcc $FLAGS harness.cu $LIBS -o "$OUTDIR/hopper_gemm_bench"
nvcc $FLAGS rs_harness.cu $LIBS -o "$OUTDIR/hopper_gemm_rs_bench"
nvcc $FLAGS ag_harness.cu $LIBS -o "$OUTDIR/hopper_gemm_ag_bench"
nvcc $FLAGS self_harness.cu $LIBS -o "$OUTDIR/hopper_gemm_self_bench"
