#!/usr/bin/env bash
# The GPU checks and measurements, one task per call, on a machine with GPUs and without
# Rust: build the binaries here first with scripts/stage-gpu.sh (.gpu/bin.tar.xz, carried to
# the machine; scripts/gpu-env.sh unpacks it there), then, in the repository root there:
#   bash scripts/gpu.sh <task> [arguments]
# Logs go to $OUT (default /tmp/fusion-gpu-out); a short table is printed last. Every task
# is described in docs/GPU-TESTING.md; `bash scripts/gpu.sh help` lists them.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
SELF=$ROOT/scripts/gpu.sh
OUT=${OUT:-/tmp/fusion-gpu-out}
BIN=${BIN:-$ROOT/.gpu/bin}

usage() {
    cat <<'EOF'
usage: scripts/gpu.sh <task> [arguments]      (docs/GPU-TESTING.md describes each)
one GPU or more:
  check [dtypes..]        conformance (f32 bf16 f16, poisoned), pass/error, layer, kernel,
                          buffer and graph tests, examples, overlap trace, host costs
  all                     check, then the overlap benchmark against PyTorch (overlap)
  shared-ranks            two ranks sharing the visible GPUs: copy-engine pipelines, GPU unit
                          tests, host_costs --share-gpus
  faults                  shared-ranks five times, the fault suite, launch mistakes under
                          torchrun, check from a copy of the repository at another path
  caller-stream           calls on the caller's stream, cudarc buffers, one-GPU conformance
                          and graph tests, host_costs (A/B against .gpu/bin/host_costs_base)
  host [devices]          host cost: host_costs with its variants, host time per call
  host-ab [pairs]         host_costs against .gpu/bin/host_costs_base (another build's),
                          [pairs] alternating pinned processes, paired medians per row
  candle [prefill] [steps]  the candle Llama layer (binary built with candle-cuda)
  candle-tp [gpus] [part] the candle Llama layer tensor-parallel over [gpus] processes
                          (default: every GPU) under torchrun: fusions against candle's own
                          TP; part decode (1, 8, 64 tokens, eager and --graph), prefill
                          (512 and 2048 tokens, median of 20) or all
  candle-ab [gpus] [reps] the candle layer's decode (1, 8, 64 tokens, eager and --graph) of
                          this build against another's (CANDLE_BASE, default
                          .gpu/bin/candle_llama_base) and candle's TP, [reps] alternating
                          rounds (default 2; TOKENS picks the step sizes), medians
  candle-kernels [gpus] [tokens | prefill [tokens]]
                          the candle layer's last step kernel by kernel under ncu (rank 0
                          profiled, the others free): fusions and candle's TP, a captured
                          decode step of [tokens] (default 64) or a prefill (default 512)
  decode [gpus]           decode_bench (Allreduce 4 KB-64 MB, GEMM + Allreduce at Llama-70B's
                          and Llama-8B's decode shapes) and PyTorch's Allreduce (NCCL,
                          symm_mem) alike, then
                          the peer-memory Allreduce kernels one by one and a GEMM with the
                          Allreduce in its epilogue where nvcc is found
  gated-gemm              one GPU: the gated MLP's silu(X Wg) * (X Wu) at decode sizes as one
                          kernel against cuBLAS's GEMMs + an elementwise kernel
                          (bench/decode_gemm/gated_harness.cu; needs nvcc)
  rows [args..]           one GPU: row programs (add + RMSNorm, softmax) at prefill sizes
                          against their reductions apart and against no fusion (row_bench)
  hopper-gemm             the persistent Hopper GEMM against cuBLAS (tests/hopper_gemm.rs),
                          then its standalone check and benchmark where nvcc is found
two GPUs or more:
  rs [gpus]               the storer-warp GEMM+ReduceScatter, own block first and owners
                          interleaved (bench/hopper_gemm/rs_harness.cu; staged with
                          STAGE_HARNESSES=1, else built here with nvcc): all GPUs, then 2
  buffers                 tensors over cudarc buffers (tests, cuda_buffers example)
  launch                  conformance and examples under torchrun and mpirun, failures,
                          the overlap benchmark in both layouts
  soak [devices]          the 100,000-call memory soak
  timeline [args..]       the timeline pictures (DEVICES=n, default 2)
  layers                  bench/run-layers.sh: layer checks and benchmark against PyTorch
  backward                bench/run-backward.sh: the derived backward of the MLP block, AG+GEMM
                          and GEMM+RS against PyTorch's autograd, D = 4 and 2
  overlap                 bench/run-overlap.sh: overlap benchmark against PyTorch, D = all, 4, 2
  overlap-x2              bench/run-overlap.sh on all GPUs only, with traces
  replay-x2               CUDA-graph tests and host_costs --graph-topologies on 2 GPUs
  ring-x2                 the peer-failure test alone, graph tests, GEMM+RS row ranges x RUNS
  recovery                a world that survives a bad input (4 GPUs): two threads per handle,
                          a bad input, World::recover, in one process and under torchrun;
                          the call-matching check's cost per call
  token                   a world with a job token under torchrun: intruders with a wrong
                          token or none and a fuzzed handshake are refused; ranks that
                          disagree on the token fail at formation saying so
  x2 a|b|c|d|e            the two-GPU groups (a: launch buffers timeline soak; b: check
                          layers host; c: replay-x2 overlap-x2; d: ring-x2; e:
                          candle-tp overlap-x2 layers faults), one after another
  every-gpu a|b|c|d       every table on all visible GPUs, the eight-GPU run in four calls
                          (a: overlap; b: layers at D = all, decode; c: candle-tp; d:
                          launch with one process per GPU)
several tasks:
  session <task>..        each task in its own folder, all packed into $OUT/results.tgz
EOF
}

# `step NAME TIMEOUT COMMAND...` runs COMMAND under a time limit with its output in
# $OUT/NAME.log, and adds a line to the `summary` array: the exit status, the seconds it
# took and the last log line matching $STEP_PATTERN.
STEP_PATTERN=${STEP_PATTERN:-'test result|FAILED|rror|check:'}
summary=()
step() {
    local name=$1 t=$2; shift 2
    local start=$SECONDS
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-30s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E "$STEP_PATTERN" "$OUT/$name.log" | tail -1 | cut -c1-90)")")
}

# The date and the GPUs (name, driver, memory).
gpus_info() {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
}

torch_info() {
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null
}

# Fresh inputs every run (the suites' seeds are shifted by this; rerun with the same value).
fresh_seed() {
    export FUSION_TEST_SEED=${FUSION_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
    echo "FUSION_TEST_SEED=$FUSION_TEST_SEED" >>"$1"
}

# The conformance suite on the CUDA backend in f32, bf16 and f16 (allocations poisoned by
# the suite's worlds, tests/common), the
# pass/error tests, the layer and epilogue tests, the kernel, cudarc-buffer and CUDA-graph
# tests, the runtime's GPU unit tests, what a machine without `libnccl.so` reports, the
# examples, the overlap trace and host_costs.
task_check() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    local dtypes=${*:-f32 bf16 f16}
    {
        gpus_info
        nvidia-smi topo -m 2>/dev/null | head -8
        torch_info
        echo "libnccl known to the loader: $(ldconfig -p 2>/dev/null | grep -c libnccl) entries"; ldconfig -p 2>/dev/null | grep libnccl
    } >"$OUT/machine.txt" 2>&1
    fresh_seed "$OUT/machine.txt"
    export FUSION_RESULTS="$OUT/conformance.jsonl"
    for dt in $dtypes; do
        FUSION_TEST_DTYPE=$dt step "conformance-$dt" 240 $BIN/test-conformance --test-threads=1 --nocapture
    done
    unset FUSION_RESULTS
    step passes_and_errors 180 $BIN/test-passes_and_errors --test-threads=1 --nocapture
    # Transformer layers (MLP, gated MLP, attention projections) and GEMM epilogues.
    step layers 240 $BIN/test-layers --test-threads=1
    # Norms and softmax as one row kernel each, against the unfused programs.
    step row_kernels 120 $BIN/test-row_kernels --test-threads=1
    step epilogues 120 $BIN/test-epilogues --test-threads=1
    step epilogues_gpu 120 $BIN/test-epilogues --ignored --test-threads=1
    step cuda_kernels 120 $BIN/test-cuda_kernels --ignored --test-threads=1
    step cuda_buffers 120 $BIN/test-cuda_buffers --ignored --test-threads=1
    step cuda_graphs 180 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture
    # Calls recorded into the caller's own CUDA graph (one GPU, then tensor-parallel).
    step caller_capture 240 $BIN/test-caller_capture --ignored --test-threads=1 --nocapture
    # The peer-memory plan (simulated devices; its GPU side runs in every conformance case).
    step peer_memory 60 $BIN/test-peer_memory --test-threads=1
    step gemm_allreduce 120 $BIN/test-gemm_allreduce --include-ignored --test-threads=1 --nocapture
    # Plans chosen per shape: every candidate's result, tuning, the plan file.
    step plan_choice 240 $BIN/test-plan_choice --test-threads=1
    step ag_row_ranges 120 $BIN/test-ag_row_ranges --test-threads=1
    # The runtime's GPU unit tests: copy-engine flag hand-offs, eager and replayed.
    step runtime_unit_gpu 120 $BIN/test-fusion_runtime_lib --ignored --test-threads=1
    # What a machine without `libnccl.so` reports (gpu-env.sh's symlink directory left
    # out). Where the system loader finds a libnccl.so of its own, it is hidden behind
    # /dev/null in a private mount namespace (nothing changes outside this one command).
    local system_nccl missing_nccl
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
    # Host time of enqueuing a GEMM, a stream wait and a copy kernel (what paces fine
    # pipelines).
    step host_costs 60 $BIN/host_costs --devices 1
    step host_costs_large 60 $BIN/host_costs --devices 1 -m 2048 -k 2048 -n 8192
    cat "$OUT/machine.txt"
    grep -h "rank 0" "$OUT/overlap_trace.log" 2>/dev/null
    cat "$OUT/host_costs.log" "$OUT/host_costs_large.log" 2>/dev/null
    printf '%s\n' "${summary[@]}"
}

