#!/usr/bin/env bash
# scripts/make_deb.sh on the current build, then:
# (a) the packages' control data: names, version, Depends (dpkg-shlibdeps' libraries; adduser;
#     the -dev package on exactly this version of the runtime library), conffiles, shlibs and
#     the ldconfig trigger, maintainer scripts that parse and do what they must;
# (b) their files: each where Debian 12 wants it, each in one package, nothing under /usr/local,
#     nothing of the build or source tree, the unit pointing at /usr/bin/flatshardd; ELF files
#     stripped with their symbols in the -dbgsym packages by build-id; no lintian error (when
#     lintian is installed); flatshard's postrm purge removes /run/flatshard and
#     /var/lib/flatshard (in a mount namespace, when permitted);
# (c) all of them unpacked into a scratch root (dpkg-deb -x, no maintainer scripts run): the
#     unpacked flatshardd serves the unpacked flatshardctl, and a trainer built with CMake
#     against the unpacked libflatshard-dev (relocated: find_package from the scratch root)
#     runs 2 ranks against it.
# A real `dpkg -i` on this machine is system_install_test.sh (label system-install).
#
#   deb_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
SRC=$1
BUILD=$2
for tool in dpkg-deb dpkg-shlibdeps; do
  command -v $tool >/dev/null || { echo "SKIP: $tool missing (apt-get install dpkg-dev)"; exit 77; }
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-deb-test.XXXXXX")
DAEMON_PID=""
SEG_PREFIX="fsdeb$$"
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
SOV=${VERSION%%.*}
ARCH=$(dpkg --print-architecture)
bash "$SRC/scripts/make_deb.sh" --build-dir "$BUILD" --out-dir "$TMP/debs" > "$TMP/debs.txt" 2> "$TMP/make_deb.log" \
  || fail "make_deb.sh: $(tail -5 "$TMP/make_deb.log")"
declare -A DEB=()
while IFS= read -r deb; do
  [ -f "$deb" ] || fail "make_deb.sh printed '$deb', which is no file"
  DEB[$(dpkg-deb -f "$deb" Package)]=$deb
done < "$TMP/debs.txt"
for pkg in flatshard "libflatshard-client$SOV" libflatshard-dev flatshard-dbgsym "libflatshard-client$SOV-dbgsym"; do
  [ -n "${DEB[$pkg]:-}" ] || fail "no $pkg package (got: ${!DEB[*]})"
  [ "$(basename "${DEB[$pkg]}")" = "${pkg}_${VERSION}-1_${ARCH}.deb" ] || fail "$pkg is named $(basename "${DEB[$pkg]}")"
done

# (a) Control data.
field() { dpkg-deb -f "${DEB[$1]}" "$2"; }
for pkg in "${!DEB[@]}"; do
  [ "$(field "$pkg" Version)" = "$VERSION-1" ] || fail "$pkg: Version $(field "$pkg" Version)"
  [ "$(field "$pkg" Architecture)" = "$ARCH" ] || fail "$pkg: Architecture $(field "$pkg" Architecture)"
  [ -n "$(field "$pkg" Description)" ] || fail "$pkg: no Description"
  [ "$(field "$pkg" Installed-Size)" -gt 0 ] || fail "$pkg: no Installed-Size"
done
dep=$(field flatshard Depends)
for want in adduser libc6 'libgrpc++1' libprotobuf libstdc++6; do
  grep -q "$want" <<< "$dep" || fail "flatshard's Depends lacks $want: $dep"
done
grep -q libflatshard-client <<< "$dep" && fail "flatshard depends on the client library: $dep"
# CUDA and NCCL are loaded at run time: no package depends on them (nor could: none is Debian's).
for pkg in "${!DEB[@]}"; do
  grep -qiE 'cuda|nccl' <<< "$(field "$pkg" Depends)" && fail "$pkg depends on CUDA: $(field "$pkg" Depends)"
done
for pkg in flatshard "libflatshard-client$SOV"; do
  [ "$(field "$pkg-dbgsym" Depends)" = "$pkg (= $VERSION-1)" ] || fail "$pkg-dbgsym: Depends $(field "$pkg-dbgsym" Depends)"
  [ "$(field "$pkg-dbgsym" Section)" = debug ] || fail "$pkg-dbgsym: Section $(field "$pkg-dbgsym" Section)"
  [ -n "$(field "$pkg-dbgsym" Build-Ids)" ] || fail "$pkg-dbgsym has no Build-Ids"
