"""flatshard.Client.commit and the committed generation (spec/semantics.md §3a) against a
real flatshardd: commits count up and are reported by register and shard_views; after a rank
is lost (its client closed, or its process SIGKILLed) with in-place shard writes not
committed, every rank's shards are rolled back to the last commit once every rank has joined
again; the errors map to their classes and name the rank."""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flatshard
from conftest import (MLP_POLICY, Barrier, connect, mlp_manifest, run_ranks,
                      shard_views_when_ready)


def _value(generation, rank, unit):
    """What rank `rank` writes into unit `unit`'s shard for generation `generation`: distinct
    per generation, rank and unit, so that a mix is seen."""
    return float(100 * generation + 10 * rank + unit + 1)


def _write(views, generation, rank):
    for v in views:
        v.shard.fill_(_value(generation, rank, v.unit))


def _assert_holds(views, generation, rank, what):
    for v in views:
        want = torch.full((v.shard_numel,), _value(generation, rank, v.unit))
        assert torch.equal(v.shard, want), f"{what}: unit {v.unit} of rank {rank}: {v.shard}"


def _start(c, group, rank, world=2):
    """Joins and registers the MLP (init from every rank); returns the Registered."""
    c.join(group, world, rank)
    reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_every_rank")
    for t in reg.init_summon.params.values():
        t.zero_()
    reg.init_summon.end()
    return reg


def test_commit_counts_up_and_views_report_the_generation(daemon, group):
    clients = [connect(daemon) for _ in range(2)]

    def rank(r):
        c = clients[r]
        reg = _start(c, group, r)
        assert reg.generation == 0 and "generation=0" in repr(reg)
        views = c.shard_views("")
        assert isinstance(views, list) and isinstance(views, flatshard.ShardViews)
        assert views.generation == 0 and [v.unit for v in views] == sorted(v.unit for v in views)
        got = []
        for g in (1, 2, 3):
            _write(views, g, r)
            got.append(c.commit(""))
            assert c.shard_views("").generation == got[-1]
        # A writeback end commits too, and its answer says so; a read-only one changes nothing.
        s = c.summon("", writeback=True)
        assert s.generation is None  # not ended yet
        s.end()
        assert s.generation == c.shard_views("").generation == 4
        with c.summon("", writeback=False) as ro:
            pass
        assert ro.generation == 4
        got.append(c.shard_views("").generation)
        # Commit keeps the values: a fresh view reads what was written for generation 3.
        _assert_holds(c.shard_views(""), 3, r, "after the commits")
        return got

    assert run_ranks(2, rank) == [[1, 2, 3, 4]] * 2
    for c in clients:
        c.close()


def test_closed_client_rolls_every_rank_back_to_the_last_commit(daemon, group):
    """Both ranks commit generation 1, then write generation 2's values in place; rank 1's
    client closes before the commit. Rank 0's commit fails at once naming rank 1. Rank 1
    comes back (new client, join, register: re-attach) and finds generation 1; rank 0, which
    stayed joined, reads its views again and finds them rolled back too (also through the
    views it held); then both commit generation 2."""
    clients = [connect(daemon) for _ in range(2)]
    held = [None, None]

    def first(r):
        _start(clients[r], group, r)
        views = clients[r].shard_views("")
        _write(views, 1, r)
        assert clients[r].commit("") == 1
        _write(views, 2, r)  # in place, never committed
        held[r] = views

    run_ranks(2, first)
    clients[1].close()
    t0 = time.monotonic()
    with pytest.raises(flatshard.UnavailableError) as e:
        clients[0].commit("")
    assert "rank 1" in e.value.message and e.value.code == "UNAVAILABLE"
    assert time.monotonic() - t0 < 10, "the commit should fail fast, not at its deadline"
    _assert_holds(held[0], 2, 0, "rank 0 before the group re-formed (nothing rolled back yet)")

    back = connect(daemon)
    back.join(group, 2, 1)
    reg = back.register("", mlp_manifest(), MLP_POLICY, init="from_every_rank")
    assert reg.init_summon is None and reg.generation == 1
    _assert_holds(reg.shards, 1, 1, "rank 1 at re-attach")
    views0 = shard_views_when_ready(clients[0])
    assert views0.generation == 1
    _assert_holds(views0, 1, 0, "rank 0 after the rollback")
    _assert_holds(held[0], 1, 0, "rank 0's views held across the rollback")

    now = [clients[0], back]
    got = run_ranks(2, lambda r: (_write(now[r].shard_views(""), 2, r), now[r].commit(""))[1])
    assert got == [2, 2]
    for c in now:
        c.close()


