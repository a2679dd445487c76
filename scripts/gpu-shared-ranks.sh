#!/usr/bin/env bash
# What a machine with fewer GPUs than ranks can check of the copy-engine pipelines: two
# ranks on the visible GPUs (both on GPU 0 on a one-GPU machine, `cuda_world_sharing_gpus`;
# their hand-offs go through events and the host, since a device-side flag wait for a peer
# on the same GPU can deadlock). Runs the shared-rank graph test twice (the AG+GEMM,
# GEMM+ReduceScatter ring and MLP block pipelines against the CPU backend, eagerly; ranks
# sharing a GPU refuse to replay, and the test checks that they say why), the runtime's GPU
# unit tests three times (flag hand-offs between two ranks of one GPU set up by hand, eager
# and replayed, their host cost against hand-offs through events, and a flag wait for a rank
# that never sends ending in an error), and host_costs on the two ranks (tiny copy-engine
# pipelines, walked, 2 to 16 stream iterations). Binaries from scripts/stage-gpu.sh.
# Usage: scripts/gpu-shared-ranks.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
# A hang fails within 30 s instead of 60.
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
step host-costs-shared 90 $BIN/host_costs --devices 2 --share-gpus
step host-costs-shared-2 90 $BIN/host_costs --devices 2 --share-gpus
grep -h "matches the CPU\|ranks:" "$OUT"/cuda_graphs*.log | sort | uniq -c
grep -h "hand-off host cost" "$OUT"/runtime_unit_gpu-*.log
cat "$OUT/host-costs-shared.log" "$OUT/host-costs-shared-2.log"
printf '%s\n' "${summary[@]}"
