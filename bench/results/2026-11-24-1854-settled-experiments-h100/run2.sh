#!/usr/bin/env bash
# issue 28 C, second call: passes_and_errors of this build and of the base (26b3116), the
# CUDA-graph tests with the fixed dot-file test, and 4 more alternating host_costs pairs.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/fusion-gpu-out}
L=$OUT/logs; mkdir -p "$L"
tar xJf stage2.tar.xz
source scripts/gpu-env.sh 2>/dev/null
[ -d .gpu/bin ] || { tar xJf .gpu/bin.tar.xz -C .gpu; }
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
B=bin
timeout 120 $B/test-passes_and_errors --test-threads=1 --nocapture >"$L/passes_and_errors-new.log" 2>&1; echo "passes_and_errors new rc=$?"
timeout 120 $B/test-passes_and_errors_base --test-threads=1 --nocapture >"$L/passes_and_errors-base.log" 2>&1; echo "passes_and_errors base rc=$?"
timeout 180 $B/test-cuda_graphs --ignored --test-threads=1 --nocapture >"$L/cuda_graphs.log" 2>&1; echo "cuda_graphs rc=$?"
for i in 5 6 7 8; do
    timeout 90 .gpu/bin/host_costs --devices 1 >"$L/host-costs-new-$i.log" 2>&1
    timeout 90 $B/host_costs_base --devices 1 >"$L/host-costs-base-$i.log" 2>&1
done
grep -h 'test result\|^test .*FAILED\|panicked' "$L"/passes_and_errors-*.log "$L/cuda_graphs.log" | head -20
for f in "$L"/host-costs-new-*.log "$L"/host-costs-base-*.log; do
    printf '%-16s %s\n' "$(basename "$f" .log)" "$(grep -E 'one-GEMM fusion call, (walked|graphs on \(Replayed\))|^  GEMM 1024x2048x2048 bf16  ' "$f" | awk '{print $(NF-3)}' | paste -sd' ')"
done
tar cJf "$OUT/logs.tar.xz" -C "$OUT" logs && rm -rf "$L"
