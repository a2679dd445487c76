#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/dot"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda
B=.gpu/bin
timeout 100 $B/host_costs --devices 2 --graph-topologies > $OUT/host_costs.log 2>&1; echo "host_costs rc=$?"
NCCL_GRAPH_MIXING_SUPPORT=0 FUSION_GRAPH_DOT=$OUT/dot timeout 100 $B/overlap_bench --devices 2 --ops ag --shapes 4096,1024,1024 --transports "" --chunks 2 --streams 2 --rs-subchunks "" --iters 5 --warmup 2 --host-iterations 2,16 > $OUT/hpc-nomix.log 2>&1; echo "hpc rc=$?"
timeout 150 $B/overlap_bench --devices 2 --ops rs --shapes 16384,8192,2048 --transports "" --rs-subchunks 1,2,4 --chunks 2 --streams 4 --host-iterations "" --json $OUT/rs.jsonl > $OUT/rs.log 2>&1; echo "rs rc=$?"
(cd $OUT && tar czf dots.tgz dot && rm -rf dot)
grep "graph launch" $OUT/host_costs.log; grep "host per call" $OUT/hpc-nomix.log; grep "GEMM+RS" $OUT/rs.log | head -40
