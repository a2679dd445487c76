#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda FUSION_TIMEOUT=20
B=.gpu/bin
A="--devices 2 --ops ag --shapes 16384,8192,2048 --transports push/peer --rs-subchunks 2 --host-iterations ''"
run() { local name=$1; shift; local s=$SECONDS; env "$@" timeout 60 $B/overlap_bench --devices 2 --ops ag,rs --shapes 16384,8192,2048 --transports push/peer --rs-subchunks 2 --host-iterations "" > $OUT/$name.log 2>&1; echo "$name rc=$? $((SECONDS-s))s"; tail -4 $OUT/$name.log; }
run default X=1
run nographs FUSION_GRAPHS=0


