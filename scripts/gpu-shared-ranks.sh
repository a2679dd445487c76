#!/usr/bin/env bash
# What a machine with fewer GPUs than ranks can check of the copy-engine pipelines: two
# ranks on the visible GPUs (both on GPU 0 on a one-GPU machine, `cuda_world_sharing_gpus`)
# hand off through device flags exactly as two GPUs of one process do. Runs the shared-rank
# graph test twice (the AG+GEMM, GEMM+ReduceScatter ring and MLP block pipelines against the
# CPU backend, eagerly; ranks sharing a GPU refuse to replay, and the test checks that they
# say why), the runtime's GPU unit tests three times (flag hand-offs eager and replayed, and
# their host cost against hand-offs through events), and host_costs on the two ranks (tiny
# copy-engine pipelines, walked, 2 to 16 stream iterations). Binaries from
# scripts/stage-gpu.sh.
# Usage: scripts/gpu-shared-ranks.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
# A hang fails within 30 s instead of 60. (Ranks sharing a GPU need the environment of
# `SHARED_GPU_ENVIRONMENT`: the test sets it for itself, host_costs gets it below.)
export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=30
BIN=.gpu/bin
source scripts/gpu-lib.sh
# The shared-GPU case twice (it runs itself in a process with the environment it needs;
# scripts/gpu-check.sh runs the other graph tests).
for i in 1 2; do
    step "cuda_graphs_shared-$i" 90 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture \
        --exact copy_engine_pipelines_on_two_ranks_sharing_the_visible_gpus
done
for i in 1 2 3; do
    step "runtime_unit_gpu-$i" 60 $BIN/test-fusion_runtime_lib --ignored --test-threads=1 --nocapture
done
STEP_PATTERN='rror|us per call'
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
step host-costs-shared 90 $BIN/host_costs --devices 2 --share-gpus
step host-costs-shared-2 90 $BIN/host_costs --devices 2 --share-gpus
unset CUDA_DEVICE_MAX_CONNECTIONS CUDA_MODULE_LOADING
grep -h "matches the CPU\|ranks:" "$OUT"/cuda_graphs*.log | sort | uniq -c
grep -h "hand-off host cost" "$OUT"/runtime_unit_gpu-*.log
cat "$OUT/host-costs-shared.log" "$OUT/host-costs-shared-2.log"
printf '%s\n' "${summary[@]}"
