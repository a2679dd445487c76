#!/bin/bash
# Session 63 call 7 (4 GPUs): the MLP block's backward at D = 4 and 2 against PyTorch with
# the gather-scatter loop's weight gradients after its ring send (plan space 16), and the
# saving backward traced at 8192,4096,14336, D = 4.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1
T0=$SECONDS
Q="index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-before.txt" 2>&1
export CUDA_VISIBLE_DEVICES=0,1,2,3
mkdir -p "$OUT/bw"
s=$SECONDS
OUT="$OUT/bw" BACKWARD_D="4" BACKWARD_ARGS="--ops mlp" timeout 200 bash bench/run-backward.sh > "$OUT/bw/backward.log" 2>&1
echo "backward D=4 rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
mkdir -p "$OUT/trace" /tmp/bwtrace
s=$SECONDS
FUSION_TRACE=/tmp/bwtrace timeout 90 .gpu/bin/backward_bench --devices 4 --ops mlp --mlp-shapes 8192,4096,14336 --iters 3 --warmup 1 > "$OUT/trace/bw.log" 2>&1
echo "traced rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
for f in $(ls -t /tmp/bwtrace | grep backward_saved | head -4); do cp /tmp/bwtrace/$f "$OUT/trace/"; done
if [ $((SECONDS - T0)) -lt 360 ]; then
  mkdir -p "$OUT/bw2"
  s=$SECONDS
  OUT="$OUT/bw2" BACKWARD_D="2" BACKWARD_ARGS="--ops mlp" timeout $((560 - (SECONDS - T0))) bash bench/run-backward.sh > "$OUT/bw2/backward.log" 2>&1
  echo "backward D=2 rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
fi
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-after.txt" 2>&1
tar czf "$OUT/all.tgz" -C "$OUT" bw bw2 trace clocks-before.txt clocks-after.txt summary.txt 2>/dev/null
cat "$OUT/summary.txt" "$OUT/clocks-after.txt"
grep -E "^\| MLP" "$OUT/bw/backward.log" "$OUT/bw2/backward.log" 2>/dev/null | cut -d: -f2-
grep -hE "backward_saved: plan:" "$OUT"/bw/ours-d4.log "$OUT"/bw2/ours-d2.log 2>/dev/null | cut -c1-100
find "$OUT" -mindepth 1 ! -name all.tgz -delete
