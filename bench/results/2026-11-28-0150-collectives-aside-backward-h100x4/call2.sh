#!/bin/bash
# Session 64 call 2 (4 GPUs): the MLP block's saving backward at D = 4 with NCCL's CTAs
# limited (NCCL_MAX_CTAS 8, 2) to see whether the aside collectives' loss is their SMs; then
# a trace of the unpipelined_aside program (forced through a plan file) at 8192,4096,14336.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
BIN=.gpu/bin
export CUDA_VISIBLE_DEVICES=0,1,2,3
Q="index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-before.txt" 2>&1
mkdir -p "$OUT/r"
for ctas in 8 2; do
  NCCL_MAX_CTAS=$ctas timeout 150 $BIN/backward_bench --devices 4 --ops mlp > "$OUT/r/ctas$ctas.log" 2>&1
  echo "ctas $ctas rc=$?" >> "$OUT/r/summary.txt"
done
rm -rf /tmp/bwtrace; mkdir -p /tmp/bwtrace
cp .gpu/quick/plans-aside.json /tmp/plans-aside.json
FUSION_PLAN_CACHE=/tmp/plans-aside.json FUSION_TRACE=/tmp/bwtrace timeout 120 $BIN/backward_bench --devices 4 --ops mlp --mlp-shapes 8192,4096,14336 --iters 3 --warmup 1 > "$OUT/r/traced.log" 2>&1
echo "traced rc=$?" >> "$OUT/r/summary.txt"
for f in $(ls -t /tmp/bwtrace | grep backward_saved | head -4); do cp /tmp/bwtrace/$f "$OUT/r/$f"; done
FUSION_PLAN_CACHE=/tmp/plans-aside.json timeout 120 $BIN/backward_bench --devices 4 --ops mlp --mlp-shapes "8192,4096,14336;16384,8192,28672" > "$OUT/r/forced.log" 2>&1
echo "forced rc=$?" >> "$OUT/r/summary.txt"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-after.txt" 2>&1
cp "$OUT/clocks-before.txt" "$OUT/r/"
(cd "$OUT" && tar czf all.tgz r && rm -rf r clocks-before.txt)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt /tmp/r/clocks-after.txt
for f in ctas8 ctas2; do echo "== $f"; grep -E "backward_saved: plan:|^//   (default|unpipelined)" /tmp/r/$f.log | cut -c1-80; grep -E "^MLP .* backward " /tmp/r/$f.log | cut -c1-70; done
echo "== forced"; grep -E "^MLP .* (backward|gemm_d|ag_dy|rs_dx) " /tmp/r/forced.log | cut -c1-90
