#!/usr/bin/env bash
# One device call: our overlap benchmark and the PyTorch baseline on the same shapes, on
# all GPUs (D = 4 on nvidia-h200-x4) and on two of them (D = 2), then the comparison table.
# Binaries come from scripts/stage-gpu.sh (.gpu/bin). Logs and JSON lines go to $OUT.
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
timeout 300 $BIN/overlap_bench --json "$OUT/ours-d$n.jsonl" $ARGS >"$OUT/ours-d$n.log" 2>&1; echo "ours D=$n rc=$?"
timeout 300 python3 bench/torch_baseline.py --out "$OUT/torch-d$n.jsonl" >"$OUT/torch-d$n.log" 2>&1; echo "torch D=$n rc=$?"
if [ "$n" -gt 2 ] && [ -z "${SKIP_D2:-}" ]; then
    timeout 200 $BIN/overlap_bench --devices 2 --json "$OUT/ours-d2.jsonl" $ARGS >"$OUT/ours-d2.log" 2>&1; echo "ours D=2 rc=$?"
    CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 bench/torch_baseline.py --port 29534 --out "$OUT/torch-d2.jsonl" >"$OUT/torch-d2.log" 2>&1; echo "torch D=2 rc=$?"
fi
files=("$OUT/ours-d$n.jsonl" "$OUT/torch-d$n.jsonl")
[ -f "$OUT/ours-d2.jsonl" ] && files+=("$OUT/ours-d2.jsonl" "$OUT/torch-d2.jsonl")
python3 bench/report.py "${files[@]}" | tee "$OUT/table.md"
tail -3 "$OUT/ours-d$n.log"
