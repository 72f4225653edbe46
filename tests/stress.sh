#!/usr/bin/env bash
# Run the test suite RUNS times with BURNERS busy-looping processes beside it, and print how
# many runs passed. Bounded: each run is stopped after RUN_LIMIT seconds; the burners are
# stopped (by their process ids) when the script ends, however it ends.
#
#   tests/stress.sh [RUNS] [BURNERS] [pytest args...]
#   RUNS=10 BURNERS=2: tests/stress.sh 10 2
#
# Environment: PYTHON (default .venv/bin/python), RUN_LIMIT (default 1200 s per run),
# KVROUTE_TEST_TIMEOUT_SCALE (passed through to the tests). Logs go to stress-out/.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-10}
burners=${2:-0}
shift $(( $# < 2 ? $# : 2 ))
python=${PYTHON:-.venv/bin/python}
limit=${RUN_LIMIT:-1200}
out=stress-out
mkdir -p "$out"

burner_pids=()
run_pid=""
stop_all() {
    [ -n "$run_pid" ] && kill "$run_pid" 2>/dev/null
    for pid in "${burner_pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${burner_pids[@]}" $run_pid; do wait "$pid" 2>/dev/null; done
    burner_pids=()
    run_pid=""
}
trap stop_all EXIT
trap 'stop_all; echo "stress: interrupted"; exit 130' INT TERM

for _ in $(seq 1 "$burners"); do
    "$python" -c 'while True: pass' &
    burner_pids+=("$!")
done

passed=0
failed=0
for i in $(seq 1 "$runs"); do
    log="$out/run-$i.log"
    start=$(date +%s)
    # In the background and waited for, so that Ctrl-C or TERM stops the run at once.
    timeout --kill-after=30 "$limit" "$python" -m pytest -q -p no:cacheprovider "$@" \
        >"$log" 2>&1 &
    run_pid=$!
    wait "$run_pid"
    status=$?
    run_pid=""
    took=$(( $(date +%s) - start ))
    if [ "$status" -eq 0 ]; then
        passed=$((passed + 1))
        echo "run $i/$runs: passed in ${took}s ($(tail -n 1 "$log"))"
    else
        failed=$((failed + 1))
        echo "run $i/$runs: FAILED (exit $status) in ${took}s, log $log"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    fi
done
stop_all
echo "stress: $runs runs with $burners burners"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