def test_a_rank_that_did_not_reread_its_views_cannot_commit(daemon, group):
    """After a rollback, a rank's commit before it read its views again is refused on every
    rank (FAILED_PRECONDITION naming the stale rank) and rolls every rank back."""
    clients = [connect(daemon) for _ in range(2)]

    def first(r):
        _start(clients[r], group, r)
        views = clients[r].shard_views("")
        _write(views, 1, r)
        assert clients[r].commit("") == 1
        _write(views, 2, r)

    run_ranks(2, first)
    clients[1].close()
    with pytest.raises(flatshard.UnavailableError):
        clients[0].commit("")
    back = connect(daemon)
    back.join(group, 2, 1)
    back.register("", mlp_manifest(), MLP_POLICY, init="from_every_rank")  # reads its views
    now = [clients[0], back]  # rank 0 does not read its views again
    errors = [None, None]

    def commit(r):
        try:
            now[r].commit("")
        except flatshard.FlatshardError as exc:
            errors[r] = exc

    run_ranks(2, commit)
    for r in (0, 1):
        assert isinstance(errors[r], flatshard.FailedPreconditionError), (r, errors[r])
        assert "rank 0" in errors[r].message, errors[r].message
    for c in now:
        c.close()


def test_killed_rank_process_rolls_back(daemon, group, tmp_path):
    """Rank 1 is a process: it commits generation 1, writes generation 2's values in place
    and is SIGKILLed before committing; rank 0 wrote in place too. After rank 1 rejoins, both
    ranks' shards hold generation 1's values, never a mix."""
    script = tmp_path / "rank1.py"
    script.write_text(f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import flatshard
from test_client_commit import _start, _write
c = flatshard.Client({daemon.address!r}, call_timeout=30, join_timeout=30)
_start(c, {group!r}, 1)
views = c.shard_views("")
_write(views, 1, 1)
assert c.commit("") == 1
_write(views, 2, 1)
print("written", flush=True)
time.sleep(120)
""")
    err = open(tmp_path / "rank1.err", "w")
    proc = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        c0 = connect(daemon)
        _start(c0, group, 0)
        views = c0.shard_views("")
        _write(views, 1, 0)
        assert c0.commit("") == 1
        _write(views, 2, 0)
        ready, _, _ = select.select([proc.stdout], [], [], 60.0)
        line = proc.stdout.readline() if ready else "(nothing within 60 s)"
        assert line.strip() == "written", line + (tmp_path / "rank1.err").read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        err.close()
    with pytest.raises(flatshard.UnavailableError) as e:
        c0.commit("")
    assert "rank 1" in e.value.message
    c0.leave()  # the survivor may also leave and join again
    c1 = connect(daemon)
    regs = run_ranks(2, lambda r: ([c0, c1][r].join(group, 2, r),
                                   [c0, c1][r].register("", mlp_manifest(), MLP_POLICY,
                                                        init="from_every_rank"))[1])
    for r, reg in enumerate(regs):
        assert reg.generation == 1, (r, reg.generation)
        _assert_holds(reg.shards, 1, r, f"rank {r} at re-attach")
    c0.close()
    c1.close()


def test_commit_errors(daemon, group):
    c = connect(daemon)
    with pytest.raises(flatshard.FailedPreconditionError):
        c.commit("")  # not joined
    c.join(group, 1, 0)
    with pytest.raises(flatshard.NotFoundError) as e:
        c.commit("nope")
    assert "nope" in e.value.message
    c.close()
    with pytest.raises(flatshard.FailedPreconditionError) as e:
        c.commit("")
    assert "commit" in e.value.message and "closed" in e.value.message

    # A rank that never calls: DEADLINE_EXCEEDED naming it.
    g2 = group + "-dl"
    clients = [connect(daemon, call_timeout=2.0) for _ in range(2)]
    run_ranks(2, lambda r: _start(clients[r], g2, r))
    t0 = time.monotonic()
    with pytest.raises(flatshard.DeadlineExceededError) as e:
        clients[0].commit("")
    assert "rank 1" in e.value.message, e.value.message
    assert time.monotonic() - t0 < 20
    for cl in clients:
        cl.close()
