"""Errors: one exception class per gRPC code family, the daemon's message unchanged."""

import json
import os
import pickle
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import flatshard
from flatshard import errors
from conftest import MLP_POLICY, connect, mlp_manifest, run_ranks


def test_every_code_maps_to_its_class():
    table = {
        "INVALID_ARGUMENT": flatshard.InvalidArgumentError,
        "NOT_FOUND": flatshard.NotFoundError,
        "ALREADY_EXISTS": flatshard.AlreadyExistsError,
        "PERMISSION_DENIED": flatshard.PermissionDeniedError,
        "FAILED_PRECONDITION": flatshard.FailedPreconditionError,
        "ABORTED": flatshard.AbortedError,
        "UNAVAILABLE": flatshard.UnavailableError,
        "DEADLINE_EXCEEDED": flatshard.DeadlineExceededError,
        "RESOURCE_EXHAUSTED": flatshard.ResourceExhaustedError,
        "INTERNAL": flatshard.InternalError,
    }
    for code, cls in table.items():
        e = errors._from_status(code, f"msg of {code}")
        assert type(e) is cls and isinstance(e, flatshard.FlatshardError)
        assert e.code == code and e.message == f"msg of {code}"
        assert str(e) == f"{code}: msg of {code}"
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and again.message == e.message
    other = errors._from_status("UNAUTHENTICATED", "who are you")
    assert type(other) is flatshard.FlatshardError and other.code == "UNAUTHENTICATED"
    assert len({cls for cls in table.values()}) == len(table)


def test_connect_errors(tmp_path):
    with pytest.raises(flatshard.UnavailableError) as e:
        flatshard.Client(f"unix:{tmp_path}/nobody.sock", call_timeout=0.5, max_attempts=1)
    assert e.value.code == "UNAVAILABLE" and e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        flatshard.Client("")
    assert "address" in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        flatshard.Client(f"unix:{tmp_path}/x.sock", call_timeout=0)
    assert "call_timeout" in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        flatshard.Client(f"unix:{tmp_path}/x.sock", max_attempts=0)
    assert "max_attempts" in e.value.message


def test_malformed_address_refused_at_once():
    # Neither a path (no '/') nor host:port: refused without waiting call_timeout.
    for address in ("flatshardd.sock", "localhost", "host:http"):
        start = time.monotonic()
        with pytest.raises(flatshard.InvalidArgumentError) as e:
            flatshard.Client(address, call_timeout=30, max_attempts=1)
        assert time.monotonic() - start < 1.0
        assert f'"{address}"' in e.value.message
        assert '"unix:/path/to.sock"' in e.value.message and '"host:port"' in e.value.message


def test_join_errors(daemon, group):
    # 3 s: the daemon answers 10% before the client's deadline (server/service), which must
    # beat the client's own "Deadline Exceeded" even on a loaded machine.
    c = connect(daemon, join_timeout=3.0)
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.join(group, 2, 5)
    assert "rank" in e.value.message
    with pytest.raises(flatshard.DeadlineExceededError) as e:
        c.join(group, 3, 0)  # ranks 1 and 2 never come
    assert e.value.code == "DEADLINE_EXCEEDED"
    assert e.value.message == f"group {group}: ranks 1, 2 of 3 did not join before the deadline"
    g2 = group + "-b"
    c2 = connect(daemon)
    c2.join(g2, 1, 0, token="right")
    with pytest.raises(flatshard.FailedPreconditionError):
        c2.join(g2, 1, 0, token="right")  # already joined
    c3 = connect(daemon)
    with pytest.raises(flatshard.PermissionDeniedError) as e:
        c3.join(g2, 1, 0, token="wrong")  # the live group has another token
    assert "token" in e.value.message
    with pytest.raises(flatshard.FailedPreconditionError):
        c3.leave()  # not joined
    c2.leave()
    for x in (c, c2, c3):
        x.close()


def _ctl():
    return str(Path(os.environ["FLATSHARD_DAEMON"]).resolve().parent.parent / "client" /
               "flatshardctl")


