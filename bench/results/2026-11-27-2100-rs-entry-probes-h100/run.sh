#!/bin/bash
# Call E (1 GPU): the self harness (bench/hopper_gemm/self_harness.cu) built five ways, to
# split what a D = 4 rank's ReduceScatter entry (way rs-4: staging, zeroing, adds, no links)
# costs over the plain GEMM: base; no zeroing; plain stores instead of adds; no adds (the
# storers read the staged pieces only); no adds and no staging (timing only, sums wrong).
set -u
mkdir -p "$OUT"
H=.gpu/quick/hg
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/machine.txt"
for b in base nozero stores noadds nostage; do
  timeout 100 $H/self_$b 20 > "$OUT/self-$b.log" 2>&1; echo "$b rc=$?"
done
for b in base nozero stores noadds nostage; do echo "== $b"; sed -n '/^    M     N     K/,$p' "$OUT/self-$b.log" | cut -c1-220; done
