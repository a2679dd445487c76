#!/usr/bin/env bash
# Issue 25's one-GPU checks in one device call (binaries from scripts/stage-gpu.sh):
#   1. scripts/gpu-shared-ranks.sh five times in a row (two ranks sharing the GPU: the
#      copy-engine pipelines against the CPU backend, the runtime's GPU unit tests,
#      host_costs --share-gpus);
#   2. the fault suite (tests/faults.rs) on the GPU with FUSION_TIMEOUT=10: a rank that never
#      sends, a rank that panics in the middle of a pipeline, a launched process killed
#      (SIGKILL) or frozen (SIGSTOP) in the middle of a call; on one GPU the ranks share it;
#   3. torchrun --nproc-per-node 2 on the GPUs (more processes than GPUs on a one-GPU
#      machine): must exit non-zero within 10 s naming the visible GPU count and the fix;
#      and again with CUDA_VISIBLE_DEVICES=0 for both (found from the GPU UUIDs at the
#      rendezvous);
#   4. scripts/gpu-check.sh from a copy of the repository at another path.
# Logs under $OUT (each script's in a folder of its own); a table last.
# Usage: scripts/gpu-faults.sh
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
BIN=$ROOT/.gpu/bin
source scripts/gpu-lib.sh
table=()
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $gpus" >"$OUT/machine.txt"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader >>"$OUT/machine.txt" 2>&1

# 1. Ranks sharing the GPU, five times; a run passes when every step of it ended with rc=0.
for i in 1 2 3 4 5; do
    start=$SECONDS
    OUT="$OUT/shared-ranks-$i" bash scripts/gpu-shared-ranks.sh >"$OUT/shared-ranks-$i.txt" 2>&1
    steps=$(grep -cE '^[a-z_-]+-?[0-9]* +rc=' "$OUT/shared-ranks-$i.txt")
    failed=$(grep -E '^[a-z_-]+-?[0-9]* +rc=' "$OUT/shared-ranks-$i.txt" | grep -vc 'rc=0 ')
    table+=("$(printf '%-34s %s  %3ss  %s steps, %s failed' "gpu-shared-ranks-$i" \
        "$([ "$failed" = 0 ] && [ "$steps" -gt 0 ] && echo PASS || echo FAIL)" \
        "$((SECONDS - start))" "$steps" "$failed")")
    # Five in a row is the check: after a failed run the others would only spend time.
    if [ "$failed" != 0 ] || [ "$steps" = 0 ]; then
        table+=("gpu-shared-ranks: stopped after run $i failed")
        break
    fi
done

# 2. The fault suite on the GPU (FUSION_TIMEOUT=10: every error within 15 s).
start=$SECONDS
FUSION_BACKEND=cuda FUSION_TIMEOUT=10 RUST_BACKTRACE=0 timeout 300 \
    $BIN/test-faults --test-threads=1 --nocapture >"$OUT/faults.log" 2>&1
rc=$?
table+=("$(printf '%-34s %s  %3ss  %s' faults "$([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc")" \
    "$((SECONDS - start))" "$(grep -E 'test result' "$OUT/faults.log" | tail -1 | cut -c1-70)")")

# 3. More processes than GPUs under torchrun: an error within 10 s that names the count and
#    the fix, on every rank.
torchrun_check() {
    local name=$1 needle=$2; shift 2
    local t0=$(date +%s.%N)
    timeout 60 env "$@" torchrun --nproc-per-node $((gpus + 1)) --no-python $BIN/ag_matmul \
        >"$OUT/$name.log" 2>&1
    local rc=$? t1=$(date +%s.%N)
    local secs=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
    local named=$(grep -c "$needle" "$OUT/$name.log")
    local ok=FAIL
    if [ $rc != 0 ] && [ $rc != 124 ] && python3 -c "import sys; sys.exit(0 if $secs <= 10 else 1)" \
        && [ "$named" -ge 1 ]; then ok=PASS; fi
    table+=("$(printf '%-34s %s  %5ss  rc=%s, %s lines name it' "$name" $ok "$secs" $rc "$named")")
}
torchrun_check torchrun-more-processes-than-gpus "GPU.* visible.*--nproc-per-node $gpus" FUSION_TIMEOUT=30
if [ "$gpus" = 1 ]; then
    torchrun_check torchrun-two-processes-one-gpu "both use GPU GPU-" FUSION_TIMEOUT=30 CUDA_VISIBLE_DEVICES=0
fi

# 4. gpu-check.sh from a copy of the repository at another path than the build's.
COPY=$(mktemp -d /tmp/fusion-elsewhere-XXXXXX)/repo
mkdir -p "$COPY"
cp -r scripts tests "$COPY/" && mkdir -p "$COPY/.gpu" && cp .gpu/bin.tar.xz "$COPY/.gpu/"
start=$SECONDS
(cd "$COPY" && OUT="$OUT/gpu-check" bash scripts/gpu-check.sh >"$OUT/gpu-check.txt" 2>&1)
steps=$(grep -cE ' rc=' "$OUT/gpu-check.txt")
failed=$(grep -E ' rc=' "$OUT/gpu-check.txt" | grep -vc 'rc=0 ')
table+=("$(printf '%-34s %s  %3ss  %s steps, %s failed (from %s)' gpu-check-elsewhere \
    "$([ "$failed" = 0 ] && [ "$steps" -gt 0 ] && echo PASS || echo FAIL)" \
    "$((SECONDS - start))" "$steps" "$failed" "$COPY")")
rm -rf "$(dirname "$COPY")"

echo "--- fault suite"
grep -hE '^(never sends|panic:|KILL:|STOP:)|test .* \.\.\. |FAIL' "$OUT/faults.log" | cut -c1-300
echo "--- torchrun"
grep -h "error" "$OUT"/torchrun-*.log | sort | uniq -c | cut -c1-400
echo "--- host_costs --share-gpus (run 1)"
cat "$OUT/shared-ranks-1/host-costs-shared.log" 2>/dev/null | head -30
echo "--- steps of the shared-rank runs that failed"
grep -hE ' rc=' "$OUT"/shared-ranks-*.txt | grep -v 'rc=0 ' || echo none
echo "--- steps of gpu-check that failed"
grep -hE ' rc=' "$OUT/gpu-check.txt" | grep -v 'rc=0 ' || echo none
printf '%s\n' "${table[@]}"
