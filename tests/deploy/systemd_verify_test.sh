#!/usr/bin/env bash
# `systemd-analyze verify` on deploy/systemd/flatshardd.service, offline (no systemd as PID 1
# needed). verify insists that ExecStart's binary exists, so it checks a copy whose ExecStart
# names the built flatshardd; everything else is the unit as shipped. Any warning about the
# unit (an unknown or misplaced key, a bad value) fails the test, not only a non-zero exit.
# Usage: systemd_verify_test.sh UNIT FLATSHARDD. Exit 77 (CTest: skipped) without systemd-analyze.
set -euo pipefail
unit=$1
binary=$2
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIP: systemd-analyze is not installed (Debian package systemd)"
  exit 77
fi
[ -x "$binary" ] || { echo "FAIL: $binary is not an executable"; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
grep -q '^ExecStart=/usr/local/bin/flatshardd ' "$unit" ||
  { echo "FAIL: $unit's ExecStart does not run /usr/local/bin/flatshardd"; exit 1; }
sed "s#^ExecStart=/usr/local/bin/flatshardd #ExecStart=$binary #" "$unit" >"$dir/flatshardd.service"
set +e
out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no "$dir/flatshardd.service" 2>&1)
rc=$?
set -e
echo "$out"
if [ $rc -ne 0 ]; then
  echo "FAIL: systemd-analyze verify exited $rc"
  exit 1
fi
# Warnings about other units (the host's) are not ours; those naming this unit are.
if echo "$out" | grep -q 'flatshardd.service'; then
  echo "FAIL: systemd-analyze verify warned about the unit"
  exit 1
fi
echo "systemd-analyze verify: flatshardd.service OK"