done
dep=$(field "libflatshard-client$SOV" Depends)
grep -q 'libgrpc++1' <<< "$dep" || fail "libflatshard-client$SOV's Depends lacks gRPC: $dep"
dep=$(field libflatshard-dev Depends)
for want in "libflatshard-client$SOV (= $VERSION-1)" libabsl-dev 'libgrpc++-dev' libprotobuf-dev; do
  grep -qF "$want" <<< "$dep" || fail "libflatshard-dev's Depends lacks '$want': $dep"
done
mkdir "$TMP/ctl"
for pkg in "${!DEB[@]}"; do dpkg-deb -e "${DEB[$pkg]}" "$TMP/ctl/$pkg"; done
[ "$(cat "$TMP/ctl/flatshard/conffiles")" = /etc/flatshard/flatshardd.env ] \
  || fail "flatshard's conffiles: $(cat "$TMP/ctl/flatshard/conffiles")"
grep -qx "libflatshard_client $SOV libflatshard-client$SOV (>= $VERSION)" "$TMP/ctl/libflatshard-client$SOV/shlibs" \
  || fail "shlibs: $(cat "$TMP/ctl/libflatshard-client$SOV/shlibs" 2>&1)"
grep -qx 'activate-noawait ldconfig' "$TMP/ctl/libflatshard-client$SOV/triggers" || fail "no ldconfig trigger"
for s in postinst prerm postrm; do
  f="$TMP/ctl/flatshard/$s"
  [ -x "$f" ] || fail "flatshard has no executable $s"
  sh -n "$f" || fail "flatshard's $s does not parse"
done
grep -q 'adduser --system --group' "$TMP/ctl/flatshard/postinst" || fail "postinst makes no system user"
grep -q "systemd-tmpfiles --create flatshard.conf" "$TMP/ctl/flatshard/postinst" || fail "postinst runs no tmpfiles"
grep -q "deb-systemd-helper enable 'flatshard.service'" "$TMP/ctl/flatshard/postinst" || fail "postinst enables no unit"
grep -q "deb-systemd-invoke stop 'flatshard.service'" "$TMP/ctl/flatshard/prerm" || fail "prerm stops no unit"
if [ -n "${DEB[python3-flatshard]:-}" ]; then
  grep -q 'py3clean -p python3-flatshard' "$TMP/ctl/python3-flatshard/prerm" || fail "python3-flatshard's prerm runs no py3clean"
fi
(cd "$TMP/ctl" && for pkg in *; do [ -s "$pkg/md5sums" ] || fail "$pkg: no md5sums"; done)
# flatshard's purge path (postrm purge; the real dpkg --purge is system_install_test.sh): in a
# private mount namespace with empty /run and /var/lib, it removes the runtime and state
# directories with their contents.
if unshare -m true 2>/dev/null; then
  unshare -m sh -c '
    mount -t tmpfs none /run && mount -t tmpfs none /var/lib || exit 2
    mkdir -p /run/flatshard /var/lib/flatshard/state && touch /run/flatshard/flatshardd.sock /var/lib/flatshard/state/x
    "$1" purge || exit 3
    [ ! -e /run/flatshard ] && [ ! -e /var/lib/flatshard ] || exit 4' sh "$TMP/ctl/flatshard/postrm" \
    || fail "flatshard's postrm purge (exit $?) leaves /run/flatshard or /var/lib/flatshard"
  echo "ok (a): postrm purge removes /run/flatshard and /var/lib/flatshard"
else
  echo "note (a): unshare -m not permitted; postrm purge not run"
fi
echo "ok (a): control data of ${!DEB[*]}"

# (b) Files.
for pkg in "${!DEB[@]}"; do
  dpkg-deb -c "${DEB[$pkg]}" | awk '{print $1, $2, $6}' | sed "s|^|$pkg |" >> "$TMP/contents"
