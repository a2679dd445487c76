#!/bin/bash
# Session 59, call C: the fused GEMM tests (scattered and gathered) on 2 and 4 GPUs, then
# the layer benchmark at D = 4 (ours only, lite): the MLP and gated MLP blocks' default
# plans, tuned with the scattered_gemm candidate in the plan space.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
for t in hopper_scattered_gemm hopper_gathered_gemm; do
  timeout 200 $BIN/test-$t --ignored --test-threads=1 > "$OUT/test-$t.log" 2>&1; echo "$t rc=$?" | tee -a "$OUT/test-$t.log"
  grep -v "^ *[0-9]*: \|^ *at " "$OUT/test-$t.log" | grep -B2 -A6 "panicked" | head -20
done
LAYER_D=4 LAYER_LITE=1 timeout 420 bash bench/run-layers.sh > "$OUT/layers.log" 2>&1; echo "layers rc=$?"
grep -h "test result" "$OUT"/test-*.log
tail -30 "$OUT/layers.log"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -type f ! -name logs.tgz -delete
