# Sourced by the GPU scripts. `step NAME TIMEOUT COMMAND...` runs COMMAND under a time
# limit with its output in $OUT/NAME.log, and adds a line to the `summary` array: the exit
# status, the seconds it took and the last log line matching $STEP_PATTERN.
STEP_PATTERN=${STEP_PATTERN:-'test result|FAILED|rror|check:'}
summary=()
step() {
    local name=$1 t=$2; shift 2
    local start=$SECONDS
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-30s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E "$STEP_PATTERN" "$OUT/$name.log" | tail -1 | cut -c1-90)")")
}
