#!/bin/bash
# Session 65 call 7 (4 GPUs): the GEMM+RS layer's backward with its weight gradient after
# the AllGather loop and the gathered GEMM a candidate (this build) against d99bbad's
# (`.gpu/ab/backward_bench.old`), D = 4 (two rounds, alternating, PyTorch in the call) and
# D = 2 (one round); the AG+GEMM layer's too at D = 4 (one round each).
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT/r"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
BIN=.gpu/bin
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/r/machine.txt" 2>&1
run() { # build devices ops tag
  local exe=$BIN/backward_bench; [ $1 = old ] && exe=.gpu/ab/backward_bench.old
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(($2 - 1)))
  local s=$SECONDS
  FUSION_PLAN_CACHE="$OUT/r/plans-$4.json" timeout 120 $exe --devices $2 --ops $3 --json "$OUT/r/$4.jsonl" > "$OUT/r/$4.log" 2>&1
  echo "$4 rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
}
run new 4 rs new-rs-d4-1; run old 4 rs old-rs-d4-1
export CUDA_VISIBLE_DEVICES=0,1,2,3
timeout 100 python3 bench/torch_backward.py --port 29611 --out "$OUT/r/torch-rs-d4.jsonl" --ops rs > "$OUT/r/torch-rs-d4.log" 2>&1
echo "torch rc=$?" >> "$OUT/r/summary.txt"
run new 4 rs new-rs-d4-2; run old 4 rs old-rs-d4-2
run new 2 rs new-rs-d2; run old 2 rs old-rs-d2
run new 4 ag new-ag-d4; run old 4 ag old-ag-d4
for f in new-rs-d4-1 old-rs-d4-1 new-rs-d4-2 old-rs-d4-2; do
  python3 bench/report_backward.py "$OUT/r/$f.jsonl" "$OUT/r/torch-rs-d4.jsonl" > "$OUT/r/table-$f.md" 2>&1
done
for f in new-rs-d2 old-rs-d2 new-ag-d4 old-ag-d4; do
  python3 bench/report_backward.py "$OUT/r/$f.jsonl" /dev/null > "$OUT/r/table-$f.md" 2>&1
done
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt /tmp/r/machine.txt
for f in new-rs-d4-1 old-rs-d4-1 new-rs-d4-2 old-rs-d4-2 new-rs-d2 old-rs-d2 new-ag-d4 old-ag-d4; do echo "== $f"; grep -hE "^\| (AG|GEMM)" /tmp/r/table-$f.md | head -3 | cut -d'|' -f3,5-7,12-13,16; done
for f in new-rs-d4-1 new-rs-d2; do echo "== tuned $f"; grep -E "backward_saved: plan:|^//   (default|gathered_gemm |gradients_in_loop|ce_one|streams)" /tmp/r/$f.log | grep -A6 "backward_saved: plan" | cut -c1-75; done
grep -h "relerr" /tmp/r/new-*.log | grep " backward " | cut -c1-110
