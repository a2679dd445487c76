#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda
B=.gpu/bin
timeout 100 $B/host_costs --devices 2 --graph-topologies > $OUT/host_costs.log 2>&1; echo "host_costs rc=$?"
timeout 120 $B/overlap_bench --devices 2 --ops ag --shapes 4096,1024,1024 --transports "" --chunks 2 --streams 2 --rs-subchunks "" --iters 5 --warmup 2 --json $OUT/hpc.jsonl > $OUT/hpc.log 2>&1; echo "hpc rc=$?"
timeout 240 $B/test-cuda_graphs --ignored --test-threads=1 > $OUT/cuda_graphs.log 2>&1; echo "cuda_graphs rc=$?"
cat $OUT/host_costs.log; grep "host per call\|host overhead" $OUT/hpc.log; grep "test result\|FAILED\|panicked" $OUT/cuda_graphs.log | head
