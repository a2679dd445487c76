#!/bin/bash
# Call F (4 GPUs): the layer blocks, ours only, at D = 4 and D = 2 (bench/run-layers.sh with
# LAYER_LITE=1), the default call tuned with `gathered_scattered_gemm` in the plan space.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
for D in 4 2; do
  mkdir -p "$OUT/d$D"
  OUT="$OUT/d$D" LAYER_D=$D LAYER_LITE=1 timeout 270 bash bench/run-layers.sh > "$OUT/d$D/layers.log" 2>&1; echo "layers D=$D rc=$?"
done
for D in 4 2; do
  grep -A8 "ours / bound" "$OUT/d$D/layers.log"
  grep -A8 "best option variant" "$OUT/d$D/layers.log" | cut -d'|' -f2-9,13-16
done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz -delete
