#!/bin/bash
# Call E (4 GPUs): the derived backward of the MLP block at D = 4 with PyTorch in the same
# call, the plan space holding scattered_gemm (= default + the option: AllGather loops
# pipelined, GEMM + ReduceScatter fused) and gathered_scattered_gemm.
# Session 62: GEMMs batched over a shared weight merged into one GEMM (plan space 13).
set -u
mkdir -p "$OUT"
BACKWARD_D=4 BACKWARD_ARGS="--ops mlp" timeout 480 bash bench/run-backward.sh > "$OUT/backward.log" 2>&1; echo "backward rc=$?"
tail -24 "$OUT/backward.log"
grep -h "plan:" "$OUT"/ours-d4.log | head -12 | cut -c1-160
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz -delete
