#!/usr/bin/env bash
# Builds the release examples, measuring tools and test binaries here and packs them into
# .gpu/bin.tar.xz (ignored by git, carried to the GPU machine; scripts/gpu-env.sh unpacks
# them into .gpu/bin there, where `bash scripts/gpu.sh <task>` runs them).
# Usage: scripts/stage-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# The GPU machines' driver is CUDA 13.0, and this machine has no nvcc to tell cudarc which
# CUDA version to bind: name it (an application's own choice wins elsewhere, see docs/PROGRAMS.md).
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
mkdir -p .gpu/bin
cargo build --release --examples
for ex in target/release/examples/*; do
    case "$ex" in *.d|*-*) continue ;; esac
    [ -x "$ex" ] && cp "$ex" .gpu/bin/
done
# The measuring tools (bench/, package fusion-bench): one binary per tool, by its name.
cargo build --release -p fusion-bench --bins --message-format=json 2>/dev/null \
  | python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bin"]:
        print(m["executable"])' \
  | while read -r exe; do cp "$exe" .gpu/bin/; done
cargo test --release --no-run --message-format=json --test conformance --test passes_and_errors --test cuda_kernels --test launched --test cuda_buffers --test cuda_graphs --test layers --test row_kernels --test epilogues --test faults --test caller_stream --test rank_handles --test job_token --test caller_capture --test peer_memory --test gemm_allreduce --test plan_choice --test ag_row_ranges --test recovery --test call_ledger --test hopper_gemm --test hopper_gathered_gemm --test hopper_scattered_gemm 2>/dev/null \
  | python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' \
  | while read -r name exe; do cp "$exe" ".gpu/bin/test-$name"; done
# The candle Llama layer on candle's CUDA device (`scripts/gpu.sh candle`, `candle-tp`):
# building candle's kernels needs nvcc (e.g. NVIDIA's nvidia-cuda-nvcc 13.0 wheels, with
# CUDA_HOME pointing at a folder that also holds the link libraries; docs/GPU-TESTING.md).
if command -v nvcc >/dev/null; then
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} cargo build --release --features candle-cuda --example candle_llama --example candle_train
    cp target/release/examples/candle_llama target/release/examples/candle_train .gpu/bin/
else
    echo "stage-gpu: no nvcc, so no candle_llama (the candle tasks need it)" >&2
fi
# The Hopper GEMM's standalone harnesses (bench/hopper_gemm/build.sh, `gpu.sh rs` and
# `hopper-gemm` use them instead of building them there) with STAGE_HARNESSES=1 and nvcc:
# a few minutes here instead of device time there.
if [ -n "${STAGE_HARNESSES:-}" ] && command -v nvcc >/dev/null; then
    CUDA_LIB="${CUDA_HOME:-/usr/local/cuda}/lib64" bash bench/hopper_gemm/build.sh .gpu/bin
fi
# The runtime's own unit tests (the GPU ones are #[ignore]d: copy-engine flag hand-offs).
cargo test --release --no-run --message-format=json -p fusion-runtime --lib 2>/dev/null \
  | python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' \
  | while read -r exe; do cp "$exe" ".gpu/bin/test-fusion_runtime_lib"; done
strip --strip-debug .gpu/bin/*
ls -la .gpu/bin
# The copy of the repository sent to a GPU machine may be limited in size: the binaries
# travel compressed, and scripts/gpu-env.sh unpacks them there.
tar cJf .gpu/bin.tar.xz -C .gpu bin
rm -rf .gpu/bin
du -sh .gpu
