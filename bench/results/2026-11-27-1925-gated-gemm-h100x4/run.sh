#!/bin/bash
# Call H (4 GPUs): the gated MLP's gate and up products as one gathered GEMM (a gated
# product: its B stage holds both weights' columns, act(gate) * up in the epilogue): the GPU
# test, then the gated MLP at D = 4 (three shapes) with scattered_gemm and
# gathered_scattered_gemm set by hand and the default call tuned.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
timeout 170 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 > "$OUT/test-scattered.log" 2>&1; echo "scattered test rc=$?"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test-scattered.log" | grep -B2 -A12 "panicked" | head -30
timeout 200 $BIN/layer_bench --devices 4 --blocks gated --forms none --row-ranges 1 \
  --plans scattered_gemm,gathered_scattered_gemm,default --json "$OUT/gated.jsonl" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
grep -h "test result" "$OUT"/test-*.log
grep "^GatedMLP\|alternation" "$OUT/bench.log" | grep -v "_alone" | head -30
grep -A5 "ours / bound" "$OUT/bench.log"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz -delete
