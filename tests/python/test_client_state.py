"""flatshard.Client.register_state against a real flatshardd: optimizer state buffers next to
each shard, as zero-copy tensors; the first spec is fixed (another one is refused naming the
state and field); a restarted client gets the same buffers and values back; state commits
and rolls back with the shards."""

import time

import pytest
import torch

import flatshard
from conftest import MLP_POLICY, connect, mlp_manifest, run_ranks

ADAM = [("exp_avg", torch.float32, "shard"), ("exp_avg_sq", "float32", "shard"),
        ("step", "float64", "scalar")]


def _start(c, group, rank, world=2):
    c.join(group, world, rank)
    return c.register("", mlp_manifest(), MLP_POLICY)


def _views_when_ready(c, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return c.shard_views("")  # with the states: registered already
        except flatshard.UnavailableError:  # a rollback in progress
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _fill(views, value):
    for v in views:
        v.state("exp_avg").fill_(value)
        v.state("exp_avg_sq").fill_(value + 0.5)
        v.state("step").fill_(value)


def _holds(views, value):
    return all(torch.all(v.state("exp_avg") == value) and
               torch.all(v.state("exp_avg_sq") == value + 0.5) and
               v.state("step").item() == value for v in views)


def test_state_views_round_trip_and_reattach(daemon, group):
    clients = [connect(daemon) for _ in range(2)]

    def rank(r):
        c = clients[r]
        reg = _start(c, group, r)
        assert reg.state_specs == []
        with pytest.raises(flatshard.InvalidArgumentError, match=r"specs\[0\]\.name"):
            c.register_state("", [("exp avg", "float32", "shard")])
        with pytest.raises(flatshard.InvalidArgumentError, match=r"specs\[0\]\.shape"):
            c.register_state("", [("m", "float32", "matrix")])
        views = c.register_state("", ADAM)
        assert views.state_specs == [("exp_avg", "float32", "shard"),
                                     ("exp_avg_sq", "float32", "shard"),
                                     ("step", "float64", "scalar")]
        for v in views:
            assert v.state_names == ["exp_avg", "exp_avg_sq", "step"]
            m = v.state("exp_avg")
            assert m.shape == (v.shard_numel,) and m.dtype == torch.float32
            assert v.state("step").shape == (1,) and v.state("step").dtype == torch.float64
            assert torch.count_nonzero(m) == 0 and v.state("step").item() == 0
            # Its own memory: not the shard's, not another state's.
            assert m.data_ptr() not in (v.shard.data_ptr(), v.state("exp_avg_sq").data_ptr())
            with pytest.raises(flatshard.NotFoundError, match="no optimizer state"):
                v.state("momentum_buffer")
        _fill(views, 1.0 + r)
        # Other views of the same buffers see the writes: shard_views, register_state again.
        assert _holds(c.shard_views(""), 1.0 + r)
        assert c.shard_views("").state_specs == views.state_specs
        assert _holds(c.register_state("", ADAM), 1.0 + r)
        # numpy views are the same memory.
        views[0].numpy_state("exp_avg")[0] = 42.0
        assert views[0].state("exp_avg")[0].item() == 42.0
        views[0].state("exp_avg")[0] = 1.0 + r
        # Committed, so that the restart below keeps it (uncommitted state rolls back).
        assert c.commit("") == 1

    run_ranks(2, rank)
    # Another spec is refused naming the state and field.
    with pytest.raises(flatshard.FailedPreconditionError, match=r'"step": dtype float32'):
        clients[0].register_state("", ADAM[:2] + [("step", "float32", "scalar")])
    # A restarted trainer (new client, same rank) re-attaches to the same values.
    clients[1].close()
    back = connect(daemon)
    back.join(group, 2, 1)
    reg = back.register("", mlp_manifest(), MLP_POLICY)
    assert [s[0] for s in reg.state_specs] == ["exp_avg", "exp_avg_sq", "step"]
    assert all(s.state_names == ["exp_avg", "exp_avg_sq", "step"] for s in reg.shards)
    assert _holds(_views_when_ready(back), 2.0)
    clients[0].close()
    back.close()


def test_state_commits_and_rolls_back_with_the_shards(daemon, group):
    clients = [connect(daemon) for _ in range(2)]
    held = [None, None]

    def first(r):
        _start(clients[r], group, r)
        views = clients[r].register_state("", ADAM)
        _fill(views, 1.0)
        for v in views:
            v.shard.fill_(1.0)
        assert clients[r].commit("") == 1
        _fill(views, 2.0)  # in place, never committed
        for v in views:
            v.shard.fill_(2.0)
        held[r] = views

    run_ranks(2, first)
    clients[1].close()
    with pytest.raises(flatshard.UnavailableError, match="rank 1"):
        clients[0].commit("")
    back = connect(daemon)
    back.join(group, 2, 1)
    reg = back.register("", mlp_manifest(), MLP_POLICY)
    assert reg.generation == 1
    now = [clients[0], back]
    for r in (0, 1):
        views = _views_when_ready(now[r])
        assert views.generation == 1
        assert _holds(views, 1.0), f"rank {r}: state not rolled back to generation 1"
        assert all(torch.all(v.shard == 1.0) for v in views)
    assert _holds(held[0], 1.0), "the views rank 0 held were not rolled back"

    def second(r):
        views = now[r].register_state("", ADAM)
        _fill(views, 3.0)
        return now[r].commit("")

    assert run_ranks(2, second) == [2, 2]
    assert _holds(now[0].shard_views(""), 3.0)
    for c in now:
        c.close()


@pytest.fixture
def gpu_daemon():
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=2",)) as d:
        yield d


def test_state_lives_on_the_ranks_gpu_and_rolls_back(gpu_daemon, group):
    """A GPU daemon (simulated: GPU code paths over host memory) allocates the state next to
    the shard, on the rank's device; commit and rollback copy it there like the shards."""
    from flatshard import _C
    clients = [flatshard.Client(gpu_daemon.address, call_timeout=30, join_timeout=30,
                                _simulated_gpus=True) for _ in range(2)]

    def rank(r):
        c = clients[r]
        _start(c, group, r)
        views = c.register_state("", ADAM)
        for v in views:
            assert v.device == r % 2
            info = _C.describe_dlpack(v._s.state_dlpack("exp_avg", True))
            assert info["device_type"] == "cuda" and info["device_id"] == r % 2, info
            assert info["shape"] == [v.shard_numel]
            assert info["data"] == v.state("exp_avg").data_ptr()
        assert all(torch.count_nonzero(v.state("exp_avg")) == 0 for v in views)
        _fill(views, 4.0)
        assert c.commit("") == 1
        _fill(views, 8.0)  # never committed

    run_ranks(2, rank)
    clients[1].close()
    with pytest.raises(flatshard.UnavailableError):
        clients[0].commit("")
    back = flatshard.Client(gpu_daemon.address, call_timeout=30, join_timeout=30,
                            _simulated_gpus=True)
    back.join(group, 2, 1)
    reg = back.register("", mlp_manifest(), MLP_POLICY)
    assert reg.generation == 1
    assert _holds(_views_when_ready(back), 4.0)
    assert _holds(_views_when_ready(clients[0]), 4.0)
    clients[0].close()
    back.close()
