#!/usr/bin/env bash
# Runs on a lent GPU machine (binaries staged by scripts/stage-gpu.sh into .gpu/bin):
# the conformance suite on the CUDA backend in f32, bf16 and f16 (allocations poisoned by
# the suite, tests/common), the
# pass/error tests, the kernel and cudarc-buffer tests, the examples, and the overlap
# trace. Logs go to $OUT; a short table is printed last.
# Usage: scripts/gpu-check.sh [dtypes...]   (default: f32 bf16 f16)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
DTYPES=${*:-f32 bf16 f16}
source scripts/gpu-lib.sh
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -8
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null
    echo "libnccl known to the loader: $(ldconfig -p 2>/dev/null | grep -c libnccl) entries"; ldconfig -p 2>/dev/null | grep libnccl
} >"$OUT/machine.txt" 2>&1
# Fresh inputs every run (the suite's seeds are shifted by this; rerun with the same value).
export FUSION_TEST_SEED=${FUSION_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
echo "FUSION_TEST_SEED=$FUSION_TEST_SEED" >>"$OUT/machine.txt"
export FUSION_RESULTS="$OUT/conformance.jsonl"
for dt in $DTYPES; do
    FUSION_TEST_DTYPE=$dt step "conformance-$dt" 240 $BIN/test-conformance --test-threads=1 --nocapture
done
unset FUSION_RESULTS
step passes_and_errors 180 $BIN/test-passes_and_errors --test-threads=1 --nocapture
# Transformer layers (MLP, gated MLP, attention projections) and GEMM epilogues.
step layers 240 $BIN/test-layers --test-threads=1
step epilogues 120 $BIN/test-epilogues --test-threads=1
step cuda_kernels 120 $BIN/test-cuda_kernels --ignored --test-threads=1
step cuda_buffers 120 $BIN/test-cuda_buffers --ignored --test-threads=1
step cuda_graphs 180 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture
# The runtime's GPU unit tests: copy-engine flag hand-offs, eager and replayed.
step runtime_unit_gpu 120 $BIN/test-fusion_runtime_lib --ignored --test-threads=1
# What a machine without `libnccl.so` reports (gpu-env.sh's symlink directory left out).
# Where the system loader finds a libnccl.so of its own, it is hidden behind /dev/null in a
# private mount namespace (nothing changes outside this one command).
system_nccl=$(ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnccl\.so$' | head -1)
missing_nccl="$BIN/overlap_trace -m 64 -k 64 -n 64"
if [ -z "$system_nccl" ]; then
    LD_LIBRARY_PATH=/usr/local/cuda/lib64 timeout 60 $missing_nccl >"$OUT/missing-nccl.log" 2>&1
elif command -v unshare >/dev/null && unshare -m true 2>/dev/null; then
    echo "hiding $system_nccl in a private mount namespace" >"$OUT/missing-nccl.log"
    LD_LIBRARY_PATH=/usr/local/cuda/lib64 timeout 60 unshare -m sh -c \
        "mount --bind /dev/null '$system_nccl' && exec $missing_nccl" >>"$OUT/missing-nccl.log" 2>&1
else
    echo "skipped: the system loader finds $system_nccl" >"$OUT/missing-nccl.log"
fi
summary+=("missing-nccl: $(grep -E -o 'skipped.*|libnccl.so.{0,80}LD_LIBRARY_PATH|backend cuda.*' "$OUT/missing-nccl.log" | head -1 | cut -c1-100)")
for ex in ag_matmul matmul_ar matmul_rs allgather_p2p ag_matmul_p2p cuda_buffers tp_mlp; do
    [ -x "$BIN/$ex" ] && step "example-$ex" 120 $BIN/$ex
done
step overlap_trace 120 $BIN/overlap_trace --trace-out "$OUT/overlap_trace.json"
# Host time of enqueuing a GEMM, a stream wait and a copy kernel (what paces fine pipelines).
step host_costs 60 $BIN/host_costs --devices 1
step host_costs_large 60 $BIN/host_costs --devices 1 -m 2048 -k 2048 -n 8192
cat "$OUT/machine.txt"
grep -h "rank 0" "$OUT/overlap_trace.log" 2>/dev/null
cat "$OUT/host_costs.log" "$OUT/host_costs_large.log" 2>/dev/null
printf '%s\n' "${summary[@]}"
