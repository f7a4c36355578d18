"""Shared fixtures of the flatshard Python tests (run by CTest: tests/python/CMakeLists.txt).

By hand, after the build:
    PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
        /usr/bin/python3 -m pytest -q tests/python
"""

import copy
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

import flatshard
import flatshard.testing

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MODELS = SOURCE_DIR / "examples" / "models"


def read_model(name):
    """(manifest JSON text, policy JSON text) of examples/models/<name>.*"""
    return ((MODELS / f"{name}.manifest.json").read_text(),
            (MODELS / f"{name}.policy.json").read_text())


def _linear(mid, pid, out_f, in_f, dtype):
    return {
        "id": mid, "type": "Linear", "bases": ["Module"], "children": [],
        "params": [
            {"name": "weight", "id": pid, "shape": [out_f, in_f], "dtype": dtype,
             "requires_grad": True},
            {"name": "bias", "id": pid + 1, "shape": [out_f], "dtype": dtype,
             "requires_grad": True},
        ],
    }


def mlp_manifest(dtype="float32"):
    """Net(fc1: Linear(3->5), fc2: Linear(5->2)): 20 and 12 elements. With MLP_POLICY the
    units are the root (no params), fc1 and fc2."""
    return json.dumps({
        "format": "flatshard.manifest/1",
        "root": {
            "id": 0, "type": "Net", "bases": ["Module"], "params": [],
            "children": [
                {"name": "fc1", "module": _linear(1, 0, 5, 3, dtype)},
                {"name": "fc2", "module": _linear(2, 2, 2, 5, dtype)},
            ],
        },
    })


MLP_POLICY = json.dumps({"format": "flatshard.policy/1",
                         "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


@pytest.fixture
def group():
    return "py-" + uuid.uuid4().hex[:12]


def unit_of(plan, module_path):
    for u in plan["units"]:
        if u["module"] == module_path:
            return u
    raise KeyError(module_path)


def run_ranks(n, fn, timeout=120.0):
    """Runs fn(rank) in n threads; returns their results; re-raises the first exception.
    A thread still running after `timeout` fails the test (a hang, e.g. a held GIL)."""
    results = [None] * n
    errors = [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: B902 - reported below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        pytest.fail(f"ranks {alive} still running after {timeout}s")
    for e in errors:
        if e is not None:
            raise e
    return results


class Barrier(threading.Barrier):
    """threading.Barrier with a deadline on every wait."""

    def wait(self, timeout=60.0):  # noqa: D102
        return super().wait(timeout)


def run_group(address, world, fn, group=None, timeout=120.0):
    """Runs fn(rank, client) for every rank of a fresh group (or `group`), each in its own
    thread with its own Client joined; returns the results by rank; re-raises the first
    rank's exception."""
    group = group or "t-" + uuid.uuid4().hex[:8]

    def body(rank):
        c = flatshard.Client(address, call_timeout=30.0, join_timeout=30.0)
        try:
            c.join(group, world, rank)
            return fn(rank, c)
        finally:
            c.close()

    return dict(enumerate(run_ranks(world, body, timeout)))


def shard_views_when_ready(c, timeout=30.0):
    """shard_views, retried while the daemon answers UNAVAILABLE (a rollback in progress)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return c.shard_views("")
        except flatshard.UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def connect(daemon, **kw):
    kw.setdefault("call_timeout", 30.0)
    kw.setdefault("join_timeout", 30.0)
    return flatshard.Client(daemon.address, **kw)


__all__ = ["read_model", "mlp_manifest", "MLP_POLICY", "unit_of", "run_ranks", "run_group",
           "Barrier", "connect", "copy", "shard_views_when_ready"]
