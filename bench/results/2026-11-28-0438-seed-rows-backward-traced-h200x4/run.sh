#!/bin/bash
# Session 65 call 4 (4 GPUs): traces of the AG+GEMM layer's saving backward at 8192^3,
# D = 4: the tuned plan (gradients_in_loop) and the default program (dW after the loop),
# forced through copies of call 3's plan file; GEMM+RS's backward at 8192^3 too.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT/r"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
BIN=.gpu/bin
export CUDA_VISIBLE_DEVICES=0,1,2,3
for v in tuned default; do
  rm -rf /tmp/bwt; mkdir -p /tmp/bwt "$OUT/r/$v"
  cp .gpu/quick/plans/d4-$v.json /tmp/plans-$v.json
  FUSION_PLAN_CACHE=/tmp/plans-$v.json FUSION_TRACE=/tmp/bwt timeout 100 $BIN/backward_bench --devices 4 --ops ag,rs --shapes 8192,8192,8192 --iters 3 --warmup 1 > "$OUT/r/$v.log" 2>&1
  echo "$v rc=$?" >> "$OUT/r/summary.txt"
  for f in $(ls -t /tmp/bwt | grep -E "backward_saved" | head -16); do cp /tmp/bwt/$f "$OUT/r/$v/$f"; done
  FUSION_PLAN_CACHE=/tmp/plans-$v.json timeout 100 $BIN/backward_bench --devices 4 --ops ag --shapes 8192,8192,8192 > "$OUT/r/$v-untraced.log" 2>&1
  echo "$v untraced rc=$?" >> "$OUT/r/summary.txt"
done
(cd "$OUT" && tar czf all.tgz r && rm -rf r)
tar xzf "$OUT/all.tgz" -C /tmp && cat /tmp/r/summary.txt; ls /tmp/r/tuned | head -20
for v in tuned default; do grep -E "backward_saved: plan|  backward  " /tmp/r/$v-untraced.log | cut -c1-120; done
