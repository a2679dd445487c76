#!/usr/bin/env bash
# The candle Llama layer on one GPU (issue 27): candle's CUDA device, a prefill of
# --prefill tokens and decode steps, the fusions' layer against --candle-tp and
# --candle-only, each checked against candle alone in f32. The binary is built here with
#   CUDA_HOME=<toolkit> CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000 \
#     cargo build --release --features candle-cuda --example candle_llama
# (candle links CUDA dynamically) and staged as $BIN/candle_llama.
# Usage: BIN=.gpu/bin scripts/gpu-candle.sh [prefill] [decode-steps]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
BIN=${BIN:-.gpu/bin}
PREFILL=${1:-2048}
STEPS=${2:-100}
mkdir -p "$OUT"
source scripts/gpu-env.sh
# A binary linked against CUDA (candle's dynamic linking) needs cuBLAS, cuRAND, the CUDA
# runtime and NCCL by their sonames: PyTorch's wheels have them.
for lib in libcublas.so.13 libcurand.so.10 libcudart.so.13 libnccl.so.2; do
    found=$(python3 -c "import sys,glob
for p in sys.path:
    for f in glob.glob(p + '/nvidia/**/$lib', recursive=True):
        print(f); raise SystemExit" 2>/dev/null)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
done
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/machine.txt"
ldd "$BIN/candle_llama" | grep -E "cuda|cublas|curand|nccl|not found" >>"$OUT/machine.txt"
summary=()
run() {
    local name=$1; shift
    local start=$SECONDS
    timeout 240 "$BIN/candle_llama" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-22s rc=%d %3ds  %s' "$name" "$rc" $((SECONDS - start)) \
        "$(grep -E 'prefill|decode:|check:|copies|error' "$OUT/$name.log" | tr -s ' ' | tr '\n' '|' | cut -c1-420)")")
}
W="$OUT/llama3-8b-layer.safetensors"
common=(--llama3-8b --weights "$W")
full=(--prefill "$PREFILL" --decode-steps "$STEPS")
run fusions-bf16 "${common[@]}" "${full[@]}" --dtype bf16
run candle-tp-bf16 "${common[@]}" "${full[@]}" --dtype bf16 --candle-tp
run candle-only-bf16 "${common[@]}" "${full[@]}" --dtype bf16 --candle-only
run fusions-f32 "${common[@]}" --prefill "$PREFILL" --decode-steps 8 --dtype f32
run fusions-bf16-decode8 "${common[@]}" --dtype bf16 --prefill 64 --decode-tokens 8 --decode-steps 50
run candle-tp-bf16-decode8 "${common[@]}" --dtype bf16 --prefill 64 --decode-tokens 8 --decode-steps 50 --candle-tp
rm -f "$W"
cat "$OUT/machine.txt"
printf '%s\n' "${summary[@]}"
