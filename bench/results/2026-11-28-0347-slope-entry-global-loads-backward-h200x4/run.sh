#!/bin/bash
# Session 65 call 1 (4 GPUs): the slope entry (dH = dY W^T * gelu'(H) on the persistent
# kernel) checked on GPU 0, then the MLP block's backward at D = 4, this build against
# 78140b2's (`.gpu/ab/backward_bench.old`), alternating, PyTorch in the same call.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
BIN=.gpu/bin
Q="index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
mkdir -p "$OUT/r"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-before.txt" 2>&1
s=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 150 $BIN/test-hopper_gemm --ignored --test-threads 1 > "$OUT/r/test-hopper_gemm.log" 2>&1
echo "test-hopper_gemm rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
s=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 100 $BIN/test-epilogues --ignored --test-threads 1 > "$OUT/r/test-epilogues.log" 2>&1
echo "test-epilogues rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
port=29591
d=4
export CUDA_VISIBLE_DEVICES=0,1,2,3
for round in 1 2; do
  for b in new old; do
    exe=$BIN/backward_bench; [ $b = old ] && exe=.gpu/ab/backward_bench.old
    s=$SECONDS
    FUSION_PLAN_CACHE="$OUT/r/plans-$b-$round.json" timeout 100 $exe --devices $d --ops mlp --json "$OUT/r/$b-$round.jsonl" > "$OUT/r/$b-$round.log" 2>&1
    echo "$b round $round rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  done
  if [ $round = 1 ]; then
    s=$SECONDS
    timeout 100 python3 bench/torch_backward.py --port $port --out "$OUT/r/torch-d$d.jsonl" --ops mlp > "$OUT/r/torch-d$d.log" 2>&1
    echo "torch rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  fi
done
for b in new old; do for round in 1 2; do
  python3 bench/report_backward.py "$OUT/r/$b-$round.jsonl" "$OUT/r/torch-d$d.jsonl" > "$OUT/r/table-$b-$round.md" 2>&1
done; done
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-after.txt" 2>&1
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt && cut -d, -f1-3,7 /tmp/r/clocks-after.txt
grep -E "^test result|FAILED|panicked" /tmp/r/test-*.log | head
for b in new old; do for round in 1 2; do echo "== $b $round"; grep -hE "^\| MLP" /tmp/r/table-$b-$round.md | head -3 | cut -d'|' -f3,5-7,12-13,16; done; done
echo "== alone (new round 1)"; grep -hE "gemm_dact_alone|act_grad_alone|gemm_dact_slope_alone" /tmp/r/new-1.log
