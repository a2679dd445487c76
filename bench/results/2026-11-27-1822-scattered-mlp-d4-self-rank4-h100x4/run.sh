#!/bin/bash
# Call A (4 GPUs): the scattered GEMM's GPU test (with its MLP-block case, never run yet),
# the MLP / gated MLP blocks at D = 4 tuned with `scattered_gemm` (= default + the option:
# AllGather loop pipelined, GEMM2 + ReduceScatter fused), ours only; then on GPU 0 the self
# harness with way rs-4 (a D = 4 rank's staging, zeroing and adds kept local) and ncu of it.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
( cd bench/hopper_gemm && nvcc -std=c++17 -O3 -lineinfo -cudart shared -cudadevrt none -gencode=arch=compute_90a,code=sm_90a self_harness.cu -lcublas -lcuda -o /tmp/self > /tmp/self-build.log 2>&1 ) &
timeout 200 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 > "$OUT/test.log" 2>&1; echo "test rc=$?"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test.log" | grep -B2 -A6 "panicked" | head -20
LAYER_D=4 LAYER_LITE=1 timeout 330 bash bench/run-layers.sh > "$OUT/layers.log" 2>&1; echo "layers rc=$?"
wait
cp /tmp/self-build.log "$OUT/"
CUDA_VISIBLE_DEVICES=0 timeout 60 /tmp/self 20 > "$OUT/self.log" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 120 ncu -k regex:'hopper_gemm_(rs_)?bf16_nn' --launch-skip 20 --launch-count 4 --set full --import-source yes \
  -o "$OUT/prof" /tmp/self 1 > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"
ncu --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
ncu --import "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
xz -T0 "$OUT/sass.csv"
grep -h "test result" "$OUT/test.log"
tail -22 "$OUT/layers.log"
tail -12 "$OUT/self.log"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz --exclude prof.ncu-rep --exclude sass.csv.xz . 2>/dev/null
find "$OUT" -type f ! -name logs.tgz ! -name prof.ncu-rep ! -name sass.csv.xz -delete
