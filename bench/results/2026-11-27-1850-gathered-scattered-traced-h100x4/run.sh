#!/bin/bash
# Call D (4 GPUs): why the MLP block through both persistent GEMMs (gathered_scattered_gemm)
# took 1.6x the scattered GEMM alone: the GPU test (now counting the kernels that ran), then
# MLP 8192,4096,14336 with the two plans timed and one call of each traced.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1 RUST_LOG=fusion_runtime=debug
BIN=.gpu/bin
timeout 150 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 > "$OUT/test-scattered.log" 2>&1; echo "scattered test rc=$?"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test-scattered.log" | grep -B2 -A12 "panicked" | head -30
timeout 300 $BIN/layer_bench --devices 4 --blocks mlp --shapes "8192,4096,14336" --forms none --row-ranges 1 \
  --plans scattered_gemm,gathered_scattered_gemm,default --trace-dir "$OUT/traces" --json "$OUT/plans.jsonl" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
grep -i "gathered GEMM .* runs at its join" "$OUT"/*.log | head -3
grep -h "test result" "$OUT"/test-*.log
grep "plan_\|default " "$OUT/bench.log" | head -20
ls -R "$OUT/traces" | head -20
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz -delete
