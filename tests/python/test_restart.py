"""A daemon restart loses nothing (README "Restarts"): flatshardd with --state_dir is killed
with SIGKILL (or stopped with SIGTERM, --keep_shards) after commits, with in-place writes not
committed on top, and started again with the same state directory; every rank re-joins,
re-registers and finds the last committed generation, bit for bit, through the Python
client."""

import os

import pytest
import torch

import flatshard
from conftest import MLP_POLICY, connect, mlp_manifest, run_ranks


def _value(generation, rank, unit):
    return float(1000 * generation + 10 * rank + unit + 1)


def _train(clients, group, generations, first=True):
    def rank(r):
        c = clients[r]
        if first:
            c.join(group, 2, r)
            reg = c.register("", mlp_manifest(), MLP_POLICY, init="zeros")
            assert reg.generation == 0
        for g in generations:
            for v in c.shard_views(""):
                v.shard.fill_(_value(g, r, v.unit))
            assert c.commit("") == g
        # An optimizer step that is never committed: a restart must not keep it.
        for v in c.shard_views(""):
            v.shard.fill_(-1.0)

    run_ranks(2, rank)


def _reattach(daemon, group, generation):
    clients = [connect(daemon) for _ in range(2)]

    def rank(r):
        c = clients[r]
        c.join(group, 2, r)
        reg = c.register("", mlp_manifest(), MLP_POLICY, init="zeros")
        assert reg.generation == generation
        views = c.shard_views("")
        assert views.generation == generation
        for v in views:
            want = torch.full((v.shard_numel,), _value(generation, r, v.unit))
            assert torch.equal(v.shard, want), f"rank {r} unit {v.unit}: {v.shard}"
        assert c.commit("") == generation + 1  # and training goes on
        c.leave()

    run_ranks(2, rank)
    for c in clients:
        c.close()


@pytest.mark.parametrize("sigterm", [False, True], ids=["kill9", "sigterm"])
def test_restart_keeps_the_committed_shards(tmp_path, group, sigterm):
    state = tmp_path / "state"
    with flatshard.testing.LocalDaemon(extra_args=(f"--state_dir={state}",)) as d:
        clients = [connect(d) for _ in range(2)]
        _train(clients, group, [1, 2, 3])
        for c in clients:
            if sigterm:
                c.leave()
            c.close()
        d.restart(sigterm=sigterm)
        assert d.segments(), "the shards stay in /dev/shm"
        _reattach(d, group, 3)
    assert oct(os.stat(state).st_mode & 0o777) == "0o700"


def test_without_a_state_dir_a_restart_loses_the_shards(group):
    with flatshard.testing.LocalDaemon() as d:
        clients = [connect(d) for _ in range(2)]
        _train(clients, group, [1])
        for c in clients:
            c.close()
        d.restart()
        c = connect(d)
        c.join(group, 1, 0)
        assert c.registered_modules == []
        c.close()
