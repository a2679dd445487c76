#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda
B=.gpu/bin
timeout 240 $B/test-cuda_graphs --ignored --test-threads=1 > $OUT/cuda_graphs.log 2>&1; echo "cuda_graphs rc=$?"
timeout 100 $B/host_costs --devices 2 > $OUT/host_costs.log 2>&1; echo "host_costs rc=$?"
timeout 120 $B/overlap_bench --devices 2 --ops ag --shapes 4096,1024,1024 --transports "" --chunks 2 --streams 2 --rs-subchunks "" --iters 5 --warmup 2 --json $OUT/hpc.jsonl > $OUT/hpc.log 2>&1; echo "hpc rc=$?"
timeout 150 $B/overlap_bench --devices 2 --ops rs --shapes 16384,8192,2048 --transports push/peer --rs-subchunks 4 --chunks 2 --streams 4 --host-iterations "" --trace p2p_ce_push_peer_n2_ring4 --json $OUT/rs.jsonl > $OUT/rs.log 2>&1; echo "rs rc=$?"
cat $OUT/host_costs.log; grep "host per call" $OUT/hpc.log; grep "test result\|FAILED\|panicked" $OUT/cuda_graphs.log | head; grep -A16 "ring4 " $OUT/rs.log | head -20; grep "gemm_alone\|n2 \|table" $OUT/rs.log