done
owners=$(awk '{print $3}' "$TMP/contents" | grep -v -E '^root/root$' | sort -u || true)
[ -z "$owners" ] || fail "files not owned by root/root: $owners"
awk '$4 !~ /\/$/ {print $4}' "$TMP/contents" | sort | uniq -d > "$TMP/dups"
[ ! -s "$TMP/dups" ] || fail "files in two packages: $(head -3 "$TMP/dups")"
grep -q ' \./usr/local' "$TMP/contents" && fail "a package installs under /usr/local"
has() { grep -q -E "^$1 [^ ]+ [^ ]+ \./$2\$" "$TMP/contents" || fail "$1 lacks /$2"; }
has flatshard 'usr/bin/flatshardd'
has flatshard 'usr/bin/flatshardctl'
has flatshard 'etc/flatshard/flatshardd.env'
has flatshard 'lib/systemd/system/flatshard.service'
has flatshard 'usr/lib/tmpfiles.d/flatshard.conf'
has flatshard 'usr/lib/sysusers.d/flatshard.conf'
has flatshard 'usr/share/man/man8/flatshardd.8.gz'
has flatshard 'usr/share/man/man1/flatshardctl.1.gz'
has "libflatshard-client$SOV" "usr/lib/([a-z0-9_-]+/)?libflatshard_client.so.$SOV"
has "libflatshard-client$SOV" "usr/lib/([a-z0-9_-]+/)?libflatshard_client.so.$VERSION"
has libflatshard-dev 'usr/include/flatshard/client.h'
has libflatshard-dev 'usr/include/flatshard/plan.h'
has libflatshard-dev 'usr/include/flatshard/version.h'
has libflatshard-dev 'usr/lib/([a-z0-9_-]+/)?libflatshard_client.so'
has libflatshard-dev 'usr/lib/([a-z0-9_-]+/)?libflatshard_client.a'
has libflatshard-dev 'usr/lib/([a-z0-9_-]+/)?cmake/flatshard/flatshardConfig.cmake'
has libflatshard-dev 'usr/lib/([a-z0-9_-]+/)?pkgconfig/flatshard.pc'
for pkg in "${!DEB[@]}"; do
  case "$pkg" in *-dbgsym) has "$pkg" "usr/share/doc/$pkg"; continue ;; esac  # a link to $pkg's
  has "$pkg" "usr/share/doc/$pkg/copyright"
  has "$pkg" "usr/share/doc/$pkg/changelog.Debian.gz"
done
grep -E '^flatshard -rwxr-xr-x .* \./usr/bin/flatshardd$' "$TMP/contents" >/dev/null || fail "flatshardd is not 0755"

ROOTFS="$TMP/root"
mkdir "$ROOTFS"
for pkg in "${!DEB[@]}"; do dpkg-deb -x "${DEB[$pkg]}" "$ROOTFS"; done
unit="$ROOTFS/lib/systemd/system/flatshard.service"
grep -qxF 'ExecStart=/usr/bin/flatshardd --socket=/run/flatshard/flatshardd.sock --state_dir=/var/lib/flatshard/state $FLATSHARDD_ARGS' "$unit" \
  || fail "the packaged unit's ExecStart: $(grep ExecStart= "$unit")"
