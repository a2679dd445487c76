#!/bin/bash
# Session 64 call 1 (4 GPUs): the MLP block's backward at D = 4 and 2 against PyTorch,
# with the whole-collectives-aside candidates in the plan space (plan space 17).
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1
Q="index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-before.txt" 2>&1
export CUDA_VISIBLE_DEVICES=0,1,2,3
for d in 4 2; do
  mkdir -p "$OUT/bw$d"
  s=$SECONDS
  OUT="$OUT/bw$d" BACKWARD_D="$d" BACKWARD_ARGS="--ops mlp" timeout 200 bash bench/run-backward.sh > "$OUT/bw$d/backward.log" 2>&1
  echo "backward D=$d rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
done
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-after.txt" 2>&1
tar czf "$OUT/all.tgz" -C "$OUT" bw4 bw2 clocks-before.txt clocks-after.txt summary.txt 2>/dev/null
cat "$OUT/summary.txt" "$OUT/clocks-after.txt"
grep -hE "^\| MLP" "$OUT/bw4/backward.log" "$OUT/bw2/backward.log" 2>/dev/null | cut -d'|' -f2-13,16
grep -hE "backward_saved: plan:|^//   (default|unpipelined|collectives_aside)" "$OUT"/bw4/ours-d4.log "$OUT"/bw2/ours-d2.log 2>/dev/null | cut -c1-90
find "$OUT" -mindepth 1 ! -name all.tgz -delete
