#!/bin/bash
# Call C (4 GPUs): the scattered GEMM test with the MLP block through both persistent GEMMs
# (gathered GEMM with bias + activation epilogue, scattered GEMM), the gathered GEMM test,
# then the MLP / gated MLP blocks at D = 4 tuned with `gathered_scattered_gemm` in the plan
# space (ours only).
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
( cd bench/hopper_gemm && nvcc -std=c++17 -O3 -cudart shared -cudadevrt none -gencode=arch=compute_90a,code=sm_90a self_harness.cu -lcublas -lcuda -o /tmp/self > /tmp/self-build.log 2>&1 ) &
timeout 200 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 > "$OUT/test-scattered.log" 2>&1; echo "scattered test rc=$?"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test-scattered.log" | grep -B2 -A12 "panicked" | head -30
timeout 120 $BIN/test-hopper_gathered_gemm --ignored --test-threads=1 > "$OUT/test-gathered.log" 2>&1; echo "gathered test rc=$?"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test-gathered.log" | grep -B2 -A12 "panicked" | head -30
LAYER_D=4 LAYER_LITE=1 timeout 240 bash bench/run-layers.sh > "$OUT/layers.log" 2>&1; echo "layers rc=$?"
wait; cp /tmp/self-build.log "$OUT/"
CUDA_VISIBLE_DEVICES=0 timeout 90 /tmp/self 20 > "$OUT/self.log" 2>&1; echo "self rc=$?"
grep -h "test result" "$OUT"/test-*.log
tail -12 "$OUT/self.log"
grep -A8 "ours / bound" "$OUT/layers.log"
grep -A8 "best option variant" "$OUT/layers.log"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -type f ! -name logs.tgz -delete
