#!/bin/bash
# Session 59, call E: the derived backward of the AG+GEMM rows at D = 4 (its dX is a GEMM +
# ReduceScatter) with the scattered GEMM in the plan space, PyTorch in the same call.
set -u
mkdir -p "$OUT"
BACKWARD_D=4 BACKWARD_ARGS="--ops ag" timeout 500 bash bench/run-backward.sh > "$OUT/backward.log" 2>&1; echo "backward rc=$?"
tail -20 "$OUT/backward.log"
grep -h "plan\b\|plan " "$OUT"/ours-d4.log | head -10
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -type f ! -name logs.tgz -delete
