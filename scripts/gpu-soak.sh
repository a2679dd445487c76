#!/usr/bin/env bash
# Runs on a lent GPU machine (binaries staged by scripts/stage-gpu.sh into .gpu/bin): the
# memory soak of examples/soak.rs on 2 GPUs. 100,000 calls of the small AG+GEMM P2P
# pipeline (copy engines) inside one world run, 100,000 of the collective pipeline (NCCL),
# and 2,000 world runs of one P2P call each; at each checkpoint host RSS, each device's
# memory in use and the copy-engine events alive. Logs and JSON lines go to $OUT; the
# growth lines are printed last (each must say "flat": growth under 1 MB after the first
# checkpoint, and no copy-engine events gained).
# Usage: scripts/gpu-soak.sh [devices]   (default 2)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
D=${1:-2}
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} >"$OUT/machine.txt" 2>&1
summary=()
soak() { # name timeout args...
    local name=$1 t=$2; shift 2
    local start=$SECONDS
    timeout "$t" $BIN/soak --devices "$D" --json "$OUT/$name.jsonl" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-16s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - start))")")
    while read -r line; do summary+=("    $line"); done < <(grep -E 'growth after|error' "$OUT/$name.log")
}
soak soak-p2p 240 --fusion p2p --calls 100000
soak soak-collective 240 --fusion collective --calls 100000
soak soak-runs 120 --fusion p2p --calls 0 --runs 2000
cat "$OUT/machine.txt"
for f in soak-p2p soak-collective soak-runs; do tail -14 "$OUT/$f.log"; done
printf '%s\n' "${summary[@]}"
