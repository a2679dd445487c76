#!/usr/bin/env bash
# bench/run-overlap.sh on all GPUs only (D = 2 on a 2-GPU machine), with a trace of the
# default variant and GEMM+RS's 4-row-range ring (for scripts/gpu-session.sh).
export SKIP_D2=1
export BENCH_ARGS="${BENCH_ARGS:---trace p2p_ce_push_peer_n2,p2p_ce_push_peer_n2_ring4}"
exec bash "$(dirname "$0")/../bench/run-overlap.sh"