def test_register_errors(daemon, group, tmp_path):
    c = connect(daemon)
    with pytest.raises(flatshard.FailedPreconditionError):
        c.register("", mlp_manifest(), MLP_POLICY)  # not joined
    c.join(group, 1, 0)
    bad = json.loads(mlp_manifest())
    bad["root"]["children"][1]["module"]["params"][0]["dtype"] = "float16"  # mixed dtypes
    bad_text = json.dumps(bad)
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.register("", bad_text, "")
    # The same message as `flatshardctl plan` prints for that manifest.
    (tmp_path / "bad.json").write_text(bad_text)
    out = subprocess.run([_ctl(), "plan", f"--manifest={tmp_path / 'bad.json'}",
                          "--world-size=1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert e.value.message in out.stderr, (e.value.message, out.stderr)
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.register("", "{not json", "")
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.register("", mlp_manifest(), MLP_POLICY, init="ones")
    assert "init" in e.value.message
    c.register("", mlp_manifest(), MLP_POLICY)
    with pytest.raises(flatshard.AlreadyExistsError) as e:
        c.register("", mlp_manifest(), MLP_POLICY)
    assert "already registered" in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.register("fc1", mlp_manifest(), MLP_POLICY)
    assert "already has flatshard applied" in e.value.message
    c.close()


def test_summon_and_reduce_scatter_errors(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    with pytest.raises(flatshard.NotFoundError) as e:
        c.summon("nope")
    assert "nope" in e.value.message
    reg = c.register("", mlp_manifest(), MLP_POLICY)
    s = c.summon("")
    with pytest.raises(flatshard.FailedPreconditionError) as e:
        c.summon("")
    assert "already unsharding" in e.value.message
    s.end()
    with pytest.raises(flatshard.NotFoundError):
        c.begin_reduce_scatter("", 99)
    with pytest.raises(flatshard.NotFoundError):
        c.shard_views("nope")
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.begin_reduce_scatter("", reg.plan["units"][0]["index"], op="max")
    assert "op" in e.value.message
    u = reg.plan["units"][0]
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.reduce_scatter_grads("", u["index"], torch.zeros(u["numel"] + 5))
    assert str(u["numel"]) in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        c.reduce_scatter_grads("", u["index"], torch.zeros(u["numel"], dtype=torch.float64))
    assert "dtype" in e.value.message
    with pytest.raises(flatshard.NotFoundError):
        c.reduce_scatter_grads("", 99, torch.zeros(3))
    # A failed argument check began nothing: a reduce-scatter still works.
    c.reduce_scatter_grads("", u["index"], torch.ones(u["numel"]))
    with pytest.raises(flatshard.NotFoundError) as e:
        with c.summon("") as s:
            s.flat(99)
    c.close()


def test_mismatched_collectives_abort(daemon, group):
    """Ranks issuing different collectives at one op sequence: ABORTED naming both."""

    def rank_fn(rank):
        c = connect(daemon, call_timeout=20)
        c.join(group, 2, rank)
        c.register("", mlp_manifest(), MLP_POLICY)
        try:
            with c.summon("", "fc1" if rank == 0 else "fc2", writeback=False):
                pass
        except flatshard.FlatshardError as e:
            return e
        finally:
            c.close()
        return None

    got = run_ranks(2, rank_fn)
    assert all(isinstance(e, flatshard.AbortedError) for e in got), got
    assert all(e.code == "ABORTED" for e in got)


def test_resource_exhausted():
    with flatshard.testing.LocalDaemon(extra_args=("--memory_limit_mib=1",)) as d:
        c = flatshard.Client(d.address)
        c.join("big", 1, 0)
        big = json.loads(mlp_manifest())
        big["root"]["children"][0]["module"]["params"][0]["shape"] = [1024, 1024]  # 4 MiB
        with pytest.raises(flatshard.ResourceExhaustedError) as e:
            c.register("", json.dumps(big), MLP_POLICY)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        c.close()


def test_daemon_gone_unavailable_and_lease_status(group):
    d = flatshard.testing.LocalDaemon().start()
    try:
        c = flatshard.Client(d.address, call_timeout=3.0, max_attempts=2)
        c.join(group, 1, 0)
        c.register("", mlp_manifest(), MLP_POLICY)
        assert c.lease_status is None
        d.kill()
        deadline = time.monotonic() + 20
        while c.lease_status is None and time.monotonic() < deadline:
            time.sleep(0.05)
        st = c.lease_status
        assert isinstance(st, flatshard.FlatshardError), st
        with pytest.raises(flatshard.FlatshardError) as e:
            c.summon("")
        assert type(e.value) in (flatshard.UnavailableError, flatshard.FailedPreconditionError)
        c.close()
    finally:
        d.kill()
        d.stop()


def test_gil_released_while_join_blocks(daemon, group):
    """Rank 0's Join blocks until rank 1 joins; meanwhile this thread keeps running Python."""
    c0, c1 = connect(daemon), connect(daemon)
    done = threading.Event()
    err = []

    def join0():
        try:
            c0.join(group, 2, 0)
        except Exception as e:  # reported below
            err.append(e)
        done.set()

    t = threading.Thread(target=join0, daemon=True)
    t.start()
    spins, t_end = 0, time.monotonic() + 0.5
    while time.monotonic() < t_end:
        spins += 1
    assert not done.is_set()  # still waiting for rank 1
    assert spins > 1000
    c1.join(group, 2, 1)
    assert done.wait(30) and not err
    c0.close()
    c1.close()


def test_with_block_keeps_the_body_exception(group):
    """An exception in a `with summon` body propagates; a failing End rides along as a note."""
    d = flatshard.testing.LocalDaemon().start()
    try:
        c = flatshard.Client(d.address, call_timeout=3.0, max_attempts=1)
        c.join(group, 1, 0)
        c.register("", mlp_manifest(), MLP_POLICY)
        with pytest.raises(KeyError) as e:
            with c.summon("") as s:
                t = s.params["fc1.bias"]
                d.kill()
                raise KeyError("body")
        assert s.ended
        notes = getattr(e.value, "__notes__", [])
        assert any("ending summon" in n and "Error" in n for n in notes), notes
        assert t.sum().item() == 0.0  # still mapped after the daemon died
        c.close()
    finally:
        d.kill()
        d.stop()
