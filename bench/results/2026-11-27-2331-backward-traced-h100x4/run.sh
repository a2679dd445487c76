#!/bin/bash
# Session 63 call 2 (4 GPUs): the saving backward of the MLP block traced at D = 4, two
# shapes; the last two calls' traces of every rank kept.
set -u
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || (cd .gpu && tar xJf bin.tar.xz)
mkdir -p "$OUT"
source scripts/gpu-env.sh >/dev/null 2>&1 || true
BIN=.gpu/bin
export CUDA_VISIBLE_DEVICES=0,1,2,3
mkdir -p "$OUT/bw"
for shape in 8192,4096,14336 8192,8192,28672; do
  rm -rf /tmp/bwtrace; mkdir -p /tmp/bwtrace
  FUSION_TRACE=/tmp/bwtrace timeout 150 $BIN/backward_bench --devices 4 --ops mlp --mlp-shapes $shape --iters 3 --warmup 1 > "$OUT/bw/bw-$shape.log" 2>&1
  echo "backward traced $shape rc=$?" >> "$OUT/bw/summary.txt"
  for f in $(ls -t /tmp/bwtrace | grep backward_saved | head -8); do cp /tmp/bwtrace/$f "$OUT/bw/$shape-$f"; done
  for f in $(ls -t /tmp/bwtrace | grep forward_saving | head -4); do cp /tmp/bwtrace/$f "$OUT/bw/$shape-$f"; done
done
# untraced, the same shapes, for the times
timeout 200 $BIN/backward_bench --devices 4 --ops mlp --mlp-shapes "8192,4096,14336;8192,8192,28672" > "$OUT/bw/untraced.log" 2>&1
echo "untraced rc=$?" >> "$OUT/bw/summary.txt"
(cd "$OUT" && tar czf bw.tgz bw && rm -rf bw)
tar xzf "$OUT/bw.tgz" -C /tmp && cat /tmp/bw/summary.txt && grep -E "^\| MLP" /tmp/bw/untraced.log
