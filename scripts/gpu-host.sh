#!/usr/bin/env bash
# Host cost on a lent GPU (binaries from scripts/stage-gpu.sh): host_costs (enqueuing a GEMM,
# a stream wait, a copy kernel; the Matmul node of a walked program; a one-GEMM call walked
# and replayed as a CUDA graph), and the overlap benchmark's host time per call of the collective AG+GEMM pipeline for 2-16 stream
# iterations, walked and replayed. Usage: scripts/gpu-host.sh [devices]   (default: all GPUs)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
STEP_PATTERN='us per call|rror'
source scripts/gpu-lib.sh
D=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$D" -ge 1 ] 2>/dev/null || D=1
step host-costs 120 $BIN/host_costs --devices 1
step host-per-call 300 $BIN/overlap_bench --devices "$D" --ops ag --shapes 4096,1024,1024 \
    --transports "" --chunks 2 --streams 2 --rs-subchunks "" --iters 5 --warmup 2 \
    --json "$OUT/host-per-call.jsonl"
cat "$OUT/host-costs.log"
grep -h "host per call\|host overhead" "$OUT/host-per-call.log"
printf '%s\n' "${summary[@]}"
