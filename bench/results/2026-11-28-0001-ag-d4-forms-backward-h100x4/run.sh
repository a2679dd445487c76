#!/bin/bash
# Session 63 call 5 (4x H200): clocks; AllGather + GEMM at D = 4 (overlap_bench --ops ag:
# every variant, the default call tuned, a second process reading the plans) for issue 33's
# <= 1.05x of the bound; the MLP block's forms at D = 4 and 2; the MLP block's backward and
# training step at D = 4 against PyTorch; clocks again.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export RUST_BACKTRACE=1
T0=$SECONDS
Q="index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-before.txt" 2>&1
mkdir -p "$OUT/ag"
OUT="$OUT/ag" OVERLAP_D=4 SKIP_TORCH=1 BENCH_ARGS="--ops ag" timeout 300 bash bench/run-overlap.sh > "$OUT/ag/run.log" 2>&1
echo "overlap ag D=4 rc=$? $((SECONDS-T0))s" >> "$OUT/summary.txt"
: > "$OUT/none.jsonl"
mkdir -p "$OUT/forms"
for d in 4 2; do
  [ $((SECONDS - T0)) -lt 330 ] || break
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  s=$SECONDS
  timeout 150 .gpu/bin/layer_bench --devices $d --only-default --plan-file "$OUT/forms/plans-d$d.json" --json "$OUT/forms/forms-d$d.jsonl" > "$OUT/forms/forms-d$d.log" 2>&1; echo "forms D=$d rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
  python3 bench/report_layers.py "$OUT/forms/forms-d$d.jsonl" "$OUT/none.jsonl" > "$OUT/forms/table-d$d.md" 2>&1
done
export CUDA_VISIBLE_DEVICES=0,1,2,3
if [ $((SECONDS - T0)) -lt 470 ]; then
  mkdir -p "$OUT/bw"
  s=$SECONDS
  OUT="$OUT/bw" BACKWARD_D=4 BACKWARD_ARGS="--ops mlp" timeout $((585 - (SECONDS - T0))) bash bench/run-backward.sh > "$OUT/bw/backward.log" 2>&1
  echo "backward rc=$? $((SECONDS-s))s" >> "$OUT/summary.txt"
fi
nvidia-smi --query-gpu=$Q --format=csv > "$OUT/clocks-after.txt" 2>&1
tar czf "$OUT/all.tgz" -C "$OUT" ag forms bw clocks-before.txt clocks-after.txt summary.txt 2>/dev/null
cat "$OUT/clocks-before.txt" "$OUT/summary.txt" "$OUT/clocks-after.txt"
grep -E "^\| AG" "$OUT/ag/table.md" | awk -F'|' '{print $3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13}'
for d in 4 2; do echo "== D=$d"; sed -n '/form \/ it/,$p' "$OUT/forms/table-d$d.md" 2>/dev/null | awk -F'|' 'NR>2 {print $3,$4,$5,$6,$10,$11,$16}'; done
grep -E "^\| MLP" "$OUT/bw/backward.log" 2>/dev/null
find "$OUT" -mindepth 1 ! -name all.tgz -delete
