#!/bin/bash
# Call D (4x H200): AG+GEMM at D = 4, ours (every variant, the default call tuned) - does
# the 16384,8192,2048 row meet <= 1.05x of the bound on H200 (it did on 2026-11-22)?
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$OUT/machine.txt"
timeout 200 $BIN/overlap_bench --devices 4 --ops ag --chunks 4 --streams 4 --plan-file "$OUT/plans-d4.json" \
  --host-iterations "" --json "$OUT/ag-d4.jsonl" > "$OUT/ag-d4.log" 2>&1; echo "ag D=4 rc=$?"
grep "^AG+GEMM" "$OUT/ag-d4.log" | grep -v "collective_\|p2p_nccl\|sequential" | awk '{print $2,$3,$4,$5,$6,$11,$12,$13}'
grep -A5 "^| op" "$OUT/ag-d4.log" | cut -c1-260
