#!/bin/bash
# Session 65 call 5 (4 GPUs): AllGather + GEMM at D = 4 and 2 (overlap_bench --ops ag,
# the default call tuned into a fresh plan file, then a second process reading it), d99bbad.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT/r"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
export PYTHONUNBUFFERED=1
BIN=.gpu/bin
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$OUT/r/machine.txt" 2>&1
for d in 4 2; do
  visible=$(seq -s, 0 $((d - 1)))
  s=$SECONDS
  CUDA_VISIBLE_DEVICES=$visible timeout 240 $BIN/overlap_bench --devices $d --ops ag --json "$OUT/r/ours-d$d.jsonl" --plan-file "$OUT/r/plans-d$d.json" > "$OUT/r/ours-d$d.log" 2>&1
  echo "ours D=$d rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  s=$SECONDS
  CUDA_VISIBLE_DEVICES=$visible timeout 100 $BIN/overlap_bench --devices $d --ops ag --only-default --host-iterations "" --plan-file "$OUT/r/plans-d$d.json" > "$OUT/r/ours-d$d-second.log" 2>&1
  echo "ours D=$d second rc=$? $((SECONDS-s))s" >> "$OUT/r/summary.txt"
  : > "$OUT/r/torch-d$d.jsonl"
done
python3 bench/report.py "$OUT/r/ours-d4.jsonl" "$OUT/r/torch-d4.jsonl" "$OUT/r/ours-d2.jsonl" "$OUT/r/torch-d2.jsonl" > "$OUT/r/table.md" 2>&1
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt /tmp/r/machine.txt
grep -h "plan decisions" /tmp/r/ours-d*.log
grep -E "AG\+GEMM" /tmp/r/table.md | head -12
tail -5 /tmp/r/ours-d4.log
