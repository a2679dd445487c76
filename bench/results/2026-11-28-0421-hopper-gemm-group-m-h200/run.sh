#!/bin/bash
# Session 65 call 6 (1 GPU): the persistent GEMM against cuBLAS (bench/hopper_gemm/harness.cu)
# built with GROUP_M 4, 8 (the kernel's), 16 and 64: the tile order's group height.
set -u
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/machine.txt"
for g in 8 4 16 64 8; do
  timeout 100 .gpu/quick/hg/hg_g$g 20 > "$OUT/g$g.log" 2>&1; echo "g$g rc=$?"
  cp "$OUT/g$g.log" "$OUT/g$g-last.log"
done
cat "$OUT/machine.txt"
for g in 8 4 16 64; do echo "== GROUP_M $g"; grep -E "^bf16 n[nt] " "$OUT/g$g-last.log" | cut -c1-100; done
grep -h "ALL CORRECT\|FAILED" $OUT/g*.log | sort | uniq -c