# The persistent Hopper GEMM (`GemmEngine::Persistent`): the tests of tests/hopper_gemm.rs
# (every operand layout in bf16 and f16 against cuBLAS at odd and large shapes, fusions with
# transposed operands and a linear layer, GEMMs it leaves to cuBLAS, replayed calls; fresh
# inputs, outputs poisoned; on a GPU other than compute capability 9.0 only the fallback to
# cuBLAS), with two GPUs or more tests/hopper_gathered_gemm.rs and
# tests/hopper_scattered_gemm.rs (the fused AllGather+GEMM and GEMM+ReduceScatter plans
# against the unpipelined ones, eager, captured, replayed), then, where nvcc is on the
# PATH, the kernel's standalone checks and benchmarks
# (bench/hopper_gemm/build.sh, sm_90a): the GEMM against cuBLAS and an f64 reference
# (HARNESS_REPS timed runs per row, default 30), and with two GPUs or more the
# GEMM+ReduceScatter and AllGather+GEMM inside the kernel at D = 2 and every GPU of the
# machine. Success: every rc is 0 and every harness says ALL CORRECT.
task_hopper_gemm() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    gpus_info >"$OUT/machine.txt" 2>&1
    fresh_seed "$OUT/machine.txt"
    step hopper_gemm 600 $BIN/test-hopper_gemm --ignored --test-threads=1 --nocapture
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        step hopper_gathered_gemm 600 $BIN/test-hopper_gathered_gemm --ignored --test-threads=1 --nocapture
        step hopper_scattered_gemm 600 $BIN/test-hopper_scattered_gemm --ignored --test-threads=1 --nocapture
    fi
    local harnesses=()
    if command -v nvcc >/dev/null; then
        CUDA_LIB="${CUDA_HOME:-/usr/local/cuda}/lib64" step harness-build 600 \
            bash bench/hopper_gemm/build.sh "$OUT/hopper_gemm"
        if [ -x "$OUT/hopper_gemm/hopper_gemm_bench" ]; then
            STEP_PATTERN='ALL CORRECT|SOME FAILED|rror' \
                step harness 600 "$OUT/hopper_gemm/hopper_gemm_bench" "${HARNESS_REPS:-30}"
            harnesses+=(harness)
            STEP_PATTERN='ALL CORRECT|SOME FAILED|rror' \
                step harness-self 600 "$OUT/hopper_gemm/hopper_gemm_self_bench" "${HARNESS_REPS:-30}"
            harnesses+=(harness-self)
            local gpus d
            gpus=$(nvidia-smi -L | wc -l)
            for d in $( [ "$gpus" -gt 2 ] && echo "$gpus") $( [ "$gpus" -ge 2 ] && echo 2); do
                for kind in rs ag; do
                    STEP_PATTERN='ALL CORRECT|SOME FAILED|rror' \
                        step "harness-$kind-d$d" 600 "$OUT/hopper_gemm/hopper_gemm_${kind}_bench" "$d" "${HARNESS_REPS:-30}"
                    harnesses+=("harness-$kind-d$d")
                done
            done
        fi
    else
        summary+=("harness: skipped, no nvcc on the PATH")
    fi
    cat "$OUT/machine.txt"
    grep -E "rel|bit-identical|skipping|GPU 0" "$OUT/hopper_gemm.log" | tail -8
    local h
    for h in "${harnesses[@]}"; do tail -7 "$OUT/$h.log"; done
    printf '%s\n' "${summary[@]}"
}

# check (dtypes from CHECK_DTYPES) then the overlap benchmark against PyTorch, each part's
# files packed into one archive under $OUT (fewer files to fetch); the
# summary tables are printed last.
task_all() {
    mkdir -p "$OUT/check" "$OUT/bench"
    OUT="$OUT/check" bash "$SELF" check ${CHECK_DTYPES:-f32 bf16 f16} >"$OUT/check.txt" 2>&1
    OUT="$OUT/bench" bash bench/run-overlap.sh >"$OUT/bench.txt" 2>&1
    tar czf "$OUT/check.tgz" -C "$OUT" check && rm -rf "$OUT/check"
    tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
    tail -25 "$OUT/check.txt"
    cat "$OUT/bench.txt"
}

# Tensors over cudarc buffers on 2 or more GPUs: the GPU tests of tests/cuda_buffers.rs,
# then the `cuda_buffers` example on 2 GPUs in f32, bf16 and f16 (inputs and outputs in
# cudarc buffers, checked against an f64 host reference). Success: every rc is 0 and every
# example line says "check: ... ok".
task_buffers() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    gpus_info >"$OUT/buffers-machine.txt" 2>&1
    step test-cuda_buffers 120 $BIN/test-cuda_buffers --ignored --test-threads=1
    for dt in f32 bf16 f16; do
        step "cuda_buffers-$dt" 120 $BIN/cuda_buffers --devices 2 --dtype "$dt"
    done
    cat "$OUT/buffers-machine.txt"
    cat "$OUT/cuda_buffers-bf16.log"
    printf '%s\n' "${summary[@]}"
}

# Fusions inside someone else's program, on one GPU (binaries built with
# CUDARC_CUDA_VERSION=13000): the caller's-stream tests of tests/caller_stream.rs (inputs
# written by the caller's kernel on its stream, the call on that stream, outputs read by the
# caller's kernel there, no host wait in between, 1,000 calls with fresh inputs walked and
# replayed, and on the per-thread default streams of two threads; a capturing stream is
# refused with the reason), the cudarc-buffer tests, the single-GPU conformance cases and
# CUDA-graph tests (those needing two GPUs skip), and host_costs (the replayed one-GEMM
# call on the rank's own stream, on a caller's stream and on the per-thread default stream,
# in one process) twice. When another build's host_costs is staged as
# .gpu/bin/host_costs_base (e.g. the commit before a change), the two alternate, for an A/B
# of the call's host cost in one run on one machine.
task_caller_stream() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=30
    gpus_info >"$OUT/caller-stream-machine.txt" 2>&1
    step test-caller_stream 180 $BIN/test-caller_stream --ignored --test-threads=1 --nocapture
    step test-cuda_buffers 120 $BIN/test-cuda_buffers --ignored --test-threads=1
    step test-rank_handles 120 $BIN/test-rank_handles --test-threads=1
    step test-conformance-1gpu 240 $BIN/test-conformance --test-threads=1
    step test-cuda_graphs 240 $BIN/test-cuda_graphs --ignored --test-threads=1
    step test-caller_capture 240 $BIN/test-caller_capture --ignored --test-threads=1 --nocapture
    STEP_PATTERN='rror|us per call'
    for i in 1 2; do
        step host-costs-$i 120 $BIN/host_costs --devices 1
        if [ -x $BIN/host_costs_base ]; then
            step host-costs-base-$i 120 $BIN/host_costs_base --devices 1
        fi
    done
    cat "$OUT/caller-stream-machine.txt"
    grep -h "caller's stream:\|per-thread streams" "$OUT/test-caller_stream.log"
    for f in "$OUT"/host-costs-*.log; do
        echo "$(basename "$f" .log):"
        grep -h "one-GEMM fusion call\|minus the rank" "$f"
    done
    printf '%s\n' "${summary[@]}"
}

