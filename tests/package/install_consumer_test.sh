#!/usr/bin/env bash
# `cmake --install` of the current build into a temp prefix, then a trainer built outside the
# source tree against that prefix runs against the installed daemon.
#
#   install_consumer_test.sh SOURCE_DIR BUILD_DIR cmake|pkgconfig
#
# Both modes check the installed tree: the files (binaries, public headers only, the shared
# library and its links, the static archive, CMake package, flatshard.pc, systemd unit with the
# prefix's paths, env file, tmpfiles/sysusers, man pages), that no installed text names the
# source or build tree, and that libflatshard_client.so exports only the client API.
#   cmake:     tests/package/consumer/ with CMAKE_PREFIX_PATH=<prefix>: find_package(flatshard 0.1)
#              (and 99 refused); flatshard::client is the shared library, or the static one with
#              FLATSHARD_USE_STATIC_LIBS=ON; it raises the consumer's C++14 to C++17; one compile
#              linked shared and static.
#   pkgconfig: the same source with `pkg-config flatshard` (shared, and --static with the archive).
# Each binary then runs as 2 ranks against <prefix>/bin/flatshardd on a temp socket. The build
# tree is only read (never built). Exit 77 (skipped) without a C++ compiler or pkg-config.
set -euo pipefail
SRC=$1
BUILD=$2
MODE=$3
case "$MODE" in cmake|pkgconfig) ;; *) echo "usage: $0 SRC BUILD cmake|pkgconfig"; exit 2 ;; esac
CXX=${CXX:-c++}
command -v "$CXX" >/dev/null || { echo "SKIP: no C++ compiler"; exit 77; }
[ "$MODE" = cmake ] || command -v pkg-config >/dev/null || { echo "SKIP: no pkg-config"; exit 77; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-install-test.XXXXXX")
DAEMON_PID=""
SEG_PREFIX="fsinst$$"
cleanup() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -9 "$DAEMON_PID" 2>/dev/null || true
    wait "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -f /dev/shm/"$SEG_PREFIX"* 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

VERSION=$(sed -n 's/^project(flatshard VERSION \([0-9.]*\).*/\1/p' "$SRC/CMakeLists.txt")
P="$TMP/prefix"
cmake --install "$BUILD" --prefix "$P" > "$TMP/install.log" 2>&1 \
  || fail "cmake --install: $(tail -5 "$TMP/install.log")"
LIBDIR=$(cd "$P" && dirname "$(find . -name 'libflatshard_client.so' | head -1)")
LIBDIR=${LIBDIR#./}
[ -n "$LIBDIR" ] && [ -d "$P/$LIBDIR" ] || fail "no libflatshard_client.so installed"

# The installed tree.
for f in bin/flatshardd bin/flatshardctl; do [ -x "$P/$f" ] || fail "no executable $f"; done
for f in include/flatshard/client.h include/flatshard/dtype.h include/flatshard/plan.h \
         include/flatshard/version.h \
         "$LIBDIR/libflatshard_client.a" "$LIBDIR/libflatshard_client.so.$VERSION" \
         "$LIBDIR/cmake/flatshard/flatshardConfig.cmake" "$LIBDIR/cmake/flatshard/flatshardConfigVersion.cmake" \
         "$LIBDIR/cmake/flatshard/flatshardTargets.cmake" "$LIBDIR/pkgconfig/flatshard.pc" \
         lib/systemd/system/flatshard.service etc/flatshard/flatshardd.env \
         lib/tmpfiles.d/flatshard.conf lib/sysusers.d/flatshard.conf \
         share/man/man8/flatshardd.8 share/man/man1/flatshardctl.1; do
  [ -f "$P/$f" ] || fail "no $f in the prefix"
done
[ "$(readlink "$P/$LIBDIR/libflatshard_client.so")" = "libflatshard_client.so.${VERSION%%.*}" ] \
  || fail "libflatshard_client.so -> $(readlink "$P/$LIBDIR/libflatshard_client.so"), not the soname link"
[ "$(readlink "$P/$LIBDIR/libflatshard_client.so.${VERSION%%.*}")" = "libflatshard_client.so.$VERSION" ] \
  || fail "the soname link is wrong"
soname=$(objdump -p "$P/$LIBDIR/libflatshard_client.so.$VERSION" | awk '$1 == "SONAME" {print $2}')
[ "$soname" = "libflatshard_client.so.${VERSION%%.*}" ] || fail "SONAME is '$soname'"
headers=$(cd "$P/include" && find . -type f | sed 's|^\./||' | LC_ALL=C sort | tr '\n' ' ')
[ "$headers" = "flatshard/client.h flatshard/dtype.h flatshard/plan.h flatshard/version.h " ] \
  || fail "installed headers are '$headers', want only the public four"
bad_include=$(grep -h '^#include "' "$P"/include/flatshard/*.h | grep -v -E '^#include "(flatshard|absl)/' || true)
[ -z "$bad_include" ] || fail "a public header includes something not installed: $bad_include"
grep -q "^#define FLATSHARD_VERSION_STRING \"$VERSION\"" "$P/include/flatshard/version.h" \
  || fail "version.h does not say $VERSION"
leak=$(grep -rIl -e "$SRC" -e "$BUILD" "$P" || true)
[ -z "$leak" ] || fail "installed files name the source or build tree: $leak"
unit="$P/lib/systemd/system/flatshard.service"
grep -qxF "ExecStart=$P/bin/flatshardd --socket=/run/flatshard/flatshardd.sock --state_dir=/var/lib/flatshard/state \$FLATSHARDD_ARGS" "$unit" \
  || fail "the unit's ExecStart is not the prefix's: $(grep ExecStart= "$unit")"
grep -qxF "EnvironmentFile=-$P/etc/flatshard/flatshardd.env" "$unit" \
  || fail "the unit's EnvironmentFile is not the prefix's: $(grep EnvironmentFile= "$unit")"
grep -qx 'User=flatshard' "$unit" || fail "the unit does not run as flatshard"
grep -q '^FLATSHARDD_ARGS=' "$P/etc/flatshard/flatshardd.env" || fail "the env file sets no FLATSHARDD_ARGS"
[ "$("$P/bin/flatshardctl" --version)" = "flatshardctl $VERSION" ] || fail "flatshardctl --version: $("$P/bin/flatshardctl" --version)"

# Only the client API leaves the shared library.
exported=$(nm -D --defined-only -C "$P/$LIBDIR/libflatshard_client.so.$VERSION" | awk '$2 != "A"' | cut -d' ' -f3-)
n_api=$(grep -c -E '^(flatshard::client::|(typeinfo|typeinfo name|vtable) for flatshard::client::|flatshard::(DTypeName|ParseDType|ItemSize|IsFloatingPoint)\()' <<< "$exported" || true)
others=$(grep -v -E '^(flatshard::client::|(typeinfo|typeinfo name|vtable) for flatshard::client::|flatshard::(DTypeName|ParseDType|ItemSize|IsFloatingPoint)\()' <<< "$exported" || true)
[ -z "$others" ] || fail "libflatshard_client.so exports more than the client API: $(head -5 <<< "$others")"
grep -q '^flatshard::client::Client::Connect(' <<< "$exported" || fail "Client::Connect is not exported"
grep -q '^flatshard::client::LibraryVersion()' <<< "$exported" || fail "LibraryVersion is not exported"
ldd_out=$(env LD_LIBRARY_PATH= ldd "$P/$LIBDIR/libflatshard_client.so.$VERSION")
! grep -q 'not found' <<< "$ldd_out" || fail "libflatshard_client.so: $(grep 'not found' <<< "$ldd_out")"
echo "ok: installed tree ($n_api exported symbols, all client API)"

# The consumer, outside the source tree.
cp -r "$SRC/tests/package/consumer" "$TMP/consumer"
cd "$TMP"
BINS=()
if [ "$MODE" = cmake ]; then
  cmake -S consumer -B cb -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$P" > cb.log 2>&1 \
    || fail "consumer configure: $(tail -15 cb.log)"
  grep -q "consumer: flatshard $VERSION from $P/$LIBDIR/cmake/flatshard" cb.log \
    || fail "the consumer found another flatshard: $(grep 'consumer:' cb.log)"
  grep -q "consumer: flatshard::client is flatshard::client_shared" cb.log \
    || fail "flatshard::client is not the shared library by default: $(grep 'client is' cb.log)"
  cmake -S consumer -B cb_static -DCMAKE_PREFIX_PATH="$P" -DFLATSHARD_USE_STATIC_LIBS=ON > cbs.log 2>&1 \
    || fail "consumer configure with FLATSHARD_USE_STATIC_LIBS: $(tail -15 cbs.log)"
  grep -q "consumer: flatshard::client is flatshard::client_static" cbs.log \
    || fail "FLATSHARD_USE_STATIC_LIBS=ON: $(grep 'client is' cbs.log)"
  cmake --build cb -j2 > cbb.log 2>&1 || fail "consumer build: $(tail -20 cbb.log)"
  # Without flatshard::client's cxx_std_17 CMake would pass -std=gnu++14 and the headers fail.
  ! grep -q -- '-std=[a-z+]*14' cb/CMakeFiles/consumer_obj.dir/flags.make \
    || fail "the consumer compiled as C++14: flatshard::client did not require C++17"
  BINS=(cb/consumer_shared cb/consumer_static)
else
  export PKG_CONFIG_PATH="$P/$LIBDIR/pkgconfig"
  [ "$(pkg-config --modversion flatshard)" = "$VERSION" ] || fail "pkg-config --modversion: $(pkg-config --modversion flatshard)"
  pkg-config --atleast-version=99 flatshard && fail "pkg-config accepts flatshard >= 99"
  cflags=$(pkg-config --cflags flatshard) || fail "pkg-config --cflags flatshard"
  libs=$(pkg-config --libs flatshard) || fail "pkg-config --libs flatshard"
  static_libs=$(pkg-config --static --libs flatshard) || fail "pkg-config --static --libs flatshard"
  libdir=$(pkg-config --variable=libdir flatshard)
  [ "$libdir" = "$P/$LIBDIR" ] || fail "pkg-config's libdir is $libdir"
  # shellcheck disable=SC2086
  "$CXX" -std=c++17 -O1 -c consumer/consumer.cc $cflags -o consumer.o 2> cc.log || fail "compile: $(head -20 cc.log)"
  # shellcheck disable=SC2086
  "$CXX" consumer.o $libs -Wl,-rpath,"$libdir" -o consumer_pc_shared 2> ld.log || fail "link: $(head -20 ld.log)"
  # shellcheck disable=SC2086
  "$CXX" consumer.o ${static_libs//-lflatshard_client/-l:libflatshard_client.a} -o consumer_pc_static 2> lds.log \
    || fail "static link: $(head -20 lds.log)"
  BINS=(./consumer_pc_shared ./consumer_pc_static)
fi
shared_bin=${BINS[0]}
static_bin=${BINS[1]}
lib_used=$(env LD_LIBRARY_PATH= ldd "$shared_bin" | awk '$1 ~ /^libflatshard_client\.so/ {print $3}')
[ "$(readlink -f "$lib_used")" = "$(readlink -f "$P/$LIBDIR/libflatshard_client.so.$VERSION")" ] \
  || fail "$shared_bin takes libflatshard_client from '$lib_used', not the prefix"
static_ldd=$(env LD_LIBRARY_PATH= ldd "$static_bin")
! grep -q libflatshard_client <<< "$static_ldd" || fail "$static_bin links libflatshard_client.so"
echo "ok: consumer built with $MODE (shared and static)"

# The installed daemon; each binary as a 2-rank job.
SOCK="$TMP/d.sock"
"$P/bin/flatshardd" --ephemeral --socket "$SOCK" --segment_prefix "$SEG_PREFIX" > "$TMP/d.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 1 100); do
  [ -S "$SOCK" ] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "daemon exited: $(tail -5 "$TMP/d.log")"
  sleep 0.1
done
[ -S "$SOCK" ] || fail "the installed daemon made no socket in 10 s: $(tail -5 "$TMP/d.log")"
for bin in "${BINS[@]}"; do
  name=$(basename "$bin")
  pids=()
  for r in 0 1; do
    timeout 120 "$bin" --address "unix:$SOCK" --group "$name" --world_size 2 --rank $r > "$TMP/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do
    wait "${pids[$r]}" || fail "$name rank $r: $(cat "$TMP/$name.$r.log"); daemon: $(tail -5 "$TMP/d.log")"
    grep -q "^consumer rank $r/2 OK: flatshard $VERSION" "$TMP/$name.$r.log" || fail "$name rank $r: $(cat "$TMP/$name.$r.log")"
  done
  echo "ok: $name ran 2 ranks against the installed daemon: $(grep "^consumer rank 0" "$TMP/$name.0.log")"
done
"$P/bin/flatshardctl" status --socket "$SOCK" > "$TMP/status.txt" 2>&1 || fail "flatshardctl status: $(cat "$TMP/status.txt")"
kill -TERM "$DAEMON_PID"
rc=0; wait "$DAEMON_PID" || rc=$?
DAEMON_PID=""
[ $rc -eq 0 ] || fail "the daemon exited $rc after SIGTERM: $(tail -5 "$TMP/d.log")"
left=$(ls /dev/shm | grep "^$SEG_PREFIX" || true)
[ -z "$left" ] || fail "segments left behind: $left"
echo "PASS"
