#!/usr/bin/env bash
# The Debian packages installed for real on this machine (`dpkg -i`, maintainer scripts and
# all), checked, used and purged. It changes the system (a `flatshard` user and group that stay
# after the purge, as Debian leaves them), so it runs only as root with
# FLATSHARD_TEST_SYSTEM_INSTALL=1, and only where no flatshard package is installed:
#
#   FLATSHARD_TEST_SYSTEM_INSTALL=1 ctest --test-dir build -L system-install --output-on-failure
#
# Checks: the user and group (system, nologin, home /var/lib/flatshard), the directories of
# tmpfiles.d/flatshard.conf, the unit enabled (deb-systemd-helper's symlink), ldconfig knowing
# the library; then flatshardd started the way flatshard.service starts it (user flatshard,
# only CAP_CHOWN and CAP_FOWNER, via setpriv) serves a trainer of another uid (root) built with
# CMake against the installed -dev package, and on SIGTERM removes that uid's segments; finally
# `dpkg --purge` removes the files, the state and runtime directories, and the Python byte-code.
#
#   system_install_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
SRC=$1
BUILD=$2
[ "${FLATSHARD_TEST_SYSTEM_INSTALL:-}" = 1 ] || { echo "SKIP: set FLATSHARD_TEST_SYSTEM_INSTALL=1 (changes the system)"; exit 77; }
[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root"; exit 77; }
command -v setpriv >/dev/null || { echo "SKIP: no setpriv"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
for p in flatshard libflatshard-dev libflatshard-client0; do
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ]; then
    fail "$p is already installed; this test installs and purges its own build"
  fi
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-sysinst-test.XXXXXX")
chmod 0755 "$TMP"
DAEMON_PID=""
SEG_PREFIX="fssys$$"
INSTALLED=()
cleanup() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -9 "$DAEMON_PID" 2>/dev/null || true
    wait "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -f /dev/shm/"$SEG_PREFIX"* 2>/dev/null || true
  [ ${#INSTALLED[@]} -eq 0 ] || dpkg --purge "${INSTALLED[@]}" > /dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap cleanup EXIT

VERSION=$(sed -n 's/^project(flatshard VERSION \([0-9.]*\).*/\1/p' "$SRC/CMakeLists.txt")
bash "$SRC/scripts/make_deb.sh" --build-dir "$BUILD" --out-dir "$TMP/debs" > "$TMP/debs.txt" 2> "$TMP/make_deb.log" \
  || fail "make_deb.sh: $(tail -5 "$TMP/make_deb.log")"
mapfile -t debs < "$TMP/debs.txt"
for d in "${debs[@]}"; do INSTALLED+=("$(dpkg-deb -f "$d" Package)"); done
dpkg -i "${debs[@]}" > "$TMP/dpkg.log" 2>&1 || fail "dpkg -i: $(tail -10 "$TMP/dpkg.log")"

# What postinst did.
pw=$(getent passwd flatshard) || fail "no flatshard user"
IFS=: read -r _ _ uid gid _ home shell <<< "$pw"
[ "$uid" -lt 1000 ] || fail "flatshard's uid $uid is not a system uid"
[ "$(getent group flatshard | cut -d: -f3)" = "$gid" ] || fail "flatshard's primary group is not flatshard"
[ "$home" = /var/lib/flatshard ] || fail "flatshard's home is $home"
case "$shell" in */nologin|/bin/false) ;; *) fail "flatshard's shell is $shell" ;; esac
[ "$(stat -c '%U:%G %a' /var/lib/flatshard)" = "flatshard:flatshard 750" ] \
  || fail "/var/lib/flatshard is $(stat -c '%U:%G %a' /var/lib/flatshard)"
if command -v systemd-tmpfiles >/dev/null; then
  [ "$(stat -c '%U:%G %a' /run/flatshard)" = "flatshard:flatshard 755" ] \
    || fail "/run/flatshard is $(stat -c '%U:%G %a' /run/flatshard 2>&1)"
fi
[ -L /etc/systemd/system/multi-user.target.wants/flatshard.service ] || fail "flatshard.service is not enabled"
cache=$(ldconfig -p)
grep -q "libflatshard_client.so.${VERSION%%.*} " <<< "$cache" || fail "ldconfig does not know libflatshard_client"
[ "$(/usr/bin/flatshardctl --version)" = "flatshardctl $VERSION" ] || fail "installed flatshardctl --version"
echo "ok: dpkg -i: user, group, directories, enabled unit, library"

# flatshardd as flatshard.service runs it (User=, AmbientCapabilities=, CapabilityBoundingSet=).
mkdir "$TMP/run" && chown flatshard:flatshard "$TMP/run"
SOCK="$TMP/run/flatshardd.sock"
setpriv --reuid=flatshard --regid=flatshard --init-groups --inh-caps=-all,+chown,+fowner \
  --ambient-caps=-all,+chown,+fowner --bounding-set=-all,+chown,+fowner \
  /usr/bin/flatshardd --ephemeral --socket="$SOCK" --segment_prefix="$SEG_PREFIX" > "$TMP/d.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 1 100); do
  [ -S "$SOCK" ] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "daemon exited: $(tail -5 "$TMP/d.log")"
  sleep 0.1
done
[ -S "$SOCK" ] || fail "daemon made no socket in 10 s: $(tail -5 "$TMP/d.log")"
[ "$(stat -c %U "/proc/$DAEMON_PID")" = flatshard ] || fail "the daemon does not run as flatshard"
[ "$(stat -c '%G %a' "$SOCK")" = "flatshard 660" ] || fail "socket is $(stat -c '%G %a' "$SOCK")"

cp -r "$SRC/tests/package/consumer" "$TMP/consumer"
cmake -S "$TMP/consumer" -B "$TMP/cb" -DCMAKE_BUILD_TYPE=Release > "$TMP/cb.log" 2>&1 \
  || fail "consumer configure against /usr: $(tail -15 "$TMP/cb.log")"
grep -q "consumer: flatshard $VERSION from /usr/lib" "$TMP/cb.log" || fail "consumer found $(grep 'consumer:' "$TMP/cb.log")"
cmake --build "$TMP/cb" -j2 --target consumer_shared > "$TMP/cbb.log" 2>&1 || fail "consumer build: $(tail -20 "$TMP/cbb.log")"
pids=()
for r in 0 1; do
  timeout 120 "$TMP/cb/consumer_shared" --address "unix:$SOCK" --group sysinst --world_size 2 --rank $r \
    > "$TMP/c.$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  wait "${pids[$r]}" || fail "consumer rank $r: $(cat "$TMP/c.$r.log"); daemon: $(tail -5 "$TMP/d.log")"
done
owners=$(find /dev/shm -maxdepth 1 -name "$SEG_PREFIX*" -printf '%u\n' | sort -u | tr '\n' ' ')
[ "$owners" = "root " ] || fail "the root trainer's segments are owned by '$owners', want root (CAP_CHOWN)"
kill -TERM "$DAEMON_PID"
rc=0; wait "$DAEMON_PID" || rc=$?
DAEMON_PID=""
[ $rc -eq 0 ] || fail "daemon exited $rc: $(tail -5 "$TMP/d.log")"
left=$(find /dev/shm -maxdepth 1 -name "$SEG_PREFIX*" | head -3)
[ -z "$left" ] || fail "the daemon could not remove root's segments (CAP_FOWNER): $left"
echo "ok: flatshardd as flatshard with CAP_CHOWN+CAP_FOWNER served a root trainer and cleaned up"

# Byte-code next to the Python package (as an import by root writes it), which the purge must
# remove with the package.
py_dirs=()
mapfile -t dbg_files < <(dpkg -L flatshard-dbgsym | grep '\.debug$')
[ ${#dbg_files[@]} -gt 0 ] || fail "flatshard-dbgsym installed no .debug file"
if [ "$(dpkg-query -W -f='${Status}' python3-flatshard 2>/dev/null || true)" = "install ok installed" ]; then
  mapfile -t py_dirs < <(dpkg -L python3-flatshard | grep '/flatshard/__init__\.py$' | xargs -r -n1 dirname)
  [ ${#py_dirs[@]} -gt 0 ] || fail "python3-flatshard installs no flatshard/__init__.py"
  /usr/bin/python3 -m compileall -q "${py_dirs[@]}" > /dev/null || fail "compileall of ${py_dirs[*]}"
  [ -n "$(find "${py_dirs[@]}" -name __pycache__)" ] || fail "no __pycache__ written under ${py_dirs[*]}"
fi
dpkg --purge "${INSTALLED[@]}" > "$TMP/purge.log" 2>&1 || fail "dpkg --purge: $(tail -5 "$TMP/purge.log")"
INSTALLED=()
for f in /usr/bin/flatshardd /lib/systemd/system/flatshard.service /etc/flatshard/flatshardd.env \
         /var/lib/flatshard /run/flatshard /usr/include/flatshard/client.h \
         "${dbg_files[@]}" "${py_dirs[@]}"; do
  [ ! -e "$f" ] || fail "$f is left after the purge: $(find "$f" | head -3 | tr '\n' ' ')"
done
echo "PASS"