# The candle Llama layer on one GPU: candle's CUDA device, a prefill of [prefill] tokens
# (default 2048) and [steps] decode steps (default 100), the fusions' layer against
# --candle-tp and --candle-only, each checked against candle alone in f32. The binary is
# built here with
#   CUDA_HOME=<toolkit> CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000 \
#     cargo build --release --features candle-cuda --example candle_llama
# (candle links CUDA dynamically) and staged as $BIN/candle_llama.
# A binary linked against CUDA (candle's dynamic linking) needs cuBLAS, cuRAND, the CUDA
# runtime and NCCL by their sonames: PyTorch's wheels have them.
candle_libraries() {
    local lib found
    for lib in libcublas.so.13 libcurand.so.10 libcudart.so.13 libnccl.so.2; do
        found=$(python3 -c "import sys,glob
for p in sys.path:
    for f in glob.glob(p + '/nvidia/**/$lib', recursive=True):
        print(f); raise SystemExit" 2>/dev/null)
        [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
    done
}

task_candle() {
    local prefill=${1:-2048} steps=${2:-100}
    candle_libraries
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/machine.txt"
    ldd "$BIN/candle_llama" | grep -E "cuda|cublas|curand|nccl|not found" >>"$OUT/machine.txt"
    llama() {
        local name=$1; shift
        local start=$SECONDS
        timeout 240 "$BIN/candle_llama" "$@" >"$OUT/$name.log" 2>&1
        local rc=$?
        summary+=("$(printf '%-22s rc=%d %3ds  %s' "$name" "$rc" $((SECONDS - start)) \
            "$(grep -E 'prefill|decode:|check:|copies|error' "$OUT/$name.log" | tr -s ' ' | tr '\n' '|' | cut -c1-420)")")
    }
    local w="$OUT/llama3-8b-layer.safetensors"
    local common=(--llama3-8b --weights "$w")
    local full=(--prefill "$prefill" --decode-steps "$steps")
    llama fusions-bf16 "${common[@]}" "${full[@]}" --dtype bf16
    llama candle-tp-bf16 "${common[@]}" "${full[@]}" --dtype bf16 --candle-tp
    llama candle-only-bf16 "${common[@]}" "${full[@]}" --dtype bf16 --candle-only
    llama fusions-f32 "${common[@]}" --prefill "$prefill" --decode-steps 8 --dtype f32
    llama fusions-bf16-decode8 "${common[@]}" --dtype bf16 --prefill 64 --decode-tokens 8 --decode-steps 50
    llama candle-tp-bf16-decode8 "${common[@]}" --dtype bf16 --prefill 64 --decode-tokens 8 --decode-steps 50 --candle-tp
    rm -f "$w"
    cat "$OUT/machine.txt"
    printf '%s\n' "${summary[@]}"
}

# The candle Llama layer (Llama-3-8B sizes, bf16) tensor-parallel over [gpus] processes under
# torchrun, one GPU each, as a serving application runs it: the fusions against candle's own
# tensor parallelism (--candle-tp: a blocking NCCL all-reduce per block). [part] is
# `decode` (1, 8 and 64 tokens per step, 30 steps: the fusions in the tensor-parallel form,
# eager and with the step recorded as one CUDA graph (--graph), the sequence-parallel form
# at 1 token, candle's TP eager and recorded), `prefill` (512 and 2048 tokens from an empty
# cache, the median of 20 on every rank: both forms and candle's TP) or `all`. Every step
# is checked against candle alone in f32. Each run's table rows go to the summary.
# CANDLE_ARGS adds flags to every run (e.g. `--sections`: where each eager step's time goes).
task_candle_tp() {
    local gpus=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)} part=${2:-all}
    candle_libraries
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=120
    # The plans tuning chose for each fusion and shape come back with the logs.
    export FUSION_PLAN_CACHE=${FUSION_PLAN_CACHE:-$OUT/plans.json}
    gpus_info >"$OUT/machine.txt" 2>&1
    local w="$OUT/llama3-8b-layer.safetensors"
    local runs=() run name
    if [ "$part" = decode ] || [ "$part" = all ]; then
        for t in 1 8 64; do
            runs+=("decode$t-tp:--prefill 64 --decode-steps 30 --decode-tokens $t"
                "decode$t-tp-graph:--prefill 64 --decode-steps 30 --decode-tokens $t --graph"
                "decode$t-candle-tp:--prefill 64 --decode-steps 30 --decode-tokens $t --candle-tp"
                "decode$t-candle-tp-graph:--prefill 64 --decode-steps 30 --decode-tokens $t --candle-tp --graph")
        done
        runs+=("decode1-sp:--prefill 64 --decode-steps 30 --decode-tokens 1 --decode-form sp")
    fi
    if [ "$part" = prefill ] || [ "$part" = all ]; then
        for t in 512 2048; do
            runs+=("prefill$t-sp:--prefill $t --decode-steps 0 --prefill-form sp"
                "prefill$t-tp:--prefill $t --decode-steps 0 --prefill-form tp"
                "prefill$t-candle-tp:--prefill $t --decode-steps 0 --candle-tp")
        done
    fi
    for run in "${runs[@]}"; do
        name="tp$gpus-${run%%:*}"
        # shellcheck disable=SC2086
        step "$name" 240 torchrun --nproc-per-node "$gpus" --no-python "$BIN/candle_llama" \
            --llama3-8b --weights "$w" --dtype bf16 ${run#*:} ${CANDLE_ARGS:-}
    done
    rm -f "$w"
    cat "$OUT/machine.txt"
    for f in "$OUT"/tp*.log; do
        echo "$(basename "$f" .log): $(grep -E '^\| [a-z]|check:|error' "$f" | grep -v '^| mode' | tr -s ' ' | tr '\n' '|' | cut -c1-300)"
        grep -h "sections, median" "$f" | head -4
    done
    printf '%s\n' "${summary[@]}"
}

# The candle layer's decode steps (Llama-3-8B sizes, bf16, 30 steps after a 64-token prefill)
# over [gpus] processes under torchrun, this build ($BIN/candle_llama) against another's
# ($CANDLE_BASE, default $BIN/candle_llama_base) and candle's own TP, at 1, 8 and 64 tokens
# ($TOKENS), eager and captured: [reps] rounds (default 2; each configuration's run takes
# ~15 s on 4 H100s), each running every configuration once in turn, so
# that the host-bound eager steps, which move by up to 30% from run to run, are compared
# across rounds. Prints each configuration's runs and their median (slowest rank's ms).
# CANDLE_ARGS adds flags to every run (e.g. `--layers 32`: a model's step of 32 layers).
task_candle_ab() {
    local gpus=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)} reps=${2:-2} tokens=${TOKENS:-1 8 64}
    candle_libraries
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=120
    # The plans tuning chose for each fusion and shape come back with the logs.
    export FUSION_PLAN_CACHE=${FUSION_PLAN_CACHE:-$OUT/plans.json}
    gpus_info >"$OUT/machine.txt" 2>&1
    local base=${CANDLE_BASE:-$BIN/candle_llama_base}
    [ -x "$base" ] || { echo "no $base: point CANDLE_BASE at another build's candle_llama" >&2; return 2; }
    local w="$OUT/llama3-8b-layer.safetensors" rep t g who bin extra name
    for rep in $(seq "$reps"); do
        for t in $tokens; do
            for g in eager graph; do
                for who in this base candle-tp; do
                    bin=$BIN/candle_llama extra=""
                    [ "$who" = base ] && bin=$base
                    [ "$who" = candle-tp ] && extra="--candle-tp"
                    [ "$g" = graph ] && extra="$extra --graph"
                    name="ab-$who-$g-$t-$rep"
                    # shellcheck disable=SC2086
                    step "$name" 120 torchrun --nproc-per-node "$gpus" --no-python "$bin" \
                        --llama3-8b --weights "$w" --dtype bf16 --prefill 64 --decode-steps 30 \
                        --decode-tokens "$t" $extra ${CANDLE_ARGS:-}
                done
            done
        done
    done
    rm -f "$w"
    cat "$OUT/machine.txt"
    echo "| build | step | tokens | ms per round (slowest rank's median) | median |"
    echo "| --- | --- | --- | --- | --- |"
    for t in $tokens; do
        for g in eager graph; do
            for who in this base candle-tp; do
                local runs=() f v
                for f in "$OUT"/ab-"$who"-"$g"-"$t"-*.log; do
                    v=$(grep -E '^\| (fusions|candle-tp) \| decode' "$f" | awk -F'|' '{gsub(/ /, "", $7); print $7}')
                    runs+=("${v:-fail}")
                done
                printf '| %s | %s | %s | %s | %s |\n' "$who" "$g" "$t" "${runs[*]}" \
                    "$(printf '%s\n' "${runs[@]}" | grep -v fail | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "-"}')"
            done
        done
    done
    printf '%s\n' "${summary[@]}" | grep -v "rc=0 " || true
}

