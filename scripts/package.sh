#!/usr/bin/env bash
# Packages a flatshard build for a GPU host that has CUDA (driver, maybe NCCL) but none of our
# Debian packages: flatshard-<version>-<arch>/{bin,lib,include,deploy,README.txt,MANIFEST.sha256}
# in a .tar.gz.
#
#   scripts/package.sh [--build-dir DIR] [--out FILE.tar.gz] [--bundle-libstdcxx]
#
# The build dir defaults to ${FS_BUILD_DIR:-build}; if it lacks one of the three binaries,
# scripts/build.sh builds it (FS_BUILD_DIR=DIR). Nothing else is built.
#
# lib/ holds every shared library the binaries need (ldd, recursively), plus UCX's transport
# modules (lib/ucx/, dlopened by libucs, invisible to ldd), except what must come from the host:
#   glibc      linux-vdso, ld-linux, libc, libm, libpthread, libdl, librt, libresolv, libutil,
#              libanl, libnsl, libmvec: a process has one glibc, the host's, and it must be at
#              least Debian 12's (2.36), which the binaries were linked against.
#   toolchain  libstdc++, libgcc_s: the host's must be GCC 12's or newer (GLIBCXX_3.4.30);
#              --bundle-libstdcxx bundles Debian's instead, for an older host.
#   GPU stack  libcuda, libcudart, libnccl, libnvidia-*: the driver (libcuda, libnvidia-*) must
#              match the host's kernel module, and NCCL/cudart come from the host's CUDA
#              installation. None is linked: flatshard opens libcudart and libnccl at run time
#              (only for --gpus) through LD_LIBRARY_PATH, ldconfig or /usr/local/cuda/lib64, or
#              $FLATSHARD_CUDA_LIBRARY / $FLATSHARD_NCCL_LIBRARY; without them, host memory.
#   RDMA stack libibverbs, libmlx4/5, librdmacm, libefa, libnl-3: tied to the host's NICs and their
#              provider plugins; without them UCX skips its ib/rdmacm modules (tcp, shared
#              memory and cma still work).
#
# The binaries get DT_RPATH=$ORIGIN/../lib with patchelf (not wrapper scripts: a wrapper that
# sets LD_LIBRARY_PATH leaks it into every child process, is bypassed by anything that execs
# the binary's real path, and wraps systemd's and Kubernetes' view of the process). DT_RPATH
# rather than DT_RUNPATH because the executable's DT_RPATH is also searched for the libraries'
# own dependencies and for dlopen, so the bundled Debian libraries stay byte-for-byte unmodified.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${FS_BUILD_DIR:-build}
OUT=""
BUNDLE_LIBSTDCXX=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --build-dir=*) BUILD_DIR=${1#*=}; shift ;;
    --out) OUT=$2; shift 2 ;;
    --out=*) OUT=${1#*=}; shift ;;
    --bundle-libstdcxx) BUNDLE_LIBSTDCXX=1; shift ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "package: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac

die() { echo "package: $*" >&2; exit 1; }
command -v patchelf >/dev/null || die "patchelf is missing (bash scripts/setup.sh installs it)"
command -v ldd >/dev/null || die "ldd is missing"

BINARIES=(server/flatshardd client/flatshardctl examples/trainer/flatshard_example_trainer)
need_build=0
for b in "${BINARIES[@]}"; do [ -x "$BUILD_DIR/$b" ] || need_build=1; done
if [ $need_build -eq 1 ]; then
  echo "package: $BUILD_DIR lacks the binaries; running scripts/build.sh" >&2
  FS_BUILD_DIR="$BUILD_DIR" bash "$ROOT/scripts/build.sh"
  for b in "${BINARIES[@]}"; do [ -x "$BUILD_DIR/$b" ] || die "build produced no $BUILD_DIR/$b"; done
fi

VERSION=$(sed -n 's/^project(flatshard VERSION \([0-9.]*\).*/\1/p' "$ROOT/CMakeLists.txt")
[ -n "$VERSION" ] || die "no version in CMakeLists.txt's project()"
ARCH=$(uname -m)
NAME="flatshard-$VERSION-$ARCH"
[ -n "$OUT" ] || OUT="$BUILD_DIR/$NAME.tar.gz"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-package.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
PKG="$STAGE/$NAME"
mkdir -p "$PKG"/{bin,lib/ucx,include,deploy}

# Sonames the host provides (see the header).
host_provided() {
  case "$1" in
    linux-vdso.so*|linux-gate.so*|ld-linux*.so*|libc.so.*|libm.so.*|libmvec.so.*|libpthread.so.*|\
    libdl.so.*|librt.so.*|libresolv.so.*|libutil.so.*|libanl.so.*|libnsl.so.*|libBrokenLocale.so.*)
      return 0 ;;
    libstdc++.so.*|libgcc_s.so.*) [ $BUNDLE_LIBSTDCXX -eq 0 ] ;;
    libcuda.so*|libcudart.so*|libnccl.so*|libnvidia-*) return 0 ;;
    libibverbs.so*|libmlx4.so*|libmlx5.so*|librdmacm.so*|libefa.so*|libnl-3.so*|libnl-route-3.so*) return 0 ;;
    *) return 1 ;;
  esac
}

