#!/usr/bin/env bash
# Fusions inside someone else's program, on one GPU (binaries from scripts/stage-gpu.sh,
# built with CUDARC_CUDA_VERSION=13000): the caller's-stream tests of tests/caller_stream.rs
# (inputs written by the caller's kernel on its stream, the call on that stream, outputs
# read by the caller's kernel there, no host wait in between, 1,000 calls with fresh inputs
# walked and replayed, and on the per-thread default streams of two threads; a capturing
# stream is refused with the reason), the cudarc-buffer tests, the single-GPU conformance
# cases and CUDA-graph tests (those needing two GPUs skip), and host_costs (the replayed one-GEMM call on the rank's own stream, on a caller's
# stream and on the per-thread default stream, in one process) twice. When another
# build's host_costs is staged as .gpu/bin/host_costs_base (e.g. the commit before a
# change), the two alternate, for an A/B of the call's host cost in one device call.
# Usage: scripts/gpu-caller-stream.sh   (logs in $OUT, a short table last)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=30
BIN=.gpu/bin
source scripts/gpu-lib.sh
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} >"$OUT/caller-stream-machine.txt" 2>&1
step test-caller_stream 180 $BIN/test-caller_stream --ignored --test-threads=1 --nocapture
step test-cuda_buffers 120 $BIN/test-cuda_buffers --ignored --test-threads=1
step test-conformance-1gpu 240 $BIN/test-conformance --test-threads=1
step test-cuda_graphs 240 $BIN/test-cuda_graphs --ignored --test-threads=1
STEP_PATTERN='rror|us per call'
for i in 1 2; do
    step host-costs-$i 120 $BIN/host_costs --devices 1
    if [ -x $BIN/host_costs_base ]; then
        step host-costs-base-$i 120 $BIN/host_costs_base --devices 1
    fi
done
cat "$OUT/caller-stream-machine.txt"
grep -h "caller's stream:\|per-thread streams" "$OUT/test-caller_stream.log"
for f in "$OUT"/host-costs-*.log; do
    echo "$(basename "$f" .log):"
    grep -h "one-GEMM fusion call\|minus the rank" "$f"
done
printf '%s\n' "${summary[@]}"