# The candle layer's last step kernel by kernel: Nsight Compute (`ncu`, clocks and caches
# left alone, every kernel of replayed graphs node by node) wraps rank 0 of [gpus]
# processes under torchrun, the other ranks run free (so no collective deadlocks; rank 0's
# collectives then show the others' waits, not their own time); fusions, then candle's TP.
# [tokens] per step (default 64) decoded with the step captured (`--graph`), or `prefill`
# [tokens] prefills (default 512). Prints each mode's last step (bench/ncu_step_kernels.py).
task_candle_kernels() {
    local gpus=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)} what=${2:-64} tokens
    candle_libraries
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=120
    gpus_info >"$OUT/machine.txt" 2>&1
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu on this machine" >&2; return 2; }
    local args=(--prefill 64 --prefill-reps 1 --decode-steps 3 --decode-tokens "$what" --graph)
    if [ "$what" = prefill ]; then
        tokens=${3:-512}
        args=(--prefill "$tokens" --prefill-reps 2 --decode-steps 0)
    fi
    local wrap="$OUT/ncu-rank0.sh" w="$OUT/llama3-8b-layer.safetensors" mode name
    cat >"$wrap" <<EOW
#!/bin/bash
if [ "\${LOCAL_RANK:-0}" = 0 ]; then
    exec "$ncu" --clock-control none --cache-control none --graph-profiling node --csv \\
        --metrics gpu__time_duration.sum --log-file "\$NCU_CSV" "\$@"
fi
exec "\$@"
EOW
    chmod +x "$wrap"
    for mode in fusions candle-tp; do
        name="kernels-$mode"
        local extra=()
        [ "$mode" = candle-tp ] && extra=(--candle-tp)
        NCU_CSV="$OUT/$name.csv" step "$name" 300 torchrun --nproc-per-node "$gpus" --no-python \
            "$wrap" "$BIN/candle_llama" --llama3-8b --weights "$w" --dtype bf16 "${args[@]}" "${extra[@]}"
    done
    rm -f "$w"
    cat "$OUT/machine.txt"
    for mode in fusions candle-tp; do
        echo "== $mode, rank 0, us per kernel"
        python3 bench/ncu_step_kernels.py "$OUT/kernels-$mode.csv" 30 || true
    done
    printf '%s\n' "${summary[@]}"
}

# The gated MLP's first half at decode sizes on one GPU, as one kernel (both weights in each
# stage, the SiLU product in the epilogue) against cuBLAS's two GEMMs or one on the weights side
# by side, each followed by an elementwise kernel (bench/decode_gemm/gated_harness.cu).
task_gated_gemm() {
    gpus_info >"$OUT/machine.txt" 2>&1
    command -v nvcc >/dev/null || { echo "gated-gemm: no nvcc on the PATH" >&2; return 2; }
    local bench=${TMPDIR:-/tmp}/fusion-gated-gemm-bench
    step gated-gemm-build 300 nvcc -O3 -std=c++17 -arch=sm_90 bench/decode_gemm/gated_harness.cu -lcublas -o "$bench"
    STEP_PATTERN='check:|rror' CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} step gated-gemm 240 "$bench"
    cat "$OUT/machine.txt"
    grep -h '^|\|wrong' "$OUT/gated-gemm.log"
    printf '%s\n' "${summary[@]}"
}

# The storer-warp GEMM+ReduceScatter (gemm.cu's HOPPER_GEMM_RS) in both walks, its
# communication alone and the GEMM alone, on [gpus] GPUs (default: every GPU), then on 2.
task_rs() {
    local gpus=${1:-$(nvidia-smi -L | wc -l)}
    gpus_info >"$OUT/machine.txt" 2>&1
    # The harnesses staged with the binaries (STAGE_HARNESSES=1 scripts/stage-gpu.sh), else
    # built here.
    local hg="$BIN"
    if [ ! -x "$hg/hopper_gemm_rs_bench" ]; then
        command -v nvcc >/dev/null || { echo "rs: no staged harnesses and no nvcc on the PATH" >&2; return 2; }
        hg="$OUT/hopper_gemm"
        CUDA_LIB="${CUDA_HOME:-/usr/local/cuda}/lib64" step rs-build 600 \
            bash bench/hopper_gemm/build.sh "$hg"
    fi
    local d
    for d in "$gpus" $( [ "$gpus" -gt 2 ] && echo 2); do
        STEP_PATTERN='ALL CORRECT|SOME FAILED|rror' \
            step "rs-d$d" 300 "$hg/hopper_gemm_rs_bench" "$d" "${HARNESS_REPS:-20}"
    done
    rm -rf "$OUT/hopper_gemm"
    cat "$OUT/machine.txt"
    local f
    for f in "$OUT"/rs-d*.log; do echo "== $(basename "$f" .log)"; sed -n '/^    M     K     N/,$p' "$f"; done
    printf '%s\n' "${summary[@]}"
}

# Row programs at prefill sizes on one GPU (row_bench): a norm and a softmax as one row
# kernel against the same fusions with their reductions ending the row segment and
# against no pointwise fusion; [args..] go to row_bench (--rows, --norm-widths, ...).
task_rows() {
    gpus_info >"$OUT/machine.txt" 2>&1
    STEP_PATTERN='^\| (add_rms_norm|softmax)|rror' CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
        step rows 400 "$BIN/row_bench" --devices 1 "$@"
    cat "$OUT/machine.txt"
    sed -n '/^| fusion/,$p' "$OUT/rows.log"
    printf '%s\n' "${summary[@]}"
}

# Decode-size communication on [gpus] GPUs (default: every GPU): decode_bench's Allreduce
# latency (4 KB to 64 MB) and GEMM + Allreduce at Llama-70B's decode shapes, calls replayed
# one by one and recorded into one CUDA graph of the caller's (--graph); then PyTorch's
# Allreduce (NCCL, symm_mem one-shot and two-shot) under torchrun on the same GPUs; then,
# where nvcc is found, every peer-memory Allreduce kernel alone at every size and grid
# (bench/peer_memory/harness.cu), which the size rules of peer_memory/mod.rs come from, and
# a decode GEMM with the Allreduce in its epilogue (bench/decode_gemm/allreduce_harness.cu).
task_decode() {
    local gpus=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}
    gpus_info >"$OUT/machine.txt" 2>&1
    step "decode-bench-d$gpus" 240 "$BIN/decode_bench" --json "$OUT/decode-d$gpus.jsonl"
    step "decode-bench-graph-d$gpus" 240 "$BIN/decode_bench" --graph --json "$OUT/decode-graph-d$gpus.jsonl"
    # Llama-8B's row-parallel projections (4096 columns: the fused kernel's two parts of K),
    # the candle layer's shapes.
    step "decode-bench-8b-graph-d$gpus" 120 "$BIN/decode_bench" --graph --sizes "" --gather-sizes "" \
        --gemms "o_proj_8b:4096:4096;down_proj_8b:14336:4096" --rows 1,8,16 --json "$OUT/decode-8b-graph-d$gpus.jsonl"
    step "torch-allreduce-d$gpus" 240 torchrun --nproc-per-node "$gpus" bench/torch_allreduce.py
    # The Allreduce kernels one by one (bench/peer_memory/harness.cu), where nvcc is found.
    local harness=${TMPDIR:-/tmp}/fusion-peer-allreduce-bench
    if command -v nvcc >/dev/null; then
        step peer-kernels-build 300 nvcc -O3 -std=c++17 -arch=sm_90 bench/peer_memory/harness.cu -o "$harness"
        STEP_PATTERN='check:|rror' step "peer-kernels-d$gpus" 240 "$harness" "$gpus"
        # A decode GEMM whose epilogue does the Allreduce, against cuBLAS's GEMM alone
        # (bench/decode_gemm/allreduce_harness.cu).
        local fused=${TMPDIR:-/tmp}/fusion-gemm-allreduce-bench
        step gemm-allreduce-build 300 nvcc -O3 -std=c++17 -arch=sm_90 bench/decode_gemm/allreduce_harness.cu -lcublas -o "$fused"
        STEP_PATTERN='check:|rror' step "gemm-allreduce-d$gpus" 240 "$fused" "$gpus"
    else
        summary+=("peer-kernels: skipped, no nvcc on the PATH")
    fi
    cat "$OUT/machine.txt"
    grep -h '^| ' "$OUT/decode-bench-graph-d$gpus.log" "$OUT/decode-bench-8b-graph-d$gpus.log" "$OUT/decode-bench-d$gpus.log"
    grep -h '^torch' "$OUT/torch-allreduce-d$gpus.log"
    [ -f "$OUT/peer-kernels-d$gpus.log" ] && tail -15 "$OUT/peer-kernels-d$gpus.log"
    [ -f "$OUT/gemm-allreduce-d$gpus.log" ] && grep '^|' "$OUT/gemm-allreduce-d$gpus.log"
    printf '%s\n' "${summary[@]}"
}

