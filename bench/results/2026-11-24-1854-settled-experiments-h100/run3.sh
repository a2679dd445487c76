#!/usr/bin/env bash
# issue 28 C, final call: scripts/gpu-check.sh on this build (all binaries of
# scripts/stage-gpu.sh), then host_costs of this build and of the base commit (26b3116),
# 8 pairs pinned to one core, the order swapped every pair. Logs packed in logs.tar.xz.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/fusion-gpu-out}
L=$OUT/logs; mkdir -p "$L"
tar xJf stage2.tar.xz   # bin/host_costs_base
T0=$SECONDS
OUT=$L bash scripts/gpu-check.sh >"$L/gpu-check-stdout.txt" 2>&1
echo "gpu-check took $((SECONDS - T0)) s"
source scripts/gpu-env.sh 2>/dev/null
export FUSION_BACKEND=cuda
PIN=""; command -v taskset >/dev/null && PIN="taskset -c 3"
echo "pinning: ${PIN:-none}"
hc() { timeout 90 $PIN "$1" --devices 1 >"$L/host-costs-$2.log" 2>&1; }
for i in 1 2 3 4 5 6 7 8; do
    if [ $((i % 2)) = 1 ]; then hc .gpu/bin/host_costs new-$i; hc bin/host_costs_base base-$i
    else hc bin/host_costs_base base-$i; hc .gpu/bin/host_costs new-$i; fi
done
echo "total $((SECONDS - T0)) s"
grep -E 'rc=' "$L/gpu-check-stdout.txt" | cut -c1-120
for f in "$L"/host-costs-new-*.log "$L"/host-costs-base-*.log; do
    printf '%-16s %s\n' "$(basename "$f" .log)" "$(grep -E '^  stream wait|^  GEMM 1024x2048x2048 bf16  |one-GEMM fusion call, (walked|graphs on \(Replayed\))' "$f" | awk '{print $(NF-3)}' | paste -sd' ')"
done
tar cJf "$OUT/logs.tar.xz" -C "$OUT" logs && rm -rf "$L"
