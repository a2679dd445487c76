#!/bin/bash
# Session 63 call 4 (4 GPUs): the GPUs' clocks and throttle reasons, then the MLP block's
# backward and training step at D = 4 against PyTorch again (call 3's large rows ran ~2x
# slow for PyTorch too).
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1
nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active,utilization.gpu --format=csv > "$OUT/clocks-before.txt" 2>&1
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >> "$OUT/clocks-before.txt" 2>&1
export CUDA_VISIBLE_DEVICES=0,1,2,3
mkdir -p "$OUT/bw"
OUT="$OUT/bw" BACKWARD_D=4 BACKWARD_ARGS="--ops mlp" timeout 400 bash bench/run-backward.sh > "$OUT/bw/backward.log" 2>&1
echo "backward rc=$?" >> "$OUT/summary.txt"
nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv > "$OUT/clocks-after.txt" 2>&1
(cd "$OUT" && tar czf bw.tgz bw)
cat "$OUT/clocks-before.txt" "$OUT/summary.txt" "$OUT/clocks-after.txt"
tail -16 "$OUT/bw/backward.log"
grep -h "plan:" "$OUT"/bw/ours-d4.log | cut -c1-110 | head -12
rm -rf "$OUT/bw"
