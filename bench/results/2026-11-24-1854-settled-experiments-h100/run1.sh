#!/usr/bin/env bash
# issue 28 C: the GPU checks on the deletions' build, then host_costs of this build and of
# the base commit (26b3116) alternating, 4 processes each, in this one device call.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
tar xJf base.tar.xz
T0=$SECONDS
bash scripts/gpu-check.sh >"$OUT/gpu-check-stdout.txt" 2>&1
echo "gpu-check took $((SECONDS - T0)) s"
source scripts/gpu-env.sh 2>/dev/null
export FUSION_BACKEND=cuda
for i in 1 2 3 4; do
    timeout 90 .gpu/bin/host_costs --devices 1 >"$OUT/host-costs-new-$i.log" 2>&1
    timeout 90 ./host_costs_base --devices 1 >"$OUT/host-costs-base-$i.log" 2>&1
done
echo "total $((SECONDS - T0)) s"
tail -32 "$OUT/gpu-check-stdout.txt" | grep -v '^  GEMM\|^  stream\|^  copy\|^  Matmul\|^  one-GEMM\|^  caller\|^  per-thread\|^host_costs'
for f in "$OUT"/host-costs-new-*.log "$OUT"/host-costs-base-*.log; do
    printf '%-16s %s\n' "$(basename "$f" .log)" "$(grep -E 'one-GEMM fusion call, (walked|graphs on \(Replayed\))|^  GEMM 1024x2048x2048 bf16  ' "$f" | awk '{print $(NF-3)}' | paste -sd' ')"
done
