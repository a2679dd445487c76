#!/usr/bin/env bash
# One run on one GPU machine (2 or 4 GPUs, about 5 minutes): the layer checks on the GPUs, then our layer
# benchmark and PyTorch's on the same shapes, then the table of docs/PERFORMANCE.md.
#   1. tests/layers.rs (MLP, gated MLP, attention projections against f64 references on
#      1 and 2 GPUs, f32 and bf16), tests/epilogues.rs, and the GEMM-epilogue kernel test
#      (cuBLASLt plans and the fallback kernel against the CPU backend);
#   2. layer_bench (bench/src/bin/layer_bench.rs: components alone, sequential, pipelined
#      variants, every plan candidate set by hand, the default call whose plan is tuned at
#      its first call, and the MLP block written in other ways; each checked against our
#      sequential result before it is timed), with a fresh plan file $OUT/plans.json;
#      then again in a second process with the same plan file, only the default calls and
#      the forms: their plans come from the file, with no tuning;
#   3. bench/torch_layers.py (NCCL + cuBLAS sequential, async-TP);
#   4. bench/report_layers.py -> $OUT/table.md, printed last.
# Binaries come from scripts/stage-gpu.sh (.gpu/bin). Logs and JSON lines go to $OUT.
# Run as `bash scripts/gpu.sh layers`.
# LAYER_D=n picks the device count (default 2), LAYER_ARGS adds layer_bench options.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-layers-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
BIN=.gpu/bin
D=${LAYER_D:-2}
visible=$(seq -s, 0 $((D - 1)))
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} >"$OUT/machine.txt" 2>&1
status=()
step() { # name timeout command...
    local name=$1 t=$2; shift 2
    local start=$SECONDS
    CUDA_VISIBLE_DEVICES=$visible timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    status+=("$(printf '%-22s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E 'test result|FAILED|panicked|rror|plan decisions' "$OUT/$name.log" | tail -1 | cut -c1-100)")")
}
export FUSION_TEST_SEED=${FUSION_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
echo "FUSION_TEST_SEED=$FUSION_TEST_SEED" >>"$OUT/machine.txt"
# LAYER_LITE=1: the benchmark alone (no checks, examples, host costs or PyTorch).
if [ -z "${LAYER_LITE:-}" ]; then
    FUSION_BACKEND=cuda FUSION_RESULTS="$OUT/layers-check.jsonl" \
        step check-layers 120 $BIN/test-layers --test-threads=1
    FUSION_BACKEND=cuda step check-epilogues 60 $BIN/test-epilogues --test-threads=1
    step check-gemm-kernels 90 $BIN/test-cuda_kernels --ignored --test-threads=1 gemm
    step example-tp_mlp 60 $BIN/tp_mlp --devices "$D" --dtype bf16 -m 1024 --hidden 1024 -f 1024
    step example-tp_mlp-gated 60 $BIN/tp_mlp --devices "$D" --dtype bf16 --gated -m 1024 --hidden 1024 -f 1024
fi
rm -f "$OUT/plans.json"
step ours 300 $BIN/layer_bench --devices "$D" --plan-file "$OUT/plans.json" \
    --json "$OUT/ours-layers-d$D.jsonl" ${LAYER_ARGS:-}
step ours-second 120 $BIN/layer_bench --devices "$D" --plan-file "$OUT/plans.json" --only-default \
    --json "$OUT/ours-layers-d$D-second.jsonl" ${LAYER_ARGS:-}
if [ -z "${LAYER_LITE:-}" ]; then
    # Host time of enqueuing one GEMM (cuBLASLt from a cached plan).
    step host-costs 60 $BIN/host_costs --devices 1
    step torch 300 python3 bench/torch_layers.py --out "$OUT/torch-layers-d$D.jsonl"
else
    : >"$OUT/torch-layers-d$D.jsonl"
fi
python3 bench/report_layers.py "$OUT/ours-layers-d$D.jsonl" "$OUT/torch-layers-d$D.jsonl" \
    "$OUT/ours-layers-d$D-second.jsonl" >"$OUT/table.md" 2>&1
cat "$OUT/machine.txt"
grep -h "GEMM" "$OUT/host-costs.log" 2>/dev/null | sed 's/^/cuBLASLt plans: /'
printf '%s\n' "${status[@]}"
cat "$OUT/table.md"