# One-GPU checks of the fault handling:
#   1. shared-ranks five times in a row (a run passes when every step of it ended with
#      rc=0; after a failed run the others would only spend time);
#   2. the fault suite (tests/faults.rs) on the GPU with FUSION_TIMEOUT=10 (every error
#      within 15 s): a rank that never sends, a rank that panics in the middle of a
#      pipeline, a launched process killed (SIGKILL) or frozen (SIGSTOP) in the middle of a
#      call; on one GPU the ranks share it;
#   3. torchrun with one process more than there are GPUs: must exit non-zero within 10 s
#      naming the visible GPU count and the fix, on every rank; on one GPU again with
#      CUDA_VISIBLE_DEVICES=0 for both (found from the GPU UUIDs at the rendezvous);
#   4. check from a copy of the repository at another path than the build's.
# Each task's logs in a folder of its own under $OUT.
task_faults() {
    local table=() gpus i start steps failed rc
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    echo "GPUs: $gpus" >"$OUT/machine.txt"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader >>"$OUT/machine.txt" 2>&1

    for i in 1 2 3 4 5; do
        start=$SECONDS
        OUT="$OUT/shared-ranks-$i" bash "$SELF" shared-ranks >"$OUT/shared-ranks-$i.txt" 2>&1
        steps=$(grep -cE '^[a-z_-]+-?[0-9]* +rc=' "$OUT/shared-ranks-$i.txt")
        failed=$(grep -E '^[a-z_-]+-?[0-9]* +rc=' "$OUT/shared-ranks-$i.txt" | grep -vc 'rc=0 ')
        table+=("$(printf '%-34s %s  %3ss  %s steps, %s failed' "shared-ranks-$i" \
            "$([ "$failed" = 0 ] && [ "$steps" -gt 0 ] && echo PASS || echo FAIL)" \
            "$((SECONDS - start))" "$steps" "$failed")")
        if [ "$failed" != 0 ] || [ "$steps" = 0 ]; then
            table+=("shared-ranks: stopped after run $i failed")
            break
        fi
    done

    start=$SECONDS
    FUSION_BACKEND=cuda FUSION_TIMEOUT=10 RUST_BACKTRACE=0 timeout 300 \
        $BIN/test-faults --test-threads=1 --nocapture >"$OUT/faults.log" 2>&1
    rc=$?
    table+=("$(printf '%-34s %s  %3ss  %s' faults "$([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc")" \
        "$((SECONDS - start))" "$(grep -E 'test result' "$OUT/faults.log" | tail -1 | cut -c1-70)")")

    torchrun_check() {
        local name=$1 needle=$2; shift 2
        local t0 t1 rc secs named ok=FAIL
        t0=$(date +%s.%N)
        timeout 60 env "$@" torchrun --nproc-per-node $((gpus + 1)) --no-python $BIN/ag_matmul \
            >"$OUT/$name.log" 2>&1
        rc=$?
        t1=$(date +%s.%N)
        secs=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
        named=$(grep -c "$needle" "$OUT/$name.log")
        if [ $rc != 0 ] && [ $rc != 124 ] && python3 -c "import sys; sys.exit(0 if $secs <= 10 else 1)" \
            && [ "$named" -ge 1 ]; then ok=PASS; fi
        table+=("$(printf '%-34s %s  %5ss  rc=%s, %s lines name it' "$name" $ok "$secs" $rc "$named")")
    }
    torchrun_check torchrun-more-processes-than-gpus "GPU.* visible.*--nproc-per-node $gpus" FUSION_TIMEOUT=30
    if [ "$gpus" = 1 ]; then
        torchrun_check torchrun-two-processes-one-gpu "both use GPU GPU-" FUSION_TIMEOUT=30 CUDA_VISIBLE_DEVICES=0
    fi

    local copy
    copy=$(mktemp -d /tmp/fusion-elsewhere-XXXXXX)/repo
    mkdir -p "$copy"
    cp -r scripts tests "$copy/" && mkdir -p "$copy/.gpu" && cp .gpu/bin.tar.xz "$copy/.gpu/"
    start=$SECONDS
    (cd "$copy" && OUT="$OUT/gpu-check" BIN= bash scripts/gpu.sh check >"$OUT/gpu-check.txt" 2>&1)
    steps=$(grep -cE ' rc=' "$OUT/gpu-check.txt")
    failed=$(grep -E ' rc=' "$OUT/gpu-check.txt" | grep -vc 'rc=0 ')
    table+=("$(printf '%-34s %s  %3ss  %s steps, %s failed (from %s)' check-elsewhere \
        "$([ "$failed" = 0 ] && [ "$steps" -gt 0 ] && echo PASS || echo FAIL)" \
        "$((SECONDS - start))" "$steps" "$failed" "$copy")")
    rm -rf "$(dirname "$copy")"

    echo "--- fault suite"
    grep -hE '^(never sends|panic:|KILL:|STOP:)|test .* \.\.\. |FAIL' "$OUT/faults.log" | cut -c1-300
    echo "--- torchrun"
    grep -h "error" "$OUT"/torchrun-*.log | sort | uniq -c | cut -c1-400
    echo "--- host_costs --share-gpus (run 1)"
    head -30 "$OUT/shared-ranks-1/host-costs-shared.log" 2>/dev/null
    echo "--- steps of the shared-rank runs that failed"
    grep -hE ' rc=' "$OUT"/shared-ranks-*.txt | grep -v 'rc=0 ' || echo none
    echo "--- steps of check that failed"
    grep -hE ' rc=' "$OUT/gpu-check.txt" | grep -v 'rc=0 ' || echo none
    printf '%s\n' "${table[@]}"
}

# Host cost (default: all GPUs for the per-call part): host_costs (enqueuing a GEMM, a
# stream wait, a copy kernel; the Matmul node of a walked program; a one-GEMM call walked
# and replayed as a CUDA graph), and the overlap benchmark's host time per
# call of the collective AG+GEMM pipeline for 2-16 stream iterations, walked and replayed.
task_host() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    STEP_PATTERN='us per call|rror'
    local d=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
    [ "$d" -ge 1 ] 2>/dev/null || d=1
    step host-costs 120 $BIN/host_costs --devices 1
    step host-per-call 300 $BIN/overlap_bench --devices "$d" --ops ag --shapes 4096,1024,1024 \
        --transports "" --chunks 2 --streams 2 --rs-subchunks "" --iters 5 --warmup 2 \
        --json "$OUT/host-per-call.jsonl"
    cat "$OUT/host-costs.log"
    grep -h "host per call\|host overhead" "$OUT/host-per-call.log"
    printf '%s\n' "${summary[@]}"
}

# Host cost A/B: $BIN/host_costs against $BIN/host_costs_base (another build's, e.g. the
# commit before a change, staged beside it) in [pairs] pairs of processes (default 12),
# pinned to one core where taskset exists, the order swapped every pair; per row of
# host_costs the medians of both builds, the median of the paired differences and how many
# pairs the new build was slower in (the hosts vary process to process: only the pairing
# tells a change from noise).
task_host_ab() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    local pairs=${1:-12} i w pin=""
    [ -x "$BIN/host_costs_base" ] || { echo "host-ab: no $BIN/host_costs_base staged" >&2; return 2; }
    command -v taskset >/dev/null && pin="taskset -c 3"
    gpus_info >"$OUT/machine.txt" 2>&1
    echo "pinning: ${pin:-none}; pairs: $pairs" >>"$OUT/machine.txt"
    for i in $(seq 1 "$pairs"); do
        for w in $([ $((i % 2)) = 1 ] && echo new base || echo base new); do
            local b=$BIN/host_costs
            [ "$w" = base ] && b=$BIN/host_costs_base
            # shellcheck disable=SC2086
            timeout 90 $pin "$b" --devices 1 >"$OUT/$w-$i.log" 2>&1
        done
    done
    cat "$OUT/machine.txt"
    python3 - "$OUT" "$pairs" <<'PY'
import re, statistics as st, sys
out, pairs = sys.argv[1], int(sys.argv[2])
rows = {}
for w in ("new", "base"):
    for i in range(1, pairs + 1):
        try:
            lines = open(f"{out}/{w}-{i}.log").read().splitlines()
        except OSError:
            continue
        for line in lines:
            m = re.match(r"\s+(.*?)\s+([\d.]+) us per call", line)
            if m:
                rows.setdefault(m.group(1), {}).setdefault(w, {})[i] = float(m.group(2))
print(f"{'host_costs row':64} {'new':>7} {'base':>7} {'paired':>7}  slower")
for name, v in rows.items():
    new, base = v.get("new", {}), v.get("base", {})
    both = [i for i in new if i in base]
    if not both:
        continue
    d = [new[i] - base[i] for i in both]
    print(f"{name[:64]:64} {st.median(new.values()):7.2f} {st.median(base.values()):7.2f} "
          f"{st.median(d):+7.2f}  {sum(x > 0 for x in d)}/{len(d)}")
PY
}

