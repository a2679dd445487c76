#!/bin/bash
# Session 63 call 1 (4 GPUs): the MLP block's forms with default options (tie fix, tuning
# revision 4), the saving backward traced at D = 4, the candle layer's decode A/B.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1
BIN=.gpu/bin
T0=$SECONDS
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; } > "$OUT/machine.txt" 2>&1
: > "$OUT/none.jsonl"
mkdir -p "$OUT/forms"
for d in 4 2; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  s=$SECONDS
  timeout 200 $BIN/layer_bench --devices $d --only-default --plan-file "$OUT/forms/plans-d$d.json" --json "$OUT/forms/forms-d$d.jsonl" > "$OUT/forms/forms-d$d.log" 2>&1; echo "forms D=$d rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
  python3 bench/report_layers.py "$OUT/forms/forms-d$d.jsonl" "$OUT/none.jsonl" > "$OUT/forms/table-d$d.md" 2>&1
done
export CUDA_VISIBLE_DEVICES=0,1,2,3
# The saving backward of the MLP block traced (Chrome traces of every call; the last kept).
mkdir -p "$OUT/bwtrace" /tmp/bwtrace
s=$SECONDS
FUSION_TRACE=/tmp/bwtrace timeout 150 $BIN/backward_bench --devices 4 --ops mlp --mlp-shapes 8192,4096,14336 --iters 3 --warmup 1 --json "$OUT/bwtrace/bw.jsonl" > "$OUT/bwtrace/bw.log" 2>&1
echo "backward traced rc=$? $((SECONDS-s))s files $(ls /tmp/bwtrace | wc -l)" >> "$OUT/summary.txt"
ls -t /tmp/bwtrace > "$OUT/bwtrace/files.txt"
for f in $(ls -t /tmp/bwtrace | head -40); do cp /tmp/bwtrace/$f "$OUT/bwtrace/"; done
(cd "$OUT" && tar czf bwtrace.tgz bwtrace && rm -rf bwtrace)
# Decode A/B against the 13:18 build and candle's TP, one round, 1 and 64 tokens.
if [ $((SECONDS - T0)) -lt 330 ]; then
  [ -x .gpu/bin/candle_llama_base ] || xz -dc .gpu/quick/candle_llama_base.xz > .gpu/bin/candle_llama_base && chmod +x .gpu/bin/candle_llama_base
  mkdir -p "$OUT/candle"
  OUT="$OUT/candle" TOKENS="1 64" timeout $((590 - (SECONDS - T0) - 10)) bash scripts/gpu.sh candle-ab 4 1 > "$OUT/candle/table.txt" 2>&1
  echo "candle-ab rc=$? " >> "$OUT/summary.txt"
fi
(cd "$OUT" && tar czf forms.tgz forms && rm -f forms/*.jsonl forms/*.log forms/*.json)
cat "$OUT/machine.txt" "$OUT/summary.txt"
for d in 4 2; do echo "== D=$d"; sed -n '/form \/ it/,$p' "$OUT/forms/table-d$d.md" | awk -F'|' 'NR>2 {print $3,$4,$5,$6,$10,$11,$16}'; done
tail -16 "$OUT/candle/table.txt" 2>/dev/null
