#!/usr/bin/env bash
# Runs on a lent GPU machine (binaries staged by scripts/stage-gpu.sh into .gpu/bin): the
# memory soak of examples/soak.rs on 2 GPUs. 100,000 calls of the small AG+GEMM P2P
# pipeline (copy engines) inside one world run, 100,000 of the collective pipeline (NCCL,
# replayed as a CUDA graph), and 2,000 world runs of one P2P call each; at each checkpoint
# host RSS, each device's memory in use and the copy-engine events alive. Logs and JSON
# lines go to $OUT; the growth lines are printed last (each must end in "flat": growth
# under 1 MB after the first checkpoint, and no copy-engine events gained; rc=0 says the
# same). Usage: scripts/gpu-soak.sh [devices]   (default 2)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
STEP_PATTERN='growth after|rror'
source scripts/gpu-lib.sh
D=${1:-2}
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} >"$OUT/soak-machine.txt" 2>&1
soak() { # name timeout args...
    local name=$1 t=$2; shift 2
    step "$name" "$t" $BIN/soak --devices "$D" --json "$OUT/$name.jsonl" "$@"
}
soak soak-p2p 240 --fusion p2p --calls 100000
soak soak-collective 240 --fusion collective --calls 100000
soak soak-runs 120 --fusion p2p --calls 0 --runs 2000
cat "$OUT/soak-machine.txt"
for f in soak-p2p soak-collective soak-runs; do
    tail -14 "$OUT/$f.log"
    grep -h "growth after" "$OUT/$f.log"
done
printf '%s\n' "${summary[@]}"
