#!/usr/bin/env bash
# One run on one GPU machine: our overlap benchmark and the PyTorch baseline on the same shapes, on
# all GPUs (D = 4 on nvidia-h200-x4, 8 on nvidia-h200-x8) and on the first 4 and 2 of them,
# then the comparison table.
# Binaries come from scripts/stage-gpu.sh (.gpu/bin). Logs and JSON lines go to $OUT.
# Run as `bash scripts/gpu.sh overlap`.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-bench-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export PYTHONUNBUFFERED=1
BIN=.gpu/bin
ARGS=${BENCH_ARGS:-}
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} >"$OUT/machine.txt" 2>&1
n=$(nvidia-smi -L | wc -l)
# D = all GPUs, then 4 and 2 on the first GPUs where there are more (SKIP_D2=1: all only;
# OVERLAP_D="4 2": those counts only; SKIP_TORCH=1: ours only).
counts=("$n")
if [ -z "${SKIP_D2:-}" ]; then
    for d in 4 2; do [ "$d" -lt "$n" ] && counts+=("$d"); done
fi
if [ -n "${OVERLAP_D:-}" ]; then
    read -r -a counts <<<"$OVERLAP_D"
fi
files=()
port=29530
for d in "${counts[@]}"; do
    visible=$(seq -s, 0 $((d - 1)))
    # The default calls tune their plans into a fresh plan file; a second process with the
    # same file must read every plan from it and time nothing.
    rm -f "$OUT/plans-d$d.json"
    CUDA_VISIBLE_DEVICES=$visible timeout 400 $BIN/overlap_bench --devices "$d" --json "$OUT/ours-d$d.jsonl" \
        --plan-file "$OUT/plans-d$d.json" $ARGS >"$OUT/ours-d$d.log" 2>&1; echo "ours D=$d rc=$?"
    CUDA_VISIBLE_DEVICES=$visible timeout 120 $BIN/overlap_bench --devices "$d" --only-default --host-iterations "" \
        --plan-file "$OUT/plans-d$d.json" $ARGS >"$OUT/ours-d$d-second.log" 2>&1; echo "ours D=$d second process rc=$?"
    grep -h "plan decisions" "$OUT/ours-d$d.log" "$OUT/ours-d$d-second.log"
    port=$((port + 1))
    if [ -z "${SKIP_TORCH:-}" ]; then
        CUDA_VISIBLE_DEVICES=$visible timeout 300 python3 bench/torch_baseline.py --port $port --out "$OUT/torch-d$d.jsonl" >"$OUT/torch-d$d.log" 2>&1; echo "torch D=$d rc=$?"
    else
        : >"$OUT/torch-d$d.jsonl"
    fi
    files+=("$OUT/ours-d$d.jsonl" "$OUT/torch-d$d.jsonl")
done
python3 bench/report.py "${files[@]}" | tee "$OUT/table.md"
tail -3 "$OUT/ours-d$n.log"
