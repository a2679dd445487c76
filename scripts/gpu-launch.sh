#!/usr/bin/env bash
# Multi-process checks on a lent machine with 2+ GPUs (binaries from scripts/stage-gpu.sh):
# the conformance suite and the examples under `torchrun --nproc-per-node 2 --no-python`
# (one process per GPU), one example under mpirun, a rank that exits early on GPUs, and the
# overlap benchmark in the one-process-per-GPU layout against the single-process run, in
# this one call. Logs and JSON go to $OUT; a short table is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-launch-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
BIN=.gpu/bin
N=${NPROC:-2}
source scripts/gpu-lib.sh
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -6
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null
    which torchrun mpirun
    uname -r
    # What torchrun tells its workers (which port its own store holds).
    torchrun --nproc-per-node 1 --no-python sh -c 'env | grep -E "^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_USE_AGENT_STORE)=" | sort' 2>&1 | tail -8
} >"$OUT/machine.txt" 2>&1
export FUSION_TEST_SEED=${FUSION_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
echo "FUSION_TEST_SEED=$FUSION_TEST_SEED" >>"$OUT/machine.txt"
TR="torchrun --nproc-per-node $N --no-python"
# Canary: a launched world that only joins. If the default rendezvous port is taken (a
# torchrun whose store we do not know about), say so and use an explicit one for the rest.
step torchrun-join 60 $TR $BIN/test-launched --exact child_joins --ignored --nocapture
if grep -q "is in use" "$OUT/torchrun-join.log"; then
    export FUSION_MASTER_PORT=29690
    summary+=("default rendezvous port in use under torchrun: FUSION_MASTER_PORT=29690 from here")
    step torchrun-join-port 60 $TR $BIN/test-launched --exact child_joins --ignored --nocapture
fi
# (the suite poisons every allocation itself, tests/common)
for dt in f32 bf16; do
    FUSION_TEST_DTYPE=$dt FUSION_RESULTS="$OUT/conformance-launched.jsonl" \
        step "torchrun-conformance-$dt" 300 $TR $BIN/test-conformance --test-threads=1
done
# The transports each rank chose (printed with the host program).
FUSION_DUMP=host_ir step torchrun-dump 120 $TR $BIN/ag_matmul_p2p --dtype bf16
for ex in ag_matmul matmul_ar matmul_rs allgather_p2p ag_matmul_p2p; do
    step "torchrun-$ex" 120 $TR $BIN/$ex --dtype bf16
done
step mpirun-ag_matmul_p2p 120 mpirun --allow-run-as-root --oversubscribe -np "$N" \
    -x FUSION_BACKEND -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x MASTER_PORT=29660 \
    $BIN/ag_matmul_p2p --dtype bf16
# A rank that exits once the world has started: the other must name it, quickly.
port=29670
for r in $(seq 0 $((N - 1))); do
    FUSION_RANK=$r FUSION_WORLD_SIZE=$N FUSION_LOCAL_RANK=$r FUSION_LOCAL_WORLD_SIZE=$N \
        FUSION_MASTER_PORT=$port FUSION_TIMEOUT=30 timeout 120 \
        $BIN/test-launched --exact child_exits_early --ignored --nocapture >"$OUT/exit-early-r$r.log" 2>&1 &
done
wait
summary+=("exit-early (GPU): $(grep -h -o 'EARLY-EXIT-SEEN.\{0,110\}' "$OUT"/exit-early-r*.log | head -1)")
# Sub-worlds on GPUs: each process a group of its own, then the whole world.
step torchrun-subworlds 120 $TR $BIN/test-launched --exact child_subworlds --ignored --nocapture
# Overlap: the same variants in one process driving both GPUs, then one process per GPU.
ARGS="--devices $N --transports push/peer --chunks 4 --streams 4 --rs-subchunks 4 ${BENCH_ARGS:-}"
step overlap-single 300 $BIN/overlap_bench $ARGS --json "$OUT/overlap-single.jsonl"
step overlap-launched 300 $TR $BIN/overlap_bench $ARGS --json "$OUT/overlap-launched.jsonl" \
    --trace p2p_ce_push_peer_n$N
python3 bench/compare_layouts.py "$OUT/overlap-single.jsonl" "$OUT/overlap-launched.jsonl" | tee "$OUT/layouts.md"
cat "$OUT/machine.txt"
grep -h "transports of rank\|  rank .* -> rank" "$OUT/torchrun-dump.log" | sort -u | head -8
grep -h "host overhead" "$OUT/overlap-single.log" "$OUT/overlap-launched.log"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
# Only a few files come back from the machine: the logs travel as one archive.
if [ -z "${KEEP_LOGS:-}" ]; then
    tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
fi
