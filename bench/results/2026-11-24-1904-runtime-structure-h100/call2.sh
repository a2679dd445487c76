#!/usr/bin/env bash
# The passes_and_errors suite on the GPU, as gpu-check.sh runs it, with its output.
set -u
cd "$(dirname "$0")"
source scripts/gpu-env.sh >/dev/null 2>&1
export FUSION_BACKEND=cuda FUSION_POISON=1 RUST_BACKTRACE=0
.gpu/bin/test-passes_and_errors --test-threads=1 2>&1 | tail -60
