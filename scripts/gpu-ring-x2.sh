#!/usr/bin/env bash
# Issue 13's open rows on two GPUs of one process (binaries from scripts/stage-gpu.sh):
#   1. the peer-failure test alone in its own process; if it is still running after 45 s,
#      every thread's stack (gdb or eu-stack where installed, else the kernel's wait
#      channels) goes to peer-failure-stacks.txt before it is killed;
#   2. the other CUDA-graph tests (replayed == eager, the ring on two compute streams too);
#   3. GEMM+RS at 16384x8192x2048 with 2 and 4 row ranges per block, the ring's GEMMs on one
#      and on two compute streams, and the GEMM alone in the same row pieces; RUNS times
#      (default 3), to see the spread between runs.
# For scripts/gpu-session.sh: bash scripts/gpu-session.sh gpu-ring-x2
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
export FUSION_BACKEND=cuda RUST_BACKTRACE=1
BIN=.gpu/bin
STEP_PATTERN='test result|rror|GEMM\+RS'
source scripts/gpu-lib.sh
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/machine.txt" 2>&1

name=a_rank_failing_while_its_peer_replays_ends_the_run_without_a_hang
start=$SECONDS
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
