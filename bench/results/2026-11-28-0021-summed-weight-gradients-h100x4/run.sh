#!/bin/bash
# Session 63 call 6 (4 GPUs): the epilogue tests on the CUDA backend (the GEMM summed over
# its blocks, folded and block by block), the MLP block's backward at D = 4 against
# PyTorch (the unpipelined candidate's weight gradients now one GEMM each), then the
# conformance suite in bf16 and the layer tests while time is left.
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
FUSION_BACKEND=cuda timeout 120 .gpu/bin/test-epilogues --test-threads=1 > "$OUT/epilogues.log" 2>&1
echo "epilogues rc=$? $(grep 'test result' "$OUT/epilogues.log")" >> "$OUT/summary.txt"
FUSION_BACKEND=cuda timeout 120 .gpu/bin/test-epilogues --ignored --test-threads=1 > "$OUT/epilogues-gpu.log" 2>&1
echo "epilogues --ignored rc=$? $(grep 'test result' "$OUT/epilogues-gpu.log")" >> "$OUT/summary.txt"
mkdir -p "$OUT/bw"
s=$SECONDS
OUT="$OUT/bw" BACKWARD_D=4 BACKWARD_ARGS="--ops mlp" timeout 240 bash bench/run-backward.sh > "$OUT/bw/backward.log" 2>&1
echo "backward rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
left=$((560 - (SECONDS - T0)))
if [ $left -gt 60 ]; then
  FUSION_BACKEND=cuda FUSION_TEST_DTYPE=bf16 timeout $left .gpu/bin/test-conformance --test-threads=1 > "$OUT/conformance-bf16.log" 2>&1
  echo "conformance bf16 rc=$? $(grep 'test result' "$OUT/conformance-bf16.log")" >> "$OUT/summary.txt"
fi
left=$((570 - (SECONDS - T0)))
if [ $left -gt 60 ]; then
  FUSION_BACKEND=cuda timeout $left .gpu/bin/test-layers --test-threads=1 > "$OUT/layers.log" 2>&1
  echo "layers rc=$? $(grep 'test result' "$OUT/layers.log")" >> "$OUT/summary.txt"
fi
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-after.txt" 2>&1
tar czf "$OUT/all.tgz" -C "$OUT" bw clocks-before.txt clocks-after.txt summary.txt epilogues.log epilogues-gpu.log conformance-bf16.log layers.log 2>/dev/null
cat "$OUT/summary.txt" "$OUT/clocks-after.txt"
grep -E "^\| MLP" "$OUT/bw/backward.log"
grep -hE "plan:|//   unpipelined " "$OUT"/bw/ours-d4.log | cut -c1-110 | head -24
find "$OUT" -mindepth 1 ! -name all.tgz -delete
