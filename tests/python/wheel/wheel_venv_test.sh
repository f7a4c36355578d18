#!/bin/bash
# The README's wheel install block ("<!-- wheel-install -->"), run as written in a scratch
# directory whose build/ is this build tree, with Debian's python3 first on PATH: it builds
# build/dist/flatshard-*.whl and installs it with pip --no-index into a new venv without system
# site packages (no torch, no numpy). Then the venv's package does real work against this
# build's flatshardd (wheel_check.py). Exit 77 (skip) without python3-venv.
#   wheel_venv_test.sh SOURCE_DIR BUILD_DIR PYTHON FLATSHARDD
set -euo pipefail
src=$1 build=$2 python=$3 daemon=$4
here=$(cd "$(dirname "$0")" && pwd)

if ! "$python" -c "import ensurepip, venv" 2>/dev/null; then
  echo "SKIP: $python cannot make a venv with pip (Debian: apt install python3-venv)"
  exit 77
fi
block=$(awk '/^<!-- wheel-install -->$/ {on = 1; next} /^<!-- \/wheel-install -->$/ {on = 0}
             on && !/^```/' "$src/README.md")
if [[ $block != *flatshard_wheel* || $block != *"pip install"* ]]; then
  echo "FAIL: README.md has no wheel-install block that builds and installs the wheel" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ln -s "$(cd "$build" && pwd)" "$work/build"
echo "--- README block, in $work:"
echo "$block"
(cd "$work" && env -u PYTHONPATH -u VIRTUAL_ENV PATH="$(dirname "$python"):$PATH" \
   bash -euo pipefail -c "$block")

venv_python="$work/fs-venv/bin/python"
[[ -x $venv_python ]] || { echo "FAIL: the README block made no fs-venv" >&2; exit 1; }
# The wheel and the venv are what the tests claim: Debian's CPython, no system site packages.
"$venv_python" - "$python" <<'PY'
import subprocess, sys, sysconfig
want = subprocess.run([sys.argv[1], "-c", "import sys; print(sys.base_prefix)"],
                      capture_output=True, text=True, check=True).stdout.strip()
assert sys.base_prefix == want, (sys.base_prefix, want)
assert not any(p.endswith("dist-packages") for p in sys.path), sys.path  # no system site
PY
# PEP 427: every file in RECORD with its sha256 and size, the tag this interpreter's.
"$venv_python" - "$work"/build/dist/flatshard-*.whl <<'PY'
import base64, csv, hashlib, io, sys, zipfile
(path,) = sys.argv[1:]
tag = "cp%d%d" % sys.version_info[:2]
assert path.endswith(f"-{tag}-{tag}-linux_x86_64.whl"), path
with zipfile.ZipFile(path) as z:
    names = set(z.namelist())
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = list(csv.reader(io.StringIO(z.read(record).decode())))
    assert {r[0] for r in rows} == names, names ^ {r[0] for r in rows}
    for name, digest, size in rows:
        if name == record:
            continue
        data = z.read(name)
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == "sha256=" + want and int(size) == len(data), name
    wheel = z.read(record.replace("RECORD", "WHEEL")).decode()
    assert f"Tag: {tag}-{tag}-linux_x86_64" in wheel, wheel
    assert {"flatshard/py.typed", "flatshard/_C.pyi"} <= names, names
print("wheel RECORD ok:", len(rows), "files")
PY
cd "$work"
env -u PYTHONPATH FLATSHARD_DAEMON="$daemon" PYTHONDONTWRITEBYTECODE=1 \
  "$venv_python" "$here/wheel_check.py"
