#!/bin/bash
# Session 63 call 3 (4 GPUs): the gathered GEMM storing the pre-activation (saving forward)
# checked against the unpipelined plan on 2 and 4 GPUs (with the existing gathered-GEMM
# tests), then the MLP block's backward and training step at D = 4 against PyTorch.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1 FUSION_BACKEND=cuda
T0=$SECONDS
export CUDA_VISIBLE_DEVICES=0,1,2,3
timeout 200 .gpu/bin/test-hopper_gathered_gemm --ignored --test-threads=1 > "$OUT/hopper_gathered_gemm.log" 2>&1
echo "hopper_gathered_gemm rc=$? $((SECONDS-T0))s $(grep 'test result' "$OUT/hopper_gathered_gemm.log")" >> "$OUT/summary.txt"
grep -E "^test |panicked" "$OUT/hopper_gathered_gemm.log" >> "$OUT/summary.txt"
s=$SECONDS
mkdir -p "$OUT/bw"
OUT="$OUT/bw" BACKWARD_D=4 BACKWARD_ARGS="--ops mlp" timeout $((580 - (SECONDS - T0))) bash bench/run-backward.sh > "$OUT/bw/backward.log" 2>&1
echo "backward rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
(cd "$OUT" && tar czf bw.tgz bw && rm -rf bw/*.jsonl bw/*.json)
cat "$OUT/summary.txt"
tail -16 "$OUT/bw/backward.log"
grep -h "plan:" "$OUT"/bw/ours-d4.log | cut -c1-140 | head -12
rm -rf "$OUT/bw"
