#!/bin/bash
# Call A (4 GPUs): the bulk-add GEMM+RS harness against the storer warps (gpu.sh rs, staged
# harnesses), then the fused GEMM+RS/MLP GPU test with the broadcast-weights form.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
OUT="$OUT/rs" bash scripts/gpu.sh rs 4 > "$OUT/rs.txt" 2>&1; echo "rs rc=$?"
timeout 400 .gpu/bin/test-hopper_scattered_gemm --ignored --test-threads=1 --nocapture > "$OUT/scattered.log" 2>&1; echo "scattered rc=$?"
tar czf "$OUT/rs-logs.tgz" -C "$OUT" rs && rm -rf "$OUT/rs"
grep -E "test result|panicked|FAILED" "$OUT/scattered.log" | tail -5
tail -60 "$OUT/rs.txt" | cut -c1-200