# ldd lists the whole dependency tree; run it on every ELF we ship (the UCX modules add theirs).
declare -A BUNDLED=()
UCX_MODULES=""
collect_deps() {
  local elf=$1 line soname path
  while IFS= read -r line; do
    line=${line#"${line%%[![:space:]]*}"}
    soname=${line%% *}
    soname=${soname##*/}
    [ -n "$soname" ] || continue
    host_provided "$soname" && continue
    case "$line" in
      *"=> not found"*) die "$elf needs $soname, which ldd cannot find here" ;;
      *"=> "/*) path=${line#*=> }; path=${path%% (*} ;;
      *) continue ;;   # statically linked / no path (vdso variants)
    esac
    [ -n "${BUNDLED[$soname]:-}" ] && continue
    [ -n "$UCX_MODULES" ] && [ -e "$UCX_MODULES/$soname" ] && continue   # lib/ucx/ has it
    BUNDLED[$soname]=$path
    cp -L "$path" "$PKG/lib/$soname"
    chmod 0644 "$PKG/lib/$soname"
  done < <(LD_LIBRARY_PATH= ldd "$elf")
}

for b in "${BINARIES[@]}"; do
  cp -L "$BUILD_DIR/$b" "$PKG/bin/"
  collect_deps "$BUILD_DIR/$b"
done

# UCX looks for its transport modules in <dir of libucs>/ucx: ship them next to the bundled libucs.
if [ -n "${BUNDLED[libucs.so.0]:-}" ]; then
  UCX_MODULES=$(dirname "$(readlink -f "${BUNDLED[libucs.so.0]}")")/ucx
  for m in "$UCX_MODULES"/libuct_*.so.0 "$UCX_MODULES"/libucm_*.so.0 "$UCX_MODULES"/libucx_*.so.0; do
    [ -e "$m" ] || continue
    cp -L "$m" "$PKG/lib/ucx/"
    chmod 0644 "$PKG/lib/ucx/$(basename "$m")"
    collect_deps "$m"
  done
fi
rmdir "$PKG/lib/ucx" 2>/dev/null || true

# A bundled library with its own RUNPATH would not see the executable's RPATH: point it at lib/.
for l in "$PKG"/lib/*.so* "$PKG"/lib/ucx/*.so*; do
  [ -e "$l" ] || continue
  if [ -n "$(patchelf --print-rpath "$l")" ]; then
    case "$l" in */ucx/*) patchelf --set-rpath '$ORIGIN:$ORIGIN/..' "$l" ;; *) patchelf --set-rpath '$ORIGIN' "$l" ;; esac
  fi
done
for b in "$PKG"/bin/*; do
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$b"
  chmod 0755 "$b"
done

# The client library as `cmake --install` lays it out (cmake/FlatshardInstall.cmake): public
# headers, libflatshard_client.so.* and the one-archive libflatshard_client.a, the CMake package
# (relocatable) and flatshard.pc, made relative to its own location here.
for component in dev runtime; do
  cmake --install "$BUILD_DIR" --prefix "$PKG" --component "$component" > /dev/null \
    || die "cmake --install --component $component failed"
done
[ -f "$PKG/include/flatshard/client.h" ] && [ -f "$PKG/lib/libflatshard_client.a" ] \
  || die "cmake --install put no client library in include/ and lib/"
sed -i 's|^prefix=.*|prefix=${pcfiledir}/../..|' "$PKG/lib/pkgconfig/flatshard.pc"
cp -r "$ROOT/deploy/." "$PKG/deploy/"

cat > "$PKG/README.txt" <<EOF
flatshard $VERSION ($ARCH), built on $(. /etc/os-release && echo "$PRETTY_NAME") from
git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown).

bin/      flatshardd, flatshardctl, flatshard_example_trainer (RPATH \$ORIGIN/../lib)
lib/      their shared libraries (gRPC, protobuf, abseil, UCX with lib/ucx/ modules, OpenSSL, ...)
          and the client library (libflatshard_client.so and .a; lib/cmake/flatshard for
          find_package(flatshard) with CMAKE_PREFIX_PATH=<this dir>, lib/pkgconfig/flatshard.pc;
          building against it needs abseil's, gRPC's and protobuf's development files)
include/  flatshard/client.h, dtype.h, version.h
deploy/   systemd unit, Kubernetes manifests, Dockerfile (they name /usr/local/bin paths:
          copy bin/ and lib/ together, e.g. to /opt/$NAME, and adjust)

The host provides: glibc >= 2.36 (Debian 12's), libstdc++/libgcc_s from GCC >= 12$(
  [ $BUNDLE_LIBSTDCXX -eq 1 ] && echo ' (bundled here)'),
for --gpus the NVIDIA driver (libcuda, libnvidia-*), CUDA runtime and NCCL (libcudart, libnccl;
opened at run time, never linked: without them flatshardd serves host memory) and, for
InfiniBand/RoCE, rdma-core (libibverbs, libmlx5, librdmacm, libnl-3). flatshardd finds CUDA/NCCL
through ldconfig, /usr/local/cuda/lib64, FLATSHARD_CUDA_LIBRARY / FLATSHARD_NCCL_LIBRARY (file
paths), or:
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
(bundled libraries still win: the binaries' DT_RPATH is searched before LD_LIBRARY_PATH).
Check: ldd bin/flatshardd   (nothing "not found"; gRPC/abseil/UCX from this lib/)
MANIFEST.sha256: sha256sum -c MANIFEST.sha256
EOF

(cd "$PKG" && find . -type f ! -name MANIFEST.sha256 | sed 's|^\./||' | LC_ALL=C sort \
  | xargs -d '\n' sha256sum > MANIFEST.sha256)

mkdir -p "$(dirname "$OUT")"
tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -czf "$OUT.tmp" "$NAME"
mv "$OUT.tmp" "$OUT"
echo "package: $(wc -l < "$PKG/MANIFEST.sha256") files, ${#BUNDLED[@]} shared libraries bundled" >&2
echo "$OUT"
