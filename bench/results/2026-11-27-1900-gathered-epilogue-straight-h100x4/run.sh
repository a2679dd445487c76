#!/bin/bash
# Call E (4 GPUs): the gathered GEMM's epilogue as straight code per activation (hardware
# tanh): the self harness (AG entry with a gelu_tanh epilogue against without, GPU 0), the
# GPU test, then the MLP block at D = 4 (three shapes) with scattered_gemm and
# gathered_scattered_gemm set by hand and the default call tuned.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
( cd bench/hopper_gemm && nvcc -std=c++17 -O3 -cudart shared -cudadevrt none -gencode=arch=compute_90a,code=sm_90a self_harness.cu -lcublas -lcuda -o /tmp/self > /tmp/self-build.log 2>&1 ) &
timeout 150 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 > "$OUT/test-scattered.log" 2>&1; echo "scattered test rc=$?"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test-scattered.log" | grep -B2 -A12 "panicked" | head -30
wait; cp /tmp/self-build.log "$OUT/"
CUDA_VISIBLE_DEVICES=0 timeout 90 /tmp/self 20 > "$OUT/self.log" 2>&1; echo "self rc=$?"
timeout 300 $BIN/layer_bench --devices 4 --blocks mlp --forms none --row-ranges 1 \
  --plans scattered_gemm,gathered_scattered_gemm,default --json "$OUT/mlp.jsonl" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
grep -h "test result" "$OUT"/test-*.log
tail -12 "$OUT/self.log"
grep "^MLP\|alternation" "$OUT/bench.log" | head -30
grep -A5 "ours / bound" "$OUT/bench.log"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz -delete
