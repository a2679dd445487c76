#!/bin/bash
# Call C (4 GPUs): the MLP block's forms (the broadcast-weights form fused since plan space
# 12) with default options at D = 4 and 2, each against the project's form in alternation
# (layer_bench --only-default), and a second process on the plan file.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export RUST_BACKTRACE=1
BIN=.gpu/bin
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; } > "$OUT/machine.txt" 2>&1
: > "$OUT/none.jsonl"
for d in 4 2; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  timeout 200 $BIN/layer_bench --devices $d --only-default --plan-file "$OUT/plans-d$d.json" --json "$OUT/forms-d$d.jsonl" > "$OUT/forms-d$d.log" 2>&1; echo "forms D=$d rc=$?"
  timeout 60 $BIN/layer_bench --devices $d --only-default --forms none --plan-file "$OUT/plans-d$d.json" --json "$OUT/second-d$d.jsonl" > "$OUT/second-d$d.log" 2>&1; echo "second D=$d rc=$?"
  python3 bench/report_layers.py "$OUT/forms-d$d.jsonl" "$OUT/none.jsonl" "$OUT/second-d$d.jsonl" > "$OUT/table-d$d.md" 2>&1
done
cat "$OUT/machine.txt"
for d in 4 2; do echo "== D=$d"; sed -n '/form \/ it/,$p' "$OUT/table-d$d.md" | cut -c1-260 | head -30; done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz ! -name "table-*" -delete
