#!/usr/bin/env bash
# README command 1: installs what is missing, builds, and runs the main job.
#
#   scripts/run_demo.sh [--ranks N] [--no-build] [--build-dir DIR]
#
# 1. Plans the example GPT (tied embeddings, examples/models/gpt_tied.*) for 4 ranks and prints
#    the `flatshardctl plan` table.
# 2. Starts a local flatshardd (host memory, no GPU) on a socket in a fresh temporary directory,
#    with its own shared-memory segment prefix.
# 3. Runs examples/trainer (flatshard_example_trainer) as N processes (default 3), one per rank:
#    register, summon, edit and write back (rank0_only), reduce-scatter gradients, check
#    everything. Prints rank 0's steps and every rank's verdict.
# 4. Stops the daemon with SIGTERM and checks that it exited 0 and left no socket and no
#    /dev/shm segments.
# Exit status 0 only when all of that passed.
#
# --no-build skips setup.sh and build.sh and uses the binaries in --build-dir (default
# ${FS_BUILD_DIR:-build}); CTest's example_trainer_smoke runs it that way.
set -euo pipefail
cd "$(dirname "$0")/.."

RANKS=3
BUILD=1
BUILD_DIR=${FS_BUILD_DIR:-build}
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS=${2:?--ranks needs a number}; shift ;;
    --no-build) BUILD=0 ;;
    --build-dir) BUILD_DIR=${2:?--build-dir needs a directory}; shift ;;
    *) echo "usage: $0 [--ranks N] [--no-build] [--build-dir DIR]" >&2; exit 2 ;;
  esac
  shift
done
case "$RANKS" in ''|*[!0-9]*|0) echo "run_demo: --ranks wants a positive number" >&2; exit 2 ;; esac

if [ $BUILD -eq 1 ]; then
  bash scripts/setup.sh
  FS_BUILD_DIR=$BUILD_DIR bash scripts/build.sh > /dev/null
fi
CTL=$BUILD_DIR/client/flatshardctl
DAEMON=$BUILD_DIR/server/flatshardd
TRAINER=$BUILD_DIR/examples/trainer/flatshard_example_trainer
for bin in "$CTL" "$DAEMON" "$TRAINER"; do
  [ -x "$bin" ] || { echo "run_demo: $bin is missing (build first)" >&2; exit 1; }
done

MODEL=examples/models/gpt_tied
M=$MODEL.manifest.json
P=$MODEL.policy.json
echo "\$ flatshardctl plan --manifest $M --policy $P --world-size 4 --format table"
"$CTL" plan --manifest "$M" --policy "$P" --world-size 4 --format table
echo

# A private run directory, socket and segment prefix: several demos (or CTest runs) can run at
# once, and whatever happens, nothing of this run is left behind.
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-demo.XXXXXX")
SOCKET=$RUN_DIR/flatshardd.sock
PREFIX=fsdemo$$$(basename "$RUN_DIR" | tr -dc 'A-Za-z0-9' | tail -c 6)
TOKEN=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
DAEMON_PID=
cleanup() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -KILL "$DAEMON_PID" 2>/dev/null || true
    wait "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -f /dev/shm/"$PREFIX".* 2>/dev/null || true
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT

echo "\$ flatshardd --socket $SOCKET --segment_prefix $PREFIX &"
"$DAEMON" --socket="$SOCKET" --segment_prefix="$PREFIX" 2> "$RUN_DIR/flatshardd.log" &
DAEMON_PID=$!
for _ in $(seq 200); do
  [ -S "$SOCKET" ] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || break
  sleep 0.1
done
if [ ! -S "$SOCKET" ]; then
  echo "run_demo: flatshardd did not come up; its log:" >&2
  cat "$RUN_DIR/flatshardd.log" >&2
  exit 1
fi

echo "\$ flatshard_example_trainer --address unix:$SOCKET --world_size $RANKS --rank R" \
     "--model $MODEL   (R = 0..$((RANKS - 1)), concurrently)"
start_ns=$(date +%s%N)
PIDS=()
for ((r = 0; r < RANKS; r++)); do
  "$TRAINER" --address="unix:$SOCKET" --group=demo --world_size="$RANKS" --rank="$r" \
    --token="$TOKEN" --model="$MODEL" > "$RUN_DIR/rank$r.out" 2> "$RUN_DIR/rank$r.err" &
  PIDS+=($!)
done
FAILED=0
RCS=()
for ((r = 0; r < RANKS; r++)); do
  rc=0
  wait "${PIDS[$r]}" || rc=$?
  RCS+=("$rc")
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
done
elapsed_ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))

# Rank 0's steps in full; of the other ranks, their verdicts (or everything, when they failed).
cat "$RUN_DIR/rank0.out"
for ((r = 0; r < RANKS; r++)); do
  if [ "${RCS[$r]}" -ne 0 ]; then
    [ "$r" -eq 0 ] || cat "$RUN_DIR/rank$r.out"
    echo "run_demo: rank $r exited ${RCS[$r]}"
    if [ -s "$RUN_DIR/rank$r.err" ]; then
      echo "run_demo: rank $r's stderr (last 20 lines):"
      tail -n 20 "$RUN_DIR/rank$r.err"
    fi
  elif [ "$r" -ne 0 ]; then
    tail -n 1 "$RUN_DIR/rank$r.out"
  fi
done

echo "\$ kill -TERM flatshardd"
kill -TERM "$DAEMON_PID"
# Bash reaps its background jobs as they end and keeps their status for `wait`.
DAEMON_RC=timeout
for _ in $(seq 300); do
  if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
    DAEMON_RC=0
    wait "$DAEMON_PID" || DAEMON_RC=$?
    DAEMON_PID=
    break
  fi
  sleep 0.1
done
LEFT=$(find /dev/shm -maxdepth 1 -name "$PREFIX.*" 2>/dev/null | wc -l)
PROBLEMS=()
[ "$FAILED" -eq 0 ] || PROBLEMS+=("$FAILED of $RANKS ranks failed")
if [ "$DAEMON_RC" = timeout ]; then
  PROBLEMS+=("flatshardd did not exit within 30 s of SIGTERM")
elif [ "$DAEMON_RC" -ne 0 ]; then
  PROBLEMS+=("flatshardd exited $DAEMON_RC")
fi
[ "$LEFT" -eq 0 ] || PROBLEMS+=("$LEFT shared-memory segments left in /dev/shm")
[ ! -e "$SOCKET" ] || PROBLEMS+=("the socket was left behind")

if [ ${#PROBLEMS[@]} -ne 0 ]; then
  echo "run_demo: FAILED: $(IFS=';'; echo "${PROBLEMS[*]}" | sed 's/;/; /g')"
  echo "run_demo: flatshardd's log (last 30 lines):"
  tail -n 30 "$RUN_DIR/flatshardd.log"
  exit 1
fi
echo "demo: PASS: $RANKS ranks passed every check in ${elapsed_ms} ms;" \
     "flatshardd exited 0 and left no segments or socket"
