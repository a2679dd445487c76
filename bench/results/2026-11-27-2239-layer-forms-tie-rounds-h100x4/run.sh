#!/bin/bash
# Call G (4 GPUs): the MLP block's forms with default options at D = 4 and 2, each against
# the project's form in alternation over 9 rounds (layer_bench --ab-rounds default), the
# ratio of the slowest rank's alternating medians; plan space 13; tuning revision 4 (ties
# within 3% timed 6 rounds more).
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export RUST_BACKTRACE=1
BIN=.gpu/bin
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; } > "$OUT/machine.txt" 2>&1
: > "$OUT/none.jsonl"
for d in 4 2; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  timeout 260 $BIN/layer_bench --devices $d --only-default --plan-file "$OUT/plans-d$d.json" --json "$OUT/forms-d$d.jsonl" > "$OUT/forms-d$d.log" 2>&1; echo "forms D=$d rc=$?"
  python3 bench/report_layers.py "$OUT/forms-d$d.jsonl" "$OUT/none.jsonl" > "$OUT/table-d$d.md" 2>&1
done
cat "$OUT/machine.txt"
for d in 4 2; do echo "== D=$d"; sed -n '/form \/ it/,$p' "$OUT/table-d$d.md" | awk -F'|' 'NR>2 {print $3,$4,$5,$6,$10,$11,$16}'; done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz ! -name "table-*" -delete
