#!/usr/bin/env bash
# One run on one GPU machine (4 GPUs, or 2): the derived backward of the tensor-parallel
# layers against PyTorch's eager autograd, at D = 4 and D = 2 (the counts the machine has),
# then the table. Tuning every backward's plan at its first call takes 10-50 s per row,
# so one device count takes up to ~8 minutes: pick one per call (BACKWARD_D=4).
#   1. backward_bench (bench/src/bin/backward_bench.rs): per layer (the MLP block, and
#      AG+GEMM and GEMM+RS at the overlap benchmark's shapes) the backward called with
#      default options (its plan tuned at its first call, into a fresh plan file
#      $OUT/plans-d$D.json through FUSION_PLAN_CACHE), checked against a reference of GEMMs
#      and collectives alone, its GEMMs alone, the forward and a training step: first in
#      the saving form (the default training step) for every layer, then in the
#      recomputing form; rows are written as they come, so a cut run keeps the first;
#   2. bench/torch_backward.py: PyTorch eager autograd with NCCL, the same layers and shapes;
#   3. bench/report_backward.py -> $OUT/table.md, printed last.
# Binaries come from scripts/stage-gpu.sh (.gpu/bin). Logs and JSON lines go to $OUT.
# Run as `bash scripts/gpu.sh backward`.
# BACKWARD_D="4 2" picks the device counts; BACKWARD_ARGS adds options that both take
# (--ops, --shapes, --mlp-shapes, --iters, --warmup).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-backward-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
BIN=.gpu/bin
n=$(nvidia-smi -L | wc -l)
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} >"$OUT/machine.txt" 2>&1
counts=()
for d in ${BACKWARD_D:-4 2}; do [ "$d" -le "$n" ] && counts+=("$d"); done
summary=()
step() { # name timeout command...
    local name=$1 t=$2; shift 2
    local start=$SECONDS
    CUDA_VISIBLE_DEVICES=$visible timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-16s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E 'rror|off by|Traceback|input seed' "$OUT/$name.log" | tail -1 | cut -c1-100)")")
}
files=()
port=29571
for d in "${counts[@]}"; do
    visible=$(seq -s, 0 $((d - 1)))
    rm -f "$OUT/plans-d$d.json"
    FUSION_PLAN_CACHE="$OUT/plans-d$d.json" step "ours-d$d" 420 $BIN/backward_bench --devices "$d" \
        --json "$OUT/ours-backward-d$d.jsonl" ${BACKWARD_ARGS:-}
    step "torch-d$d" 100 python3 bench/torch_backward.py --port $port \
        --out "$OUT/torch-backward-d$d.jsonl" ${BACKWARD_ARGS:-}
    port=$((port + 1))
    files+=("$OUT/ours-backward-d$d.jsonl" "$OUT/torch-backward-d$d.jsonl")
done
python3 bench/report_backward.py "${files[@]}" >"$OUT/table.md" 2>&1
cat "$OUT/machine.txt"
printf '%s\n' "${summary[@]}"
cat "$OUT/table.md"
