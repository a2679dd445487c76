#!/bin/bash
# Session 65 call 3 (4 GPUs): the backward of the six seed rows' layers (AG+GEMM and
# GEMM+RS) at D = 4 and 2 with d99bbad, PyTorch in the same call.
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
port=29601
for d in 4 2; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  s=$SECONDS
  FUSION_PLAN_CACHE="$OUT/r/plans-d$d.json" timeout 170 $BIN/backward_bench --devices $d --ops ag,rs --json "$OUT/r/ours-d$d.jsonl" > "$OUT/r/ours-d$d.log" 2>&1
  echo "ours D=$d rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  s=$SECONDS
  timeout 100 python3 bench/torch_backward.py --port $port --out "$OUT/r/torch-d$d.jsonl" --ops ag,rs > "$OUT/r/torch-d$d.log" 2>&1
  echo "torch D=$d rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  port=$((port + 1))
  python3 bench/report_backward.py "$OUT/r/ours-d$d.jsonl" "$OUT/r/torch-d$d.jsonl" > "$OUT/r/table-d$d.md" 2>&1
done
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-after.txt" 2>&1
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt && cut -d, -f1-3,7 /tmp/r/clocks-after.txt
for d in 4 2; do grep -hE "^\| (AG|GEMM)" /tmp/r/table-d$d.md | head -6 | cut -d'|' -f2-7,12-13,16; done
for d in 4 2; do echo "== D=$d"; grep -E "backward_saved: plan:" /tmp/r/ours-d$d.log | cut -c1-110; done
