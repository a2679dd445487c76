#!/bin/bash
# Session 64 call 5 (2 GPUs, or 4): the MLP block's saving backward with dW2 after the
# gather-scatter loop (one GEMM summed over every block, dW1 still per block; plan space
# 17) against the build before it (.gpu/ab/backward_bench.old), alternating builds, each
# tuned into its own plan file; PyTorch in the same call.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
Q="index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
mkdir -p "$OUT/r"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-before.txt" 2>&1
n=$(nvidia-smi -L | wc -l)
port=29591
for d in 4 2; do
  [ "$d" -le "$n" ] || continue
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  for round in 1 2; do
    for b in new old; do
      bin=.gpu/bin/backward_bench; [ $b = old ] && bin=.gpu/ab/backward_bench.old
      s=$SECONDS
      FUSION_PLAN_CACHE="$OUT/r/plans-$b-d$d.json" timeout 110 $bin --devices $d --ops mlp --json "$OUT/r/$b-d$d-r$round.jsonl" > "$OUT/r/$b-d$d-r$round.log" 2>&1
      echo "$b D=$d round $round rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
    done
  done
  timeout 100 python3 bench/torch_backward.py --port $port --out "$OUT/r/torch-d$d.jsonl" --ops mlp > "$OUT/r/torch-d$d.log" 2>&1
  echo "torch D=$d rc=$?" >> "$OUT/r/summary.txt"
  port=$((port + 1))
  for b in new old; do
    python3 bench/report_backward.py "$OUT/r/$b-d$d-r2.jsonl" "$OUT/r/torch-d$d.jsonl" > "$OUT/r/table-$b-d$d.md" 2>&1
  done
done
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/r/clocks-after.txt" 2>&1
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt /tmp/r/clocks-after.txt
for f in /tmp/r/*-r*.log; do echo "== $f"; grep -E "^MLP +[0-9]+ +[0-9]+ +[0-9]+ +backward " $f | cut -c1-90; done
for f in /tmp/r/table-*.md; do echo "== $f"; grep -hE "^\| MLP" $f | cut -d'|' -f2-13,16; done
