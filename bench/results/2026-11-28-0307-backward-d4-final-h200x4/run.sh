#!/bin/bash
# Session 64 call 8 (4 GPUs): the MLP block's backward at D = 4 against PyTorch with
# dW2 after the gather-scatter loop by default, `gradients_in_loop` and `gradients_after_loop` candidates (78140b2)
# (plan space 18). Ours is cut after its saving rows at D = 2 (the recomputing form's
# tuning is long); PyTorch in the same call.
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
port=29581
for d in 4; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  t=100; [ $d = 2 ] && t=140
  s=$SECONDS
  FUSION_PLAN_CACHE="$OUT/r/plans-d$d.json" timeout $t $BIN/backward_bench --devices $d --ops mlp --json "$OUT/r/ours-d$d.jsonl" > "$OUT/r/ours-d$d.log" 2>&1
  echo "ours D=$d rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  s=$SECONDS
  timeout 100 python3 bench/torch_backward.py --port $port --out "$OUT/r/torch-d$d.jsonl" --ops mlp > "$OUT/r/torch-d$d.log" 2>&1
  echo "torch D=$d rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  port=$((port + 1))
  python3 bench/report_backward.py "$OUT/r/ours-d$d.jsonl" "$OUT/r/torch-d$d.jsonl" > "$OUT/r/table-d$d.md" 2>&1
done
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-after.txt" 2>&1
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt /tmp/r/clocks-after.txt
for d in 4 2; do grep -hE "^\| MLP" /tmp/r/table-d$d.md | cut -d'|' -f2-13,16; done
for d in 4 2; do echo "== D=$d"; grep -E "backward_saved: plan:|^//   (default|pipelined|gradients_|streams|no_epi|ce_one)" /tmp/r/ours-d$d.log | grep -B1 -A10 "backward_saved: plan" | cut -c1-82; done
