#!/bin/bash
# Session 59, call B: the scattered GEMM's GPU test on 2 and 4 GPUs, then the overlap
# benchmark's GEMM+RS rows at D = 4 and 2 with PyTorch in the same call.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
timeout 240 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 --nocapture > "$OUT/test.log" 2>&1; echo "test rc=$?" | tee -a "$OUT/test.log"
grep -v "^ *[0-9]*: \|^ *at " "$OUT/test.log" | grep -B2 -A6 "panicked" | head -30
OVERLAP_D="${DS:-4 2}" BENCH_ARGS="--ops rs" timeout 500 bash bench/run-overlap.sh > "$OUT/overlap.log" 2>&1
echo "overlap rc=$?"
grep -E "test result" "$OUT/test.log"
grep -h -E " scattered|default_call" "$OUT"/ours-d?.log | head -20
cat "$OUT/table.md" 2>/dev/null | head -20
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -type f ! -name logs.tgz ! -name table.md -delete
