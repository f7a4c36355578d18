#!/usr/bin/env bash
# The build on a host without CUDA or NCCL: in a private mount namespace, an empty directory is
# mounted over every directory that holds libcudart or libnccl (the CUDA toolkit, ldconfig's
# entries for them), so the dynamic loader finds neither. There:
#   - flatshardd starts (host memory) and serves `flatshardctl status`, also with simulated GPUs;
#   - a client integration test (C++) and `import flatshard` + a host-memory summon (Python) pass,
#     libflatshard_client.so loads;
#   - the NCCL backend, without libnccl or with FLATSHARD_NCCL_LIBRARY naming another library,
#     fails with FAILED_PRECONDITION naming NCCL;
#   - `flatshardd --gpus 0` fails at start naming the CUDA runtime and every place it looked,
#     and FLATSHARD_CUDA_LIBRARY shows among them.
# Needs root (unshare -m, mount); skipped (77) where that is not permitted.
#
#   cuda_hidden_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
SRC=$1
BUILD=$2
fail() { echo "FAIL: $*"; exit 1; }

# Inside the namespace: this script again with --inside.
if [ "${3:-}" != --inside ]; then
  command -v unshare >/dev/null || { echo "SKIP: no unshare"; exit 77; }
  unshare -m true 2>/dev/null || { echo "SKIP: unshare -m is not permitted here"; exit 77; }
  exec unshare -m bash "$0" "$SRC" "$BUILD" --inside
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-nocuda.XXXXXX")
PIDS=()
SEG_PREFIX="fsnocuda$$"
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -f /dev/shm/"$SEG_PREFIX"* 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
mount --make-rprivate / 2>/dev/null || true

mkdir "$TMP/empty"
dirs=()
for d in /usr/local/cuda /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib; do
  [ -d "$d" ] && dirs+=("$(readlink -f "$d")")
done
while read -r lib; do
  dirs+=("$(dirname "$(readlink -f "$lib")")")
done < <(ldconfig -p | awk '/lib(cudart|nccl|cuda)\.so/ {print $NF}')
for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do
  [ -d "$d" ] && mount --bind "$TMP/empty" "$d"
done
if /usr/bin/python3 -c 'import ctypes; ctypes.CDLL("libcudart.so.13")' 2>/dev/null; then
  fail "libcudart.so.13 still loads after hiding ${dirs[*]}"
fi
echo "ok: hidden: $(printf '%s\n' "${dirs[@]}" | sort -u | tr '\n' ' ')"

D="$BUILD/server/flatshardd"
CTL="$BUILD/client/flatshardctl"
start_daemon() {  # start_daemon NAME ARGS...: the daemon's socket is $TMP/NAME.sock
  local name=$1; shift
  "$D" --ephemeral --socket "$TMP/$name.sock" --segment_prefix "$SEG_PREFIX$name" "$@" > "$TMP/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 200); do
    [ -S "$TMP/$name.sock" ] && return 0
    kill -0 "${PIDS[-1]}" 2>/dev/null || fail "flatshardd $* exited: $(tail -5 "$TMP/$name.log")"
    sleep 0.1
  done
  fail "flatshardd $* made no socket in 20 s: $(tail -5 "$TMP/$name.log")"
}

# 1. The daemon, the CLI, simulated GPUs.
start_daemon host
"$CTL" status --socket "$TMP/host.sock" > "$TMP/status.txt" 2>&1 || fail "flatshardctl status: $(cat "$TMP/status.txt")"
start_daemon sim --simulate_gpus 2
"$CTL" status --socket "$TMP/sim.sock" > "$TMP/sim_status.txt" 2>&1 || fail "flatshardctl status (simulated GPUs): $(cat "$TMP/sim_status.txt")"
echo "ok: flatshardd (host memory, simulated GPUs) serves flatshardctl status"

# 2. --gpus without libcudart: a clear error at start.
rc=0
FLATSHARD_CUDA_LIBRARY=/nonexistent/libcudart.so timeout 60 "$D" --socket "$TMP/gpu.sock" --gpus 0 > "$TMP/gpu.log" 2>&1 || rc=$?
[ $rc -ne 0 ] || fail "flatshardd --gpus 0 started without libcudart"
[ $rc -ne 124 ] || fail "flatshardd --gpus 0 hung without libcudart"
for want in "the CUDA runtime (libcudart.so." "not found; tried:" "FLATSHARD_CUDA_LIBRARY=/nonexistent/libcudart.so" \
            "the dynamic loader's search path" "/usr/local/cuda/lib64"; do
  grep -qF "$want" "$TMP/gpu.log" || fail "flatshardd --gpus 0 said no '$want': $(tail -3 "$TMP/gpu.log")"
done
echo "ok: flatshardd --gpus 0: $(grep -o 'no usable GPU: the CUDA runtime[^;]*' "$TMP/gpu.log" | head -1)"

# 3. A C++ client integration test (host memory, its own daemon).
"$BUILD/tests/integration/client_e2e_test" --gtest_brief=1 \
  --gtest_filter='*TiedFqnsAliasOneView*:*WithGradsAfterReduceScatter*' > "$TMP/e2e.log" 2>&1 \
  || fail "client_e2e_test: $(tail -20 "$TMP/e2e.log")"
grep -qE 'PASSED  \] [1-9]' "$TMP/e2e.log" || fail "client_e2e_test ran nothing: $(tail -5 "$TMP/e2e.log")"
echo "ok: client_e2e_test: $(grep -E 'PASSED  \]' "$TMP/e2e.log")"

# 4. libnccl missing, or not NCCL: the backend says so (skips where libnccl loads).
nogpu="$BUILD/tests/server/collective/collective_nccl_backend_nogpu_test"
if [ -x "$nogpu" ]; then
  for lib in "" /lib/x86_64-linux-gnu/libz.so.1; do
    FLATSHARD_NCCL_LIBRARY=$lib "$nogpu" --gtest_filter='*WithoutLibnccl*' > "$TMP/nccl.log" 2>&1 \
      || fail "NCCL backend without libnccl (FLATSHARD_NCCL_LIBRARY=$lib): $(tail -20 "$TMP/nccl.log")"
    grep -q 'PASSED  \] 1 test' "$TMP/nccl.log" || fail "the no-libnccl test did not run: $(tail -5 "$TMP/nccl.log")"
  done
  echo "ok: without libnccl (missing, or FLATSHARD_NCCL_LIBRARY not NCCL) the NCCL backend fails naming it"
fi

# 5. The client library loads (dlopen, as a trainer's process would).
/usr/bin/python3 -c "import ctypes; ctypes.CDLL('$BUILD/client/libflatshard_client.so')" \
  || fail "libflatshard_client.so does not load without CUDA"
echo "ok: libflatshard_client.so loads"

# 6. Python: import flatshard, a host-memory summon against a real daemon.
if [ -d "$BUILD/python/flatshard" ]; then
  (cd "$SRC/tests/python" && PYTHONPATH="$BUILD/python" FLATSHARD_DAEMON="$D" FS_SOURCE_DIR="$SRC" \
     PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m pytest -q -p no:cacheprovider \
     "test_client.py::test_single_rank_roundtrip" > "$TMP/py.log" 2>&1) \
    || fail "python summon without CUDA: $(tail -20 "$TMP/py.log")"
  echo "ok: python: $(tail -1 "$TMP/py.log")"
fi
echo PASS
