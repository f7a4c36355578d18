#!/usr/bin/env bash
# CUDA and NCCL are opened at run time (common/gpu/cuda_runtime_library.h,
# server/collective/nccl/nccl_library.h), never linked: flatshardd, flatshardctl,
# libflatshard_client.so and the Python extension need no libcudart/libcuda/libnccl (NEEDED),
# have no RUNPATH into a CUDA install, and export no cuda*/nccl* symbol (ours are hidden, so
# they never interpose on the libcudart that torch loads into the same process) nor import one.
#
#   no_cuda_link_test.sh BUILD_DIR
set -euo pipefail
BUILD=$1
command -v readelf >/dev/null && command -v nm >/dev/null || { echo "SKIP: binutils missing"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

files=("$BUILD/server/flatshardd" "$BUILD/client/flatshardctl" "$BUILD/client/libflatshard_client.so")
ext=$(find "$BUILD/python/flatshard" -maxdepth 1 -name '_C*.so' 2>/dev/null | head -1)
[ -n "$ext" ] && files+=("$ext")
for f in "${files[@]}"; do
  [ -e "$f" ] || fail "$f is not built"
  dyn=$(readelf -d "$f")
  needed=$(grep -E '\(NEEDED\)' <<< "$dyn" | grep -oE '\[[^]]+\]' | tr -d '[]' || true)
  bad=$(grep -E '^lib(cudart|cuda|nccl)\.' <<< "$needed" || true)
  [ -z "$bad" ] || fail "$f needs $(tr '\n' ' ' <<< "$bad")"
  runpath=$(grep -E '\((RUNPATH|RPATH)\)' <<< "$dyn" || true)
  grep -qi cuda <<< "$runpath" && fail "$f has a RUNPATH into CUDA: $runpath"
  exported=$(nm -D --defined-only "$f" | awk '{print $NF}' | grep -E '^(cuda|nccl)[A-Z]' || true)
  [ -z "$exported" ] || fail "$f exports $(head -3 <<< "$exported" | tr '\n' ' ')"
  imported=$(nm -D --undefined-only "$f" | awk '{print $NF}' | grep -E '^(cuda|nccl)[A-Z]' || true)
  [ -z "$imported" ] || fail "$f imports $(head -3 <<< "$imported" | tr '\n' ' ')"
  echo "ok: $(basename "$f"): no CUDA or NCCL in NEEDED, RUNPATH or dynamic symbols"
done
# With CUDA support built in, the entry points are there, only hidden (the check above would
# pass trivially for a build without CUDA).
if grep -q 'FS_HAVE_CUDA 1' "$BUILD/generated/common/config.h" 2>/dev/null; then
  nm "$BUILD/server/flatshardd" > "${TMPDIR:-/tmp}/fs_nm.$$"
  grep -qE ' t cudaMalloc$' "${TMPDIR:-/tmp}/fs_nm.$$" && rm -f "${TMPDIR:-/tmp}/fs_nm.$$" \
    || fail "flatshardd (built with CUDA) has no local cudaMalloc forwarder"
fi
echo PASS
