#!/usr/bin/env bash
# scripts/package.sh on the current build: unpack the tarball in a temp dir, then check that
# (a) the bundled binaries resolve gRPC/protobuf/abseil/UCX (and every non-host library) from the
#     bundle's lib/ via their RPATH, with LD_LIBRARY_PATH empty, and nothing is "not found";
# (b) bin/flatshardd --help and bin/flatshardctl --help run from the bundle;
# (c) a daemon started from the bundle on a temp socket serves the bundle's `flatshardctl status`;
# (d) MANIFEST.sha256 matches the files and lists every file.
# Usage: package_test.sh SOURCE_DIR BUILD_DIR. Exit 77 (skipped) without patchelf.
set -euo pipefail
SRC=$1
BUILD=$2
command -v patchelf >/dev/null || { echo "SKIP: patchelf missing (bash scripts/setup.sh)"; exit 77; }
for b in server/flatshardd client/flatshardctl examples/trainer/flatshard_example_trainer; do
  [ -x "$BUILD/$b" ] || { echo "FAIL: $BUILD/$b not built"; exit 1; }   # the test never builds
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-package-test.XXXXXX")
DAEMON_PID=""
cleanup() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill "$DAEMON_PID" 2>/dev/null || true
    wait "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

TARBALL=$(bash "$SRC/scripts/package.sh" --build-dir "$BUILD" --out "$TMP/out/flatshard.tar.gz" | tail -n 1)
[ "$TARBALL" = "$TMP/out/flatshard.tar.gz" ] || fail "package.sh printed '$TARBALL'"
[ -s "$TARBALL" ] || fail "no tarball"
mkdir "$TMP/x"
tar -C "$TMP/x" -xzf "$TARBALL"
set -- "$TMP"/x/flatshard-*-*
[ $# -eq 1 ] && [ -d "$1" ] || fail "tarball does not hold one flatshard-<version>-<arch>/ dir"
PKG=$1
for d in bin lib include/flatshard deploy/systemd deploy/k8s; do [ -d "$PKG/$d" ] || fail "no $d/"; done
for f in README.txt MANIFEST.sha256 include/flatshard/client.h lib/libflatshard_client.a \
         deploy/systemd/flatshardd.service; do
  [ -f "$PKG/$f" ] || fail "no $f"
done

# (a) What may come from the system (see scripts/package.sh); everything else from $PKG/lib.
host_ok='^(linux-vdso|ld-linux|libc\.|libm\.|libmvec|libpthread|libdl\.|librt\.|libresolv|libutil|libanl|libnsl|libstdc\+\+|libgcc_s|libcuda|libcudart|libnccl|libnvidia-|libibverbs|libmlx[45]|librdmacm|libefa|libnl-3|libnl-route-3)'
elfs=("$PKG"/bin/* "$PKG"/lib/*.so* "$PKG"/lib/ucx/*.so*)
checked=0
for elf in "${elfs[@]}"; do
  [ -e "$elf" ] || continue
  case "$elf" in "$PKG"/lib/*) ;; *) [ "$(patchelf --print-rpath "$elf")" = '$ORIGIN/../lib' ] \
      || fail "$elf: RPATH is '$(patchelf --print-rpath "$elf")'" ;; esac
  out=$(cd / && env LD_LIBRARY_PATH= ldd "$elf") || fail "ldd $elf: $out"
  while IFS= read -r line; do
    line=${line#"${line%%[![:space:]]*}"}
    name=${line%% *}; name=${name##*/}
    [ -n "$name" ] || continue
    case "$line" in *"not found"*) fail "$elf: $name not found" ;; esac
    [[ "$name" =~ $host_ok ]] && continue
    case "$line" in *"=> "/*) ;; *) continue ;; esac
    path=${line#*=> }; path=${path%% (*}
    case "$(readlink -f "$path")" in
      "$PKG"/lib/*) ;;
      *) [[ "$elf" == "$PKG"/bin/* ]] && fail "$(basename "$elf"): $name from $path, not from the bundle" ;;
    esac
    # A bundled library alone (no executable RPATH) may resolve a sibling from the system;
    # the process resolves it via the executable's RPATH, which the bin/ checks cover.
  done <<< "$out"
  checked=$((checked + 1))
done
ldd_d=$(env LD_LIBRARY_PATH= ldd "$PKG/bin/flatshardd")
for want in 'libgrpc++.so' 'libprotobuf.so' 'libabsl_base.so' 'libucp.so' 'libucs.so'; do
  path=$(awk -v w="$want" 'index($1, w) == 1 && $2 == "=>" {print $3}' <<< "$ldd_d")
  if [ -z "$path" ]; then
    case "$want" in libuc*) continue ;; esac   # a build with FLATSHARD_WITH_UCX=OFF
    fail "flatshardd needs no $want"
  fi
  case "$(readlink -f "$path")" in "$PKG"/lib/*) ;; *) fail "flatshardd takes $want from $path" ;; esac
done
echo "ok (a): $checked ELF files resolve from the bundle or the host set"

# (b) Run from a directory outside the build, with no library path.
cd "$TMP"
# A loader failure would be 127 and print no usage.
rc=0; env LD_LIBRARY_PATH= "$PKG/bin/flatshardd" --help > "$TMP/d.help" 2>&1 || rc=$?
[ $rc -eq 0 ] || fail "flatshardd --help exited $rc: $(tail -3 "$TMP/d.help")"
grep -q 'Usage: flatshardd.*--socket' "$TMP/d.help" || fail "flatshardd --help printed no usage: $(head -3 "$TMP/d.help")"
env LD_LIBRARY_PATH= "$PKG/bin/flatshardctl" --help > "$TMP/c.help" 2>&1 || fail "flatshardctl --help: $(tail -3 "$TMP/c.help")"
grep -q 'status' "$TMP/c.help" || fail "flatshardctl --help lists no status"
echo "ok (b): --help from the bundle"

# (c) Daemon from the bundle on a temp socket; status from the bundle's CLI.
SOCK="$TMP/d.sock"
env LD_LIBRARY_PATH= "$PKG/bin/flatshardd" --ephemeral --socket "$SOCK" --segment_prefix "fspkgtest$$" \
  > "$TMP/d.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 1 100); do
  [ -S "$SOCK" ] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "daemon exited: $(tail -5 "$TMP/d.log")"
  sleep 0.1
done
[ -S "$SOCK" ] || fail "daemon made no socket in 10 s: $(tail -5 "$TMP/d.log")"
status=""
for _ in $(seq 1 20); do
  status=$(env LD_LIBRARY_PATH= "$PKG/bin/flatshardctl" status --socket "$SOCK" 2>&1) && break
  status="ERR $status"; sleep 0.2
done
case "$status" in ERR*) fail "flatshardctl status: $status" ;; esac
[ -n "$status" ] || fail "flatshardctl status printed nothing"
# The running daemon mapped gRPC and abseil from the bundle, not from /usr/lib.
for want in 'libgrpc++.so' 'libabsl_base.so'; do
  mapped=$(awk -v w="/$want" 'index($6, w) {print $6; exit}' "/proc/$DAEMON_PID/maps")
  case "$(readlink -f "${mapped:-/none}")" in "$PKG"/lib/*) ;; *) fail "daemon mapped $want from '${mapped}'" ;; esac
done
kill "$DAEMON_PID"
wait "$DAEMON_PID" 2>/dev/null || true
DAEMON_PID=""
echo "ok (c): bundled daemon served bundled flatshardctl status:"
echo "$status" | head -5 | sed 's/^/    /'

# (d) Checksums, and the manifest lists every file but itself.
(cd "$PKG" && sha256sum --quiet -c MANIFEST.sha256) || fail "manifest checksums differ"
listed=$(awk '{print $2}' "$PKG/MANIFEST.sha256" | LC_ALL=C sort)
actual=$(cd "$PKG" && find . -type f ! -name MANIFEST.sha256 | sed 's|^\./||' | LC_ALL=C sort)
[ "$listed" = "$actual" ] || fail "manifest does not list exactly the files: $(diff <(echo "$listed") <(echo "$actual") | head -5)"
echo "ok (d): $(echo "$listed" | wc -l) files match MANIFEST.sha256"
echo "PASS"