# Multi-process checks with 2+ GPUs (NPROC processes, default 2): the conformance suite and
# the examples under `torchrun --nproc-per-node 2 --no-python` (one process per GPU), one
# example under mpirun, a rank that exits early on GPUs, sub-worlds, and the overlap
# benchmark in the one-process-per-GPU layout against the single-process run. The logs
# travel as one archive (KEEP_LOGS=1 keeps them as files).
task_launch() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
    local n=${NPROC:-2}
    {
        gpus_info
        nvidia-smi topo -m 2>/dev/null | head -6
        torch_info
        which torchrun mpirun
        uname -r
        # What torchrun tells its workers (which port its own store holds).
        torchrun --nproc-per-node 1 --no-python sh -c 'env | grep -E "^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_USE_AGENT_STORE)=" | sort' 2>&1 | tail -8
    } >"$OUT/machine.txt" 2>&1
    fresh_seed "$OUT/machine.txt"
    local tr="torchrun --nproc-per-node $n --no-python"
    # Canary: a launched world that only joins. If the default rendezvous port is taken (a
    # torchrun whose store we do not know about), say so and use an explicit one for the rest.
    step torchrun-join 60 $tr $BIN/test-launched --exact child_joins --ignored --nocapture
    if grep -q "is in use" "$OUT/torchrun-join.log"; then
        export FUSION_MASTER_PORT=29690
        summary+=("default rendezvous port in use under torchrun: FUSION_MASTER_PORT=29690 from here")
        step torchrun-join-port 60 $tr $BIN/test-launched --exact child_joins --ignored --nocapture
    fi
    for dt in f32 bf16; do
        FUSION_TEST_DTYPE=$dt FUSION_RESULTS="$OUT/conformance-launched.jsonl" \
            step "torchrun-conformance-$dt" 300 $tr $BIN/test-conformance --test-threads=1
    done
    # The transports each rank chose (printed with the host program).
    FUSION_DUMP=host_ir step torchrun-dump 120 $tr $BIN/ag_matmul_p2p --dtype bf16
    for ex in ag_matmul matmul_ar matmul_rs allgather_p2p ag_matmul_p2p; do
        step "torchrun-$ex" 120 $tr $BIN/$ex --dtype bf16
    done
    step mpirun-ag_matmul_p2p 120 mpirun --allow-run-as-root --oversubscribe -np "$n" \
        -x FUSION_BACKEND -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x MASTER_PORT=29660 \
        $BIN/ag_matmul_p2p --dtype bf16
    # A rank that exits once the world has started: the other must name it, quickly.
    local port=29670 r
    for r in $(seq 0 $((n - 1))); do
        FUSION_RANK=$r FUSION_WORLD_SIZE=$n FUSION_LOCAL_RANK=$r FUSION_LOCAL_WORLD_SIZE=$n \
            FUSION_MASTER_PORT=$port FUSION_TIMEOUT=30 timeout 120 \
            $BIN/test-launched --exact child_exits_early --ignored --nocapture >"$OUT/exit-early-r$r.log" 2>&1 &
    done
    wait
    summary+=("exit-early (GPU): $(grep -h -o 'EARLY-EXIT-SEEN.\{0,110\}' "$OUT"/exit-early-r*.log | head -1)")
    # Sub-worlds on GPUs: each process a group of its own, then the whole world.
    step torchrun-subworlds 120 $tr $BIN/test-launched --exact child_subworlds --ignored --nocapture
    # The fused AllGather + GEMM (compute capability 9.0) reading blocks its peers push over
    # CUDA IPC, against the unpipelined plan.
    step torchrun-gathered-gemm 240 $tr $BIN/test-hopper_gathered_gemm --ignored --test-threads=1 \
        --exact the_gathered_gemm_matches_the_unpipelined_plan_in_a_launched_world
    # Overlap: the same variants in one process driving both GPUs, then one process per GPU.
    local args="--devices $n --transports push/peer --chunks 4 --streams 4 --rs-subchunks 4 ${BENCH_ARGS:-}"
    step overlap-single 300 $BIN/overlap_bench $args --json "$OUT/overlap-single.jsonl"
    step overlap-launched 300 $tr $BIN/overlap_bench $args --json "$OUT/overlap-launched.jsonl" \
        --trace p2p_ce_push_peer_n$n
    python3 bench/compare_layouts.py "$OUT/overlap-single.jsonl" "$OUT/overlap-launched.jsonl" | tee "$OUT/layouts.md"
    cat "$OUT/machine.txt"
    grep -h "transports of rank\|  rank .* -> rank" "$OUT/torchrun-dump.log" | sort -u | head -8
    grep -h "host overhead" "$OUT/overlap-single.log" "$OUT/overlap-launched.log"
    printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
    if [ -z "${KEEP_LOGS:-}" ]; then
        tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
    fi
}

# Replayed calls on two GPUs of one process: the CUDA-graph tests (replayed calls bit for
# bit equal to eager ones with fresh and moved inputs, over copy engines and NCCL) and
# host_costs (enqueue costs, the Matmul node, tiny pipelines walked and replayed in bursts
# from an idle device, what a graph's launch costs per kind of node).
task_replay_x2() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    STEP_PATTERN='test result|us per call|rror'
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/machine.txt" 2>&1
    step cuda-graphs 240 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture
    step host-costs 150 $BIN/host_costs --devices 2 --graph-topologies
    grep -E "test result|FAILED|panicked" "$OUT/cuda-graphs.log"
    cat "$OUT/host-costs.log"
    printf '%s\n' "${summary[@]}"
}

