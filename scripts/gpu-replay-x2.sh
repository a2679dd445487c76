#!/usr/bin/env bash
# Replayed calls on two GPUs of one process (binaries from scripts/stage-gpu.sh): the
# CUDA-graph tests (replayed calls bit for bit equal to eager ones with fresh and moved
# inputs, over copy engines and NCCL) and host_costs (enqueue costs, the Matmul node, tiny
# pipelines walked and replayed in bursts from an idle device, what a graph's launch costs
# per kind of node). With scripts/run-overlap-x2.sh (the D = 2 table against PyTorch,
# GEMM+RS with 4 row ranges, the host time per call for 2-16 iterations) it makes issue 13's
# device call: scripts/gpu-x2.sh c.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
STEP_PATTERN='test result|us per call|rror'
source scripts/gpu-lib.sh
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/machine.txt" 2>&1
step cuda-graphs 240 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture
step host-costs 150 $BIN/host_costs --devices 2 --graph-topologies
grep -E "test result|FAILED|panicked" "$OUT/cuda-graphs.log"
cat "$OUT/host-costs.log"
printf '%s\n' "${summary[@]}"
