#!/usr/bin/env bash
# What needs 2 GPUs, in the fewest device calls (each at most 10 minutes): pass the part as
# the argument, on nvidia-h200-x2 with .gpu carried (scripts/stage-gpu.sh first).
#   a: launched worlds (scripts/gpu-launch.sh: conformance and examples under torchrun,
#      mpirun, failures, the overlap benchmark in both layouts), cudarc buffers
#      (scripts/gpu-buffers.sh), the timeline pictures (scripts/gpu-timeline.sh), and the
#      memory soak (scripts/gpu-soak.sh 2)
#   b: the GPU checks on both GPUs of one process (scripts/gpu-check.sh: conformance,
#      CUDA-graph replay of copy-engine pipelines, the flag hand-off unit test, examples),
#      the layer benchmark against PyTorch (bench/run-layers.sh) and host cost per call
#      (scripts/gpu-host.sh 2)
#   c: issue 13's call: replayed calls (scripts/gpu-replay-x2.sh: the CUDA-graph tests,
#      host_costs) and the D = 2 overlap table against PyTorch (bench/run-overlap.sh with
#      SKIP_D2=1 on two GPUs: the rows that must not get slower, GEMM+RS with 4 row ranges
#      and the GEMM in row pieces, the host time per replayed call for 2-16 iterations)
#   d: issue 13's open rows (scripts/gpu-ring-x2.sh: the peer-failure test alone with a
#      stack dump if it hangs, the CUDA-graph tests, GEMM+RS with 2 and 4 row ranges and the
#      ring's GEMMs on one and two compute streams, three runs)
# Everything lands under $OUT, packed into $OUT/results.tgz by scripts/gpu-session.sh.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
    a) exec bash scripts/gpu-session.sh gpu-launch gpu-buffers gpu-timeline gpu-soak ;;
    b) exec bash scripts/gpu-session.sh gpu-check run-layers-x2 gpu-host ;;
    c) exec bash scripts/gpu-session.sh gpu-replay-x2 run-overlap-x2 ;;
    d) exec bash scripts/gpu-session.sh gpu-ring-x2 ;;
    *) echo "usage: scripts/gpu-x2.sh a|b|c|d" >&2; exit 2 ;;
esac
