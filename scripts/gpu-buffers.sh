#!/usr/bin/env bash
# Runs on a GPU machine with 2 or more GPUs (binaries staged by scripts/stage-gpu.sh into
# .gpu/bin): tensors over cudarc buffers. The GPU tests of tests/cuda_buffers.rs, then the
# `cuda_buffers` example on 2 GPUs in f32, bf16 and f16 (inputs and outputs in cudarc
# buffers, checked against an f64 host reference). Logs go to $OUT; a short table is
# printed last. Success: every rc is 0 and every example line says "check: ... ok".
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
source scripts/gpu-lib.sh
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} >"$OUT/buffers-machine.txt" 2>&1
step test-cuda_buffers 120 $BIN/test-cuda_buffers --ignored --test-threads=1
for dt in f32 bf16 f16; do
    step "cuda_buffers-$dt" 120 $BIN/cuda_buffers --devices 2 --dtype "$dt"
done
cat "$OUT/buffers-machine.txt"
cat "$OUT/cuda_buffers-bf16.log"
printf '%s\n' "${summary[@]}"
