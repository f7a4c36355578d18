#!/usr/bin/env bash
# Bundles a build's GPU test suite for a GPU host that has none of our Debian packages (only a
# driver, the CUDA runtime and NCCL, e.g. from a PyTorch installation), so `ctest -L gpu` and
# the GPU benchmark run there unchanged:
#
#   scripts/gpu_bundle.sh [--build-dir build] [--out .gpu-bundle]
#   # copy the checkout with .gpu-bundle/ to the GPU host, then in the checkout's root there:
#   bash .gpu-bundle/run.sh [ctest arguments]     # default: -L gpu -E python
#
# What goes in OUT: build/ with the daemon, the CLI, every GPU test binary and the GPU
# benchmark at their build-relative paths plus every CTest file (gtest-discovered test lists
# included), and lib/ with the shared libraries they need (ldd, recursively) and UCX's
# transport modules, and the CUDA runtime the build compiled against (opened at run time, found
# through run.sh's LD_LIBRARY_PATH), except what must come from the host: glibc,
# libstdc++/libgcc_s, libcuda and NCCL (run.sh finds NCCL in Python's nvidia-nccl wheel or
# /usr/local/cuda; both are opened at run time, so FLATSHARD_CUDA_LIBRARY and
# FLATSHARD_NCCL_LIBRARY may also name them).
#
# The CTest files name absolute paths of this checkout (tests find flatshardd through the build
# directory compiled into them), so run.sh links this checkout's path on the GPU host to where
# the bundle is, and build/ to OUT/build: run it as root, or where that path can be created.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${FS_BUILD_DIR:-build}
OUT=.gpu-bundle
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_bundle: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
die() { echo "gpu_bundle: $*" >&2; exit 1; }
[ -f "$BUILD_DIR/CTestTestfile.cmake" ] || die "$BUILD_DIR is not a configured build (run scripts/build.sh)"

# The binaries of the tests labelled gpu, the daemon and the CLI.
mapfile -t BINARIES < <(
  ctest --test-dir "$BUILD_DIR" -L gpu --show-only=json-v1 |
    /usr/bin/python3 -c 'import json,sys; print("\n".join(sorted({t["command"][0] for t in json.load(sys.stdin)["tests"] if t.get("command")})))' |
    grep "^$BUILD_DIR/" || true)
BINARIES+=("$BUILD_DIR/server/flatshardd" "$BUILD_DIR/client/flatshardctl")
[ ${#BINARIES[@]} -gt 2 ] || die "no GPU tests in $BUILD_DIR (was it built with CUDA?)"

rm -rf "$OUT"
mkdir -p "$OUT/build" "$OUT/lib/ucx"
for b in "${BINARIES[@]}"; do
  [ -x "$b" ] || die "missing $b (build first)"
  rel=${b#"$BUILD_DIR"/}
  mkdir -p "$OUT/build/$(dirname "$rel")"
  cp "$b" "$OUT/build/$rel"
  strip --strip-unneeded "$OUT/build/$rel" 2>/dev/null || true
done
(cd "$BUILD_DIR" && find . \( -name CTestTestfile.cmake -o -name '*_include.cmake' \
   -o -name '*_tests.cmake' \) -exec cp --parents {} "$OUT/build/" \;)

host_provided() {
  case "$1" in
    linux-vdso.so*|ld-linux*|libc.so.*|libm.so.*|libmvec.so.*|libpthread.so.*|libdl.so.*|\
    librt.so.*|libresolv.so.*|libutil.so.*|libstdc++.so.*|libgcc_s.so.*|libcuda.so.*|\
    libnccl.so.*|libnvidia-*) return 0 ;;
  esac
  return 1
}
for b in "${BINARIES[@]}"; do ldd "$b"; done | awk '/=>/ && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    host_provided "$name" || cp -L "$path" "$OUT/lib/$name"
  done
# libcudart is opened at run time (dlopen by soname), so ldd does not show it: bundle the one
# this build compiled against, as before (the GPU host's driver must support it). NCCL stays the
# host's.
cudart=$(sed -n 's/^CUDA_CUDART:FILEPATH=//p' "$BUILD_DIR/CMakeCache.txt")
if [ -e "$cudart" ]; then
  soname=$(readelf -d "$cudart" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  cp -L "$cudart" "$OUT/lib/${soname:-$(basename "$cudart")}"
fi
UCX_MODULES=$(dirname "$(ldconfig -p | awk '/libucs.so.0 / {print $NF; exit}')")/ucx
[ -d "$UCX_MODULES" ] && cp -L "$UCX_MODULES"/libuct_cma.so.0 "$OUT/lib/ucx/" 2>/dev/null || true

cat > "$OUT/run.sh" <<EOF
#!/usr/bin/env bash
# Runs the bundled GPU suite from the checkout's root (see scripts/gpu_bundle.sh).
set -uo pipefail
here=\$(pwd)
bundle=\$(cd "\$(dirname "\$0")" && pwd)
if [ "\$here" != "$ROOT" ] && [ ! -e "$ROOT" ]; then
  mkdir -p "$(dirname "$ROOT")" && ln -s "\$here" "$ROOT"
fi
[ -e "$BUILD_DIR" ] || ln -s "\$bundle/build" "$BUILD_DIR"
nccl=\$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="\$bundle/lib:\${nccl:+\$nccl:}/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-}"
[ \$# -gt 0 ] || set -- -L gpu -E python
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 300 "\$@"
EOF
chmod +x "$OUT/run.sh"
echo "gpu_bundle: $(du -sh "$OUT" | cut -f1) in $OUT (${#BINARIES[@]} binaries, $(ls "$OUT/lib" | wc -l) libraries); on the GPU host: bash ${OUT#"$ROOT"/}/run.sh"
