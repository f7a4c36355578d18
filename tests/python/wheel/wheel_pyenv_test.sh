#!/bin/bash
# A CPython that is not Debian's (pyenv's) builds its own wheel with pip from pyproject.toml,
# offline (pip wheel --no-index: the in-tree backend, CMake build in BUILD_DIR-python-cpXY, a
# sibling of the build tree so ccache reuses its objects), installs it into a venv and does
# real work against this build's flatshardd (wheel_check.py).
#   wheel_pyenv_test.sh SOURCE_DIR BUILD_DIR FLATSHARDD
# Exit 77 (skip) when no pyenv CPython of a supported version is installed, or unless
# FLATSHARD_TEST_PYENV_WHEEL=1: the first run configures and builds the client for that
# interpreter (minutes on 2 cores; later runs are incremental).
set -euo pipefail
src=$1 build=$2 daemon=$3
here=$(cd "$(dirname "$0")" && pwd)

if [[ ${FLATSHARD_TEST_PYENV_WHEEL:-0} != 1 ]]; then
  echo "SKIP: set FLATSHARD_TEST_PYENV_WHEEL=1 to build a pyenv CPython's wheel (minutes once)"
  exit 77
fi
python=""
for v in 3.12 3.13 3.10; do  # not 3.11: Debian's is 3.11, the other test covers it
  for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python3; do
    [[ -x $p ]] && { python=$p; break 2; }
  done
done
if [[ -z $python ]]; then
  echo "SKIP: no pyenv CPython 3.10/3.12/3.13 under ${PYENV_ROOT:-$HOME/.pyenv}/versions"
  exit 77
fi
tag=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
build_abs=$(cd "$build" && pwd)
wheel_build="${build_abs}-python-$tag"
echo "--- $python ($tag), CMake build in $wheel_build"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
cd "$work"
env -u PYTHONPATH "$work/venv/bin/pip" wheel "$src" --no-index --no-deps -w "$work/dist" \
  --config-settings "build-dir=$wheel_build"
ls "$work"/dist/flatshard-*-"$tag"-"$tag"-linux_x86_64.whl
env -u PYTHONPATH "$work/venv/bin/pip" install --no-index "$work"/dist/flatshard-*.whl
env -u PYTHONPATH FLATSHARD_DAEMON="$daemon" PYTHONDONTWRITEBYTECODE=1 \
  "$work/venv/bin/python" "$here/wheel_check.py"
