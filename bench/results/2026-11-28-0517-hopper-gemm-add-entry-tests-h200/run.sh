#!/bin/bash
# Session 65 call 9 (1 GPU): the persistent GEMM's tests on a GPU, the add entry's
# (accumulating GEMMs against cuBLAS) and the slope entry's among them.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/machine.txt"
timeout 300 .gpu/bin/test-hopper_gemm --ignored --test-threads 1 --nocapture > "$OUT/test-hopper_gemm.log" 2>&1
echo "test-hopper_gemm rc=$?"
cat "$OUT/machine.txt"
grep -E "^test |test result|panicked" "$OUT/test-hopper_gemm.log" | head -20
grep -E "addend (true|false): relative error" "$OUT/test-hopper_gemm.log" | awk '{print $NF, $0}' | sort | tail -3 | cut -c1-160