# Two GPUs of one process:
#   1. the peer-failure test alone in its own process; if it is still running after 45 s,
#      every thread's stack (gdb or eu-stack where installed, else the kernel's wait
#      channels) goes to peer-failure-stacks.txt before it is killed;
#   2. the other CUDA-graph tests (replayed == eager, the ring on two compute streams too);
#   3. GEMM+RS at 16384x8192x2048 with 2 and 4 row ranges per block, the ring's GEMMs on one
#      and on two compute streams, and the GEMM alone in the same row pieces; RUNS times
#      (default 3), to see the spread between runs.
task_ring_x2() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    STEP_PATTERN='test result|rror|GEMM\+RS'
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/machine.txt" 2>&1
    local name=a_rank_failing_while_its_peer_replays_ends_the_run_without_a_hang
    local start=$SECONDS pid rc t i
    FUSION_TEST_OWN_PROCESS=1 $BIN/test-cuda_graphs "$name" --exact --ignored --nocapture \
        >"$OUT/peer-failure.log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt 45 ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "still running after $((SECONDS - start)) s" >>"$OUT/peer-failure.log"
        {
            if command -v gdb >/dev/null; then
                timeout 60 gdb -batch -p "$pid" -ex "thread apply all bt"
            elif command -v eu-stack >/dev/null; then
                timeout 60 eu-stack -p "$pid"
            fi
            for t in /proc/"$pid"/task/*; do
                echo "$t $(cat "$t/comm") wchan=$(cat "$t/wchan")"
            done
        } >"$OUT/peer-failure-stacks.txt" 2>&1
        kill -9 "$pid"
    fi
    wait "$pid"
    rc=$?
    summary+=("$(printf '%-30s rc=%-4s %4ss  %s' peer-failure "$rc" "$((SECONDS - start))" "$(grep -E 'test result|\[ *[0-9.]+ s\]' "$OUT/peer-failure.log" | tail -1)")")

    step cuda-graphs 300 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture --skip "$name"
    for i in $(seq 1 "${RUNS:-3}"); do
        step "ring-run$i" 240 $BIN/overlap_bench --devices 2 --ops rs --shapes 16384,8192,2048 \
            --transports push/peer --rs-subchunks 2,4 --json "$OUT/ring-run$i.jsonl"
    done
    grep -E "test result|FAILED|panicked" "$OUT/cuda-graphs.log"
    grep -E "^\[|test result|panicked|still running" "$OUT/peer-failure.log"
    for i in $(seq 1 "${RUNS:-3}"); do
        echo "== run $i"
        python3 - "$OUT/ring-run$i.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms = {r["case"]: r["ms"] for r in rows if r.get("op") == "GEMM+RS"}
bound = max(ms.get("comm_alone", 0), ms.get("gemm_alone", 0))
for v, t in sorted(ms.items(), key=lambda kv: kv[1]):
    print(f"{v:40s} {t:7.3f} ms  {t / bound if bound else 0:5.3f}x bound")
PY
    done
    printf '%s\n' "${summary[@]}"
}

# What a machine with fewer GPUs than ranks can check of the copy-engine pipelines: two
# ranks on the visible GPUs (both on GPU 0 on a one-GPU machine, `cuda_world_sharing_gpus`;
# their hand-offs go through events and the host, since a device-side flag wait for a peer
# on the same GPU can deadlock). Runs the shared-rank graph test twice (the AG+GEMM,
# GEMM+ReduceScatter ring and MLP block pipelines against the CPU backend, eagerly; ranks
# sharing a GPU refuse to replay, and the test checks that they say why; it runs itself in a
# process with the environment it needs, and check runs the other graph tests), the
# runtime's GPU unit tests three times (flag hand-offs between two ranks of one GPU set up by
# hand, eager and replayed, their host cost against hand-offs through events, and a flag
# wait for a rank that never sends ending in an error), and host_costs on the two ranks
# (tiny copy-engine pipelines, walked, 2 to 16 stream iterations). A hang fails within 30 s.
task_shared_ranks() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=30
    local i
    for i in 1 2; do
        step "cuda_graphs_shared-$i" 90 $BIN/test-cuda_graphs --ignored --test-threads=1 --nocapture \
            --exact copy_engine_pipelines_on_two_ranks_sharing_the_visible_gpus
    done
    for i in 1 2 3; do
        step "runtime_unit_gpu-$i" 60 $BIN/test-fusion_runtime_lib --ignored --test-threads=1 --nocapture
    done
    STEP_PATTERN='rror|us per call'
    step host-costs-shared 90 $BIN/host_costs --devices 2 --share-gpus
    step host-costs-shared-2 90 $BIN/host_costs --devices 2 --share-gpus
    grep -h "matches the CPU\|ranks:" "$OUT"/cuda_graphs*.log | sort | uniq -c
    grep -h "hand-off host cost" "$OUT"/runtime_unit_gpu-*.log
    cat "$OUT/host-costs-shared.log" "$OUT/host-costs-shared-2.log"
    printf '%s\n' "${summary[@]}"
}

# The memory soak of bench/src/bin/soak.rs on [devices] GPUs (default 2): 100,000 calls of the
# small AG+GEMM P2P pipeline (copy engines) inside one world run, 100,000 of the collective
# pipeline (NCCL, replayed as a CUDA graph), and 2,000 world runs of one P2P call each; at
# each checkpoint host RSS, each device's memory in use and the copy-engine events alive.
# The growth lines are printed last (each must end in "flat": growth under 1 MB after the
# first checkpoint, and no copy-engine events gained; rc=0 says the same).
task_soak() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    STEP_PATTERN='growth after|rror'
    local d=${1:-2} f
    gpus_info >"$OUT/soak-machine.txt" 2>&1
    soak() { # name timeout args...
        local name=$1 t=$2; shift 2
        step "$name" "$t" $BIN/soak --devices "$d" --json "$OUT/$name.jsonl" "$@"
    }
    soak soak-p2p 240 --fusion p2p --calls 100000
    soak soak-collective 240 --fusion collective --calls 100000
    soak soak-runs 120 --fusion p2p --calls 0 --runs 2000
    cat "$OUT/soak-machine.txt"
    for f in soak-p2p soak-collective soak-runs; do
        tail -14 "$OUT/$f.log"
        grep -h "growth after" "$OUT/$f.log"
    done
    printf '%s\n' "${summary[@]}"
}

# The `timeline` tool on $DEVICES GPUs (default 2): the AllGather + GEMM and the GEMM +
# ReduceScatter P2P pipelines (M = K = N = 8192, bf16) traced, each call drawn as an SVG.
# Writes $OUT/timeline/{ag_gemm,gemm_rs}.svg and the Chrome traces in $OUT/timeline/json/
# (one file per call and rank); prints the per-rank busy/overlap lines. The pictures go to
# docs/ (e.g. docs/timeline-ag_gemm-2xh200.svg), shown by docs/PERFORMANCE.md.
task_timeline() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    mkdir -p "$OUT/timeline"
    gpus_info >"$OUT/timeline/machine.txt" 2>&1
    timeout 300 $BIN/timeline --devices "${DEVICES:-2}" --out "$OUT/timeline" "$@" 2>&1 | tee "$OUT/timeline/timeline.log"
    local rc=${PIPESTATUS[0]}
    cat "$OUT/timeline/machine.txt"
    ls -la "$OUT/timeline" "$OUT/timeline/json"
    echo "timeline rc=$rc"
    return "$rc"
}

# A launched world with a job token (FUSION_JOB_TOKEN) under torchrun on NPROC GPUs
# (default 2): the ranks form and run checked calls (tests/job_token.rs, child_guarded)
# while a process with a wrong token and one with none try to join as rank 1 and a process
# fuzzes the handshake (truncated, oversized, replayed, garbage); each is refused and named
# in rank 0's log, and no rank sees an error. Then ranks given different tokens fail at
# formation, saying so. Success: every row of the table says ok.
task_token() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1 FUSION_TIMEOUT=30
    local n=${NPROC:-2} t=$BIN/test-job_token log=$OUT/token-world.log pid rc addr who i
    local tok stop=$OUT/token-stop join="--exact child_tries_to_join --ignored --nocapture"
    tok=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    gpus_info >"$OUT/machine.txt" 2>&1
    rm -f "$stop"
    FUSION_JOB_TOKEN=$tok FUSION_TEST_STOP=$stop timeout 300 torchrun --nproc-per-node "$n" \
        --master-port 29710 --no-python $t --exact child_guarded --ignored --nocapture >"$log" 2>&1 &
    pid=$!
    for i in $(seq 240); do grep -q "FORMED rank 0 at" "$log" && break; sleep 0.5; done
    addr=$(grep -o "FORMED rank 0 at [^ ]*" "$log" | head -1 | cut -d' ' -f5)
    # The intruders and the fuzzer are processes of the CPU backend: they need no GPU.
    local at="FUSION_BACKEND=cpu FUSION_MASTER_ADDR=${addr%:*} FUSION_MASTER_PORT=${addr##*:}"
    env -u FUSION_JOB_TOKEN $at FUSION_JOB_TOKEN=a-guess FUSION_RANK=1 FUSION_WORLD_SIZE=$n \
        timeout 60 $t $join >"$OUT/token-intruder-wrong.log" 2>&1
    env -u FUSION_JOB_TOKEN $at FUSION_RANK=1 FUSION_WORLD_SIZE=$n \
        timeout 60 $t $join >"$OUT/token-intruder-none.log" 2>&1
    env $at FUSION_JOB_TOKEN=$tok timeout 120 $t --exact child_fuzzes --ignored --nocapture \
        >"$OUT/token-fuzz.log" 2>&1
    touch "$stop"
    wait "$pid"
    rc=$?
    # Ranks that disagree: each rank's token is its own. A rank lingers after its error, so
    # torchrun stops none before rank 0's rendezvous has timed out (5 s) and said why.
    FUSION_TIMEOUT=5 timeout 120 torchrun --nproc-per-node "$n" --master-port 29720 --no-python \
        sh -c 'FUSION_JOB_TOKEN=token-of-rank-$LOCAL_RANK "$0" "$@"; rc=$?; sleep 8; exit $rc' \
        $t $join >"$OUT/token-disagree.log" 2>&1
    ok() { if "$@" >/dev/null 2>&1; then echo ok; else echo FAILED; fi; }
    cat "$OUT/machine.txt"
    echo "rendezvous of the world: $addr (token of ${#tok} hex digits)"
    printf '%-44s %s\n' \
        "world formed and ran (rc=$rc)" "$(ok test "$rc" = 0 -a "$(grep -c GUARDED-OK "$log")" = "$n")" \
        "intruder with a wrong token refused" "$(ok grep -q 'job token differs' "$OUT/token-intruder-wrong.log")" \
        "intruder with no token refused" "$(ok grep -q 'requires a job token' "$OUT/token-intruder-none.log")" \
        "handshake fuzzed" "$(ok grep -q FUZZ-DONE "$OUT/token-fuzz.log")" \
        "rank 0's log: 6 refusals named" "$(ok test "$(grep -c 'refused a connection from' "$log")" = 6)" \
        "disagreeing rank: token mismatch at once" "$(ok grep -q 'job token differs from rank 0' "$OUT/token-disagree.log")" \
        "rank 0: the refused token named" "$(ok grep -q 'for a wrong job token' "$OUT/token-disagree.log")"
    grep -h "refused a connection from" "$log"
    grep -h "JOIN-ERROR" "$OUT"/token-intruder-*.log "$OUT/token-disagree.log" | cut -c1-240
}

# Runs several tasks, each with its own output folder, and packs everything into
# $OUT/results.tgz (fewer files to fetch), keeping each task's printed
# tail in $OUT/<task>.txt.
task_session() {
    local work="$OUT/work" name start rc
    mkdir -p "$work"
    for name in "$@"; do
        mkdir -p "$work/$name"
        start=$SECONDS
        OUT="$work/$name" bash "$SELF" "$name" >"$work/$name/stdout.txt" 2>&1
        rc=$?
        tail -40 "$work/$name/stdout.txt" >"$OUT/$name.txt"
        echo "== $name rc=$rc $((SECONDS - start))s"
    done
    tar czf "$OUT/results.tgz" -C "$work" . && rm -rf "$work"
    ls -la "$OUT"
}

# What needs 2 GPUs, grouped into runs of several tasks (on a machine with 2 GPUs, .gpu carried along):
#   a: launched worlds (launch), cudarc buffers (buffers), the timeline pictures
#      (timeline), and the memory soak (soak 2)
#   b: the GPU checks on both GPUs of one process (check), the layer benchmark against
#      PyTorch (layers) and host cost per call (host)
#   c: replayed calls (replay-x2) and the D = 2 overlap table against PyTorch (overlap-x2:
#      the rows that must not get slower, GEMM+RS with 4 row ranges and the GEMM in row
#      pieces, the host time per replayed call for 2-16 iterations)
#   d: the peer-failure test alone with a stack dump if it hangs, the CUDA-graph tests,
#      GEMM+RS with 2 and 4 row ranges and the ring's GEMMs on one and two compute streams,
#      three runs (ring-x2)
task_x2() {
    case "${1:-}" in
        a) task_session launch buffers timeline soak ;;
        b) task_session check layers host ;;
        c) task_session replay-x2 overlap-x2 ;;
        d) task_session ring-x2 ;;
        e) task_session candle-tp overlap-x2 layers faults ;;
        *) echo "usage: scripts/gpu.sh x2 a|b|c|d|e" >&2; return 2 ;;
    esac
}

# Every table of the eight-GPU run, on all visible GPUs (D = 8 on an eight-GPU machine; run
# it on 4 to check it first), in four calls of one command each (on 4x H100 the parts took
# about 1, 3.5 and 4.5 minutes, and launch apart; together more than one call's 10 minutes):
#   a: the overlap benchmark at D = all, 4 and 2 against PyTorch (overlap);
#   b: the MLP and gated MLP blocks at D = all against PyTorch (layers with LAYER_D = all),
#      then decode-size communication on all GPUs (decode: Allreduce latency, GEMM +
#      Allreduce, the kernels alone, PyTorch's Allreduce);
#   c: the candle layer over all GPUs against candle's TP (candle-tp: decode 1, 8, 64
#      tokens eager and captured, prefill 512 and 2048);
#   d: launched worlds of one process per GPU (launch with NPROC = all: conformance,
#      examples, failures).
task_every_gpu() {
    local n
    n=$(nvidia-smi -L | wc -l)
    case "${1:-}" in
        a) task_session overlap ;;
        b) LAYER_D=$n task_session layers decode ;;
        c) NPROC=$n task_session candle-tp ;;
        d) NPROC=$n task_session launch ;;
        *) echo "usage: scripts/gpu.sh every-gpu a|b|c|d" >&2; return 2 ;;
    esac
}

# A world that survives a bad input, on 4 GPUs: two threads per handle, a bad input on one
# rank and the recovery in one process, then the same as 4 processes under torchrun (CUDA
# IPC, peer memory and NCCL made again), processes calling two fusions in different orders
# (the call ledger they share names both); and the call-matching check's cost per call.
task_recovery() {
    export FUSION_BACKEND=cuda RUST_BACKTRACE=1
    gpus_info >"$OUT/machine.txt" 2>&1
    step recovery-in-process 300 $BIN/test-recovery --ignored --exact \
        on_gpus_two_threads_on_one_handle_holding_numbered_steps_are_always_right \
        on_four_gpus_a_bad_input_ends_every_call_at_once_and_the_world_recovers \
        on_gpus_a_world_recovers_again_and_again --test-threads=1 --nocapture
    local tr="torchrun --nproc-per-node ${NPROC:-4} --no-python"
    FUSION_TIMEOUT=30 step recovery-torchrun 180 $tr $BIN/test-recovery --exact child_recovers --ignored --nocapture
    FUSION_TIMEOUT=30 step two-threads-torchrun 180 $tr $BIN/test-recovery --exact child_two_threads --ignored --nocapture
    FUSION_TIMEOUT=30 step ledger-torchrun 120 $tr $BIN/test-call_ledger --exact child_different_orders --ignored --nocapture
    step ledger-cost 60 $BIN/test-fusion_runtime_lib world::ledger::tests::ledger_cost_per_call --exact --ignored --nocapture
    cat "$OUT/machine.txt"
    grep -h "RECOVERY-TIME\|RECOVERED-OK\|TWO-THREADS-OK\|LEDGER-OK\|LEDGER-COST\|test result" "$OUT"/*.log
    printf '%s\n' "${summary[@]}"
}

task=${1:-help}
[ $# -gt 0 ] && shift
case "$task" in
    help | -h | --help) usage; exit 0 ;;
    check | all | buffers | caller-stream | candle | candle-tp | candle-ab | candle-kernels | decode | gated-gemm | faults | hopper-gemm | host | host-ab | launch | recovery | replay-x2 | rows | rs | \
        ring-x2 | shared-ranks | soak | timeline | token | session | x2 | every-gpu) ;;
    # The benchmarks of bench/ (their own logs and tables under $OUT).
    layers) exec bash bench/run-layers.sh ;;
    backward) exec bash bench/run-backward.sh ;;
    overlap) exec bash bench/run-overlap.sh ;;
    overlap-x2)
        export SKIP_D2=1
        export BENCH_ARGS="${BENCH_ARGS:---trace p2p_ce_push_peer_n2,p2p_ce_push_peer_n2_ring4}"
        exec bash bench/run-overlap.sh ;;
    *) echo "scripts/gpu.sh: no task '$task'" >&2; usage >&2; exit 2 ;;
esac
mkdir -p "$OUT"
# The session tasks only start others, which set up their own environment.
case "$task" in
    all | session | x2 | every-gpu) ;;
    *) source scripts/gpu-env.sh ;;
esac
"task_${task//-/_}" "$@"
