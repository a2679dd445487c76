#!/usr/bin/env bash
# Runs several GPU scripts in one device call, each with its own output folder, and packs
# everything into $OUT/results.tgz (the device tool returns only a few files), keeping each
# script's printed tail in $OUT/<script>.txt.
#   usage: scripts/gpu-session.sh gpu-launch gpu-buffers gpu-timeline ...
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-session-out}
WORK="$OUT/work"
mkdir -p "$WORK"
for name in "$@"; do
    mkdir -p "$WORK/$name"
    start=$SECONDS
    OUT="$WORK/$name" bash "scripts/$name.sh" >"$WORK/$name/stdout.txt" 2>&1
    rc=$?
    tail -40 "$WORK/$name/stdout.txt" >"$OUT/$name.txt"
    echo "== $name rc=$rc $((SECONDS - start))s"
done
tar czf "$OUT/results.tgz" -C "$WORK" . && rm -rf "$WORK"
ls -la "$OUT"
