#!/usr/bin/env bash
# Runs on a GPU machine (binaries staged by scripts/stage-gpu.sh into .gpu/bin): the
# `timeline` example on $DEVICES GPUs (default 2), which runs the AllGather + GEMM and the
# GEMM + ReduceScatter P2P pipelines (M = K = N = 8192, bf16) traced and draws each call as
# an SVG. Writes $OUT/timeline/{ag_gemm,gemm_rs}.svg and the Chrome traces in
# $OUT/timeline/json/ (one file per call and rank); prints the per-rank busy/overlap lines.
# The pictures go to docs/ (e.g. docs/timeline-ag-gemm-h200x2.svg) with the README line
# that shows them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
DEVICES=${DEVICES:-2}
mkdir -p "$OUT/timeline"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} >"$OUT/timeline/machine.txt" 2>&1
timeout 300 .gpu/bin/timeline --devices "$DEVICES" --out "$OUT/timeline" "$@" 2>&1 | tee "$OUT/timeline/timeline.log"
rc=${PIPESTATUS[0]}
cat "$OUT/timeline/machine.txt"
ls -la "$OUT/timeline" "$OUT/timeline/json"
echo "timeline rc=$rc"
exit "$rc"
