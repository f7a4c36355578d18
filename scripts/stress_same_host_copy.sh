#!/usr/bin/env bash
# Stress harness for issue 27 (the same-host copy's stall): runs one gtest case (by default the
# daemon chaos case that stalled) in several parallel loops under load, each run under a
# watchdog. A run that outlives the watchdog is a stall: both daemons' stacks (gdb, every
# thread) and their logs are kept, then the run is killed and the loop goes on.
#
#   scripts/stress_same_host_copy.sh [--copy on|off|default] [--runs N] [--loops L]
#       [--watchdog SECONDS] [--build DIR] [--out DIR] [--filter GTEST_FILTER]
#       [--test BINARY] [--daemon BINARY] [-- EXTRA_DAEMON_FLAGS...]
#
# --copy on|off adds --ucx_same_host_copy=true|false to every daemon (a wrapper named by
# FS_TEST_FLATSHARDD); default leaves the daemon's own default. --daemon runs another build
# of flatshardd (default: the build's; copy it away to rebuild while a stress run goes on). Flags after `--` go to every
# daemon too (e.g. -- --v=2); UCX_LOG_LEVEL and the like pass through the environment.
# Prints one line per run and a summary ("runs N pass P fail F stall S", skipped runs apart:
# the case skips while the build's flatshardd is being relinked); exits 1 if any run failed
# or stalled. Output under --out (default /tmp/fs_stress.<pid>): run logs of failed
# runs, stall.<loop>.<run>/ with gdb.<pid>.txt, daemon.<pid>.log and fifo.<pid>.txt (its UCX
# shared-memory receive queues, scripts/stress_ucx_fifo.py) per daemon.
set -u
here=$(cd "$(dirname "$0")" && pwd)

copy=default
runs=20
loops=2
watchdog=40
build=build
out=""
filter='Daemons/DaemonChaosTest.KillOneOfTwoDaemonsInsideCommitNeverMixesGenerations/TwoDaemons'
test_bin=""
daemon=""
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --copy) copy="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --loops) loops="$2"; shift 2 ;;
    --watchdog) watchdog="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --filter) filter="$2"; shift 2 ;;
    --test) test_bin="$2"; shift 2 ;;
    --daemon) daemon="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
build=$(cd "$build" && pwd) || exit 2
[[ -n "$test_bin" ]] || test_bin="$build/tests/chaos/daemon_chaos_test"
[[ -n "$out" ]] || out="/tmp/fs_stress.$$"
mkdir -p "$out"
out=$(cd "$out" && pwd)
[[ -n "$daemon" ]] || daemon="$build/server/flatshardd"
[[ -x "$test_bin" && -x "$daemon" ]] || { echo "build $test_bin and $daemon first" >&2; exit 2; }

flags=()
case "$copy" in
  on) flags+=(--ucx_same_host_copy=true) ;;
  off) flags+=(--ucx_same_host_copy=false) ;;
  default) ;;
  *) echo "--copy on|off|default" >&2; exit 2 ;;
esac
flags+=("${extra[@]}")
wrapper="$out/flatshardd"
{
  echo '#!/usr/bin/env bash'
  printf 'exec %q "$@"' "$daemon"
  for f in "${flags[@]}"; do printf ' %q' "$f"; done
  echo
} > "$wrapper"
chmod +x "$wrapper"
echo "stress: $runs runs in $loops loops, watchdog ${watchdog}s, daemon flags: ${flags[*]:-(none)}," \
  "out $out; load: $(cut -d' ' -f1-3 /proc/loadavg)"

# Dumps every flatshardd of session `sid` (stacks, logs) into directory $2.
dump_session() {
  local sid=$1 dir=$2
  mkdir -p "$dir"
  ps -eo pid=,sid=,comm=,args= > "$dir/ps.txt"
  local pid
  for pid in $(ps -eo pid=,sid=,comm= | awk -v s="$sid" '$2 == s && $3 == "flatshardd" {print $1}'); do
    local log
    log=$(readlink "/proc/$pid/fd/2" 2>/dev/null)
    [[ -f "$log" ]] && cp "$log" "$dir/daemon.$pid.log"
    # Its UCX shared-memory receive queues: a slot claimed by a killed sender, never published?
    python3 "$here/stress_ucx_fifo.py" "$pid" > "$dir/fifo.$pid.txt" 2>&1
    timeout 60 gdb -batch -p "$pid" -ex 'thread apply all bt' > "$dir/gdb.$pid.txt" 2>&1
  done
}

# One loop: runs its share of the runs one after another; appends "pass|fail|stall" lines.
loop() {
  local l=$1 n=$2 i
  for ((i = 0; i < n; i++)); do
    local log="$out/run.$l.$i.log" start=$SECONDS
    FS_TEST_FLATSHARDD="$wrapper" setsid "$test_bin" --gtest_filter="$filter" > "$log" 2>&1 &
    local pid=$! result=""
    local sid
    sid=$(ps -o sid= -p "$pid" | tr -d ' ')
    while kill -0 "$pid" 2>/dev/null; do
      if (( SECONDS - start >= watchdog )); then
        result=stall
        dump_session "${sid:-$pid}" "$out/stall.$l.$i"
        cp "$log" "$out/stall.$l.$i/test.log"
        kill -KILL -- "-${sid:-$pid}" 2>/dev/null
        break
      fi
      sleep 1
    done
    wait "$pid"
    local rc=$?
    if [[ -z "$result" ]]; then
      if [[ $rc -eq 0 ]] && grep -q '^\[  PASSED  \] 1 test' "$log"; then
        result=pass
      elif grep -q '^\[  SKIPPED \]' "$log"; then
        result=skip  # e.g. the build's flatshardd was being relinked: not a run
      else
        result=fail
      fi
    fi
    [[ $result == pass || $result == skip ]] && rm -f "$log"
    echo "loop $l run $i: $result ($((SECONDS - start)) s, load $(cut -d' ' -f1 /proc/loadavg))" |
      tee -a "$out/results.txt"
  done
}

per=$(( (runs + loops - 1) / loops ))
for ((l = 0; l < loops; l++)); do loop "$l" "$per" & done
wait
pass=$(grep -c ': pass' "$out/results.txt")
fail=$(grep -c ': fail' "$out/results.txt")
stall=$(grep -c ': stall' "$out/results.txt")
skip=$(grep -c ': skip' "$out/results.txt")
echo "stress summary: runs $((pass + fail + stall)) pass $pass fail $fail stall $stall" \
  "(skipped $skip; out $out)"
[[ $fail -eq 0 && $stall -eq 0 ]]