grep -qxF 'EnvironmentFile=-/etc/flatshard/flatshardd.env' "$unit" || fail "the packaged unit's EnvironmentFile"
pc=$(find "$ROOTFS/usr/lib" -name flatshard.pc)
grep -qxF 'prefix=/usr' "$pc" || fail "flatshard.pc's prefix is not /usr"
leak=$(grep -rIl -e "$SRC" -e "$BUILD" "$ROOTFS" || true)
[ -z "$leak" ] || fail "packaged files name the source or build tree: $leak"
# Stripped ELF files whose symbols are in the -dbgsym package, found by build-id.
nelf=0
while IFS= read -r f; do
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = 177ELF ] || continue
  case "$f" in "$ROOTFS"/usr/lib/debug/*) continue ;; esac
  sections=$(readelf -S "$f")
  grep -q '\.symtab' <<< "$sections" && fail "${f#"$ROOTFS"} is not stripped"
  id=$(readelf -n "$f" | awk '/Build ID:/ {print $3; exit}')
  [ -n "$id" ] || fail "${f#"$ROOTFS"} has no build-id"
  dbg="$ROOTFS/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug"
  [ -f "$dbg" ] || fail "no ${dbg#"$ROOTFS"} for ${f#"$ROOTFS"}"
  [ "$(readelf -n "$dbg" | awk '/Build ID:/ {print $3; exit}')" = "$id" ] || fail "${dbg#"$ROOTFS"}: another build-id"
  readelf -S "$dbg" | grep -q '\.symtab' || fail "${dbg#"$ROOTFS"} has no symbols"
  link=$(readelf --string-dump=.gnu_debuglink "$f" 2>/dev/null | awk '/\]/ {print $3; exit}')
  [ "$link" = "${id:2}.debug" ] || fail "${f#"$ROOTFS"}'s .gnu_debuglink is '$link', want ${id:2}.debug"
  nelf=$((nelf + 1))
done < <(find "$ROOTFS/usr/bin" "$ROOTFS/usr/lib" -type f \( -path '*/bin/*' -o -name '*.so*' \))
[ $nelf -ge 3 ] || fail "only $nelf stripped ELF files checked"
echo "ok (b): $nelf ELF files stripped, their symbols in -dbgsym by build-id"

# lintian (Debian's package checker): no errors; warnings are listed (README "Packages").
if command -v lintian > /dev/null; then
  lintian --no-tag-display-limit "${DEB[@]}" > "$TMP/lintian.txt" 2>&1 || true
  errors=$(grep '^E: ' "$TMP/lintian.txt" || true)
  [ -z "$errors" ] || fail "lintian errors: $errors"
  echo "ok (b): lintian: no errors, $(grep -c '^W: ' "$TMP/lintian.txt" || true) warnings"
  grep '^W: ' "$TMP/lintian.txt" | sed 's/^/  /' || true
else
  echo "note (b): lintian is not installed (apt-get install lintian); not run"
fi
echo "ok (b): $(grep -vc '/$' "$TMP/contents") files, each in its place and package"

# (c) The unpacked daemon, CLI and client library. (flatshardd and flatshardctl take their
# libraries from the system, as an installed package would.)
[ "$("$ROOTFS/usr/bin/flatshardctl" --version)" = "flatshardctl $VERSION" ] || fail "unpacked flatshardctl --version"
SOCK="$TMP/d.sock"
"$ROOTFS/usr/bin/flatshardd" --ephemeral --socket "$SOCK" --segment_prefix "$SEG_PREFIX" > "$TMP/d.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 1 100); do
  [ -S "$SOCK" ] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "unpacked daemon exited: $(tail -5 "$TMP/d.log")"
  sleep 0.1
done
[ -S "$SOCK" ] || fail "unpacked daemon made no socket in 10 s: $(tail -5 "$TMP/d.log")"
"$ROOTFS/usr/bin/flatshardctl" status --socket "$SOCK" > "$TMP/status.txt" 2>&1 \
  || fail "unpacked flatshardctl status: $(cat "$TMP/status.txt")"

cp -r "$SRC/tests/package/consumer" "$TMP/consumer"
cmake -S "$TMP/consumer" -B "$TMP/cb" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$ROOTFS/usr" > "$TMP/cb.log" 2>&1 \
  || fail "consumer configure against the unpacked -dev package: $(tail -15 "$TMP/cb.log")"
grep -q "consumer: flatshard $VERSION from $ROOTFS/usr/lib" "$TMP/cb.log" \
  || fail "the consumer found another flatshard: $(grep 'consumer:' "$TMP/cb.log")"
cmake --build "$TMP/cb" -j2 --target consumer_shared > "$TMP/cbb.log" 2>&1 || fail "consumer build: $(tail -20 "$TMP/cbb.log")"
lib_used=$(env LD_LIBRARY_PATH= ldd "$TMP/cb/consumer_shared" | awk '$1 ~ /^libflatshard_client\.so/ {print $3}')
case "$lib_used" in "$ROOTFS"/*) ;; *) fail "consumer_shared takes libflatshard_client from '$lib_used'" ;; esac
pids=()
for r in 0 1; do
  timeout 120 "$TMP/cb/consumer_shared" --address "unix:$SOCK" --group deb --world_size 2 --rank $r \
    > "$TMP/c.$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  wait "${pids[$r]}" || fail "consumer rank $r: $(cat "$TMP/c.$r.log"); daemon: $(tail -5 "$TMP/d.log")"
  grep -q "^consumer rank $r/2 OK" "$TMP/c.$r.log" || fail "consumer rank $r: $(cat "$TMP/c.$r.log")"
done
kill -TERM "$DAEMON_PID"
rc=0; wait "$DAEMON_PID" || rc=$?
DAEMON_PID=""
[ $rc -eq 0 ] || fail "unpacked daemon exited $rc after SIGTERM"
echo "ok (c): unpacked flatshardd served flatshardctl and a 2-rank trainer built against libflatshard-dev"
echo "PASS"
