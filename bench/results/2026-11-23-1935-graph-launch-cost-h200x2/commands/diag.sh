#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/dot"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda
B=.gpu/bin
nvidia-smi -L > $OUT/machine.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/machine.txt
FUSION_GRAPH_DOT=$OUT/dot timeout 150 $B/host_costs --devices 2 > $OUT/host_costs.log 2>&1; echo "host_costs rc=$?"
timeout 150 $B/overlap_bench --devices 2 --ops ag --shapes 4096,1024,1024 --transports "" --chunks 2 --streams 2 --rs-subchunks "" --iters 5 --warmup 2 --json $OUT/hpc.jsonl > $OUT/hpc.log 2>&1; echo "hpc rc=$?"
timeout 200 $B/overlap_bench --devices 2 --ops rs --shapes 16384,8192,2048 --transports push/peer --rs-subchunks 4 --chunks 2 --streams 4 --host-iterations "" --trace p2p_ce_push_peer_n2_ring4,p2p_ce_push_peer_n2 --json $OUT/rs.jsonl > $OUT/rs.log 2>&1; echo "rs rc=$?"
ls $OUT/dot | head; 
cat $OUT/host_costs.log; grep "host per call" $OUT/hpc.log; grep -v "^ *[0-9.]* *[0-9.]*" $OUT/rs.log | head -40
