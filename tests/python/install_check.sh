#!/bin/sh
# Installs the python component of a build into a temp prefix and imports it from there:
#   install_check.sh CMAKE BUILD_DIR PYTHON_INSTALL_DIR PYTHON FLATSHARDD
set -eu
cmake=$1 build=$2 pydir=$3 python=$4 daemon=$5
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
"$cmake" --install "$build" --prefix "$prefix" --component python >/dev/null
cd "$prefix"
PATH="$(dirname "$daemon"):$PATH" PYTHONPATH="$prefix/$pydir" FS_PREFIX="$prefix" "$python" - <<'PY'
import os
import flatshard, flatshard.testing
assert flatshard.__file__.startswith(os.environ["FS_PREFIX"]), flatshard.__file__
assert flatshard._C.__file__.startswith(os.environ["FS_PREFIX"]), flatshard._C.__file__
with flatshard.testing.LocalDaemon() as d:  # flatshardd found on PATH
    c = flatshard.Client(d.address)
    c.join("install-check", 1, 0)
    assert c.joined
    c.close()
print("installed package ok:", os.path.dirname(flatshard.__file__))
PY
