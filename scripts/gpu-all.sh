#!/usr/bin/env bash
# One device call for everything: scripts/gpu-check.sh (conformance, pass/error and kernel
# tests, examples, overlap trace) then bench/run-overlap.sh (our benchmark and PyTorch's).
# Each part's files are packed into one archive under $OUT (the device tool returns at
# most 8 files); the summary tables are printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT/check" "$OUT/bench"
OUT="$OUT/check" bash scripts/gpu-check.sh ${CHECK_DTYPES:-f32 bf16 f16} >"$OUT/check.txt" 2>&1
OUT="$OUT/bench" bash bench/run-overlap.sh >"$OUT/bench.txt" 2>&1
tar czf "$OUT/check.tgz" -C "$OUT" check && rm -rf "$OUT/check"
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
tail -25 "$OUT/check.txt"
cat "$OUT/bench.txt"
