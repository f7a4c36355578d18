"""The core's type hints, py.typed and the _C.pyi stub, checked with mypy (Debian's `mypy`;
skipped without it): the package itself, a trainer-style use of the torch-free API, and a
misuse that must be reported (so the hints are not Any everywhere)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy")

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "client" / "python"
CONFIG = """\
[mypy]
python_version = 3.10
ignore_missing_imports = True
[mypy-torch.*]
follow_imports = skip
[mypy-numpy.*]
follow_imports = skip
[mypy-flatshard.torch.*]
follow_imports = skip
"""

USE = '''
import flatshard

def step(c: flatshard.Client) -> list[float]:
    c.join("g", 1, 0)
    reg: flatshard.Registered = c.register("", {"format": "flatshard.manifest/1"})
    with c.summon("", writeback=False) as s:
        views: dict[str, memoryview] = s.memoryview_params
        out = [float(x) for v in views.values() for x in v.tolist()]
    gen: int = c.commit("")
    err: flatshard.FlatshardError | None = c.lease_status
    return out + [float(gen), float(len(reg.shards))]
'''


def _mypy(tmp_path, *files):
    cfg = tmp_path / "mypy.ini"
    cfg.write_text(CONFIG)
    env = dict(os.environ, MYPYPATH=str(PACKAGE_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(cfg), "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), *map(str, files)],
        capture_output=True, text=True, env=env, cwd=tmp_path)


def test_core_package_type_checks(tmp_path):
    pkg = PACKAGE_ROOT / "flatshard"
    r = _mypy(tmp_path, *(pkg / n for n in ("__init__.py", "_client.py", "errors.py",
                                            "_optional.py", "testing.py", "weights.py",
                                            "_C.pyi")))
    assert r.returncode == 0, r.stdout + r.stderr


def test_trainer_use_type_checks_and_misuse_is_reported(tmp_path):
    (tmp_path / "use.py").write_text(textwrap.dedent(USE))
    r = _mypy(tmp_path, tmp_path / "use.py")
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "misuse.py").write_text(textwrap.dedent(USE).replace(
        'c.join("g", 1, 0)', 'c.join("g", "one", 0)'))
    r = _mypy(tmp_path, tmp_path / "misuse.py")
    assert r.returncode != 0 and "join" in r.stdout and '"int"' in r.stdout, r.stdout
