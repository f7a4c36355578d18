"""FlatShardModule(sharding_strategy=...): FSDP's strategies through flatshard.torch. Ranks are
threads, each with its own Client, on one flatshardd per test.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_strategies.py
"""
import enum
import json
import threading

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy, ShardingStrategy
from torch.utils.checkpoint import checkpoint
from conftest import run_group

WORLD = 2
STEPS = 3
_RNG = threading.Lock()


class Block(nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ckpt = ckpt

    def forward(self, x):
        h = checkpoint(self.fc, x, use_reentrant=False) if self.ckpt else self.fc(x)
        return x + torch.tanh(h)


class Tower(nn.Module):
    """Three wrapped blocks and a head in the root unit; `twice` runs block 0 twice per
    forward (a unit used again inside one step)."""

    def __init__(self, ckpt=False, twice=False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(ckpt) for _ in range(3)])
        self.head = nn.Linear(8, 1)
        self.twice = twice

    def forward(self, x):
        if self.twice:
            x = self.blocks[0](x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tower(**kw):
    with _RNG:  # ranks are threads: take turns with torch's global generator
        torch.manual_seed(0)
        return Tower(**kw)


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 8, generator=g)


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def train(daemon, strategy, **kw):
    """Every rank's sharded parameters and gradients after STEPS committed SGD steps, the
    summons each step made and the policy sent."""

    def fn(rank, c):
        model = FlatShardModule(tower(**kw), c, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                sharding_strategy=strategy, backward_prefetch=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        summons = []
        for step in range(STEPS):
            before = model.prefetch_stats["summons"]
            opt.zero_grad()
            model(batch(rank, step)).square().sum().backward()
            summons.append(model.prefetch_stats["summons"] - before)
            model.step(opt)
        return ([p.detach().clone() for p in model.sharded_parameters()],
                [p.grad.clone() for p in model.sharded_parameters()], summons,
                json.loads(model.policy_json)["sharding_strategy"], len(model._units),
                model.state_dict())

    return run_group(daemon.address, WORLD, fn)


@pytest.mark.parametrize("kw", [{}, {"ckpt": True}, {"twice": True}],
                         ids=["plain", "checkpointed", "unit_twice"])
def test_shard_grad_op_equals_full_shard_with_one_all_gather_per_unit(daemon, kw):
    full = train(daemon, "FULL_SHARD", **kw)
    zero2 = train(daemon, ShardingStrategy.SHARD_GRAD_OP, **kw)
    for rank in range(WORLD):
        f_params, f_grads, f_summons, f_policy, units, _ = full[rank]
        z_params, z_grads, z_summons, z_policy, _, _ = zero2[rank]
        assert (f_policy, z_policy) == ("FULL_SHARD", "SHARD_GRAD_OP")
        for a, b in zip(f_params + f_grads, z_params + z_grads):
            assert torch.equal(a, b)  # the same values computed in the same order
        if kw.get("ckpt"):
            # The recomputation in backward finds the kept forward summon: no summon more.
            assert z_summons == [units] * STEPS
        elif kw.get("twice"):
            # Block 0 runs twice: FULL_SHARD summons it again, SHARD_GRAD_OP keeps it.
            assert f_summons == [2 * units] * STEPS
            assert z_summons == [units] * STEPS
        else:
            # FULL_SHARD: every unit once for its forward and once for its backward but
            # block 0, whose backward needs none of its parameters (its input needs no
            # gradient, so autograd saved no view of its weight), and the root, whose forward
            # summon stays for its backward (as FSDP's root).
            assert f_summons == [2 * units - 2] * STEPS
            assert z_summons == [units] * STEPS


def test_shard_grad_op_forward_without_backward_releases_the_units(daemon):
    def fn(rank, c):
        model = FlatShardModule(tower(), c, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                sharding_strategy="shard_grad_op")
        with torch.no_grad():
            want = model(batch(rank, 0))
        assert not model._kept  # no_grad: nothing is kept for a backward
        out = model(batch(rank, 0))
        assert len(model._kept) == len(model._units)  # every unit, the root's too
        out.sum().backward()
        assert not model._kept and not model._bwd and not model._fwd
        # A forward whose backward never runs: the next forward drops what it kept.
        model(batch(rank, 1))
        got = model(batch(rank, 0))
        got.sum().backward()
        return torch.equal(want, got.detach())

    assert all(run_group(daemon.address, WORLD, fn).values())


class TorchLike(enum.Enum):
    """Stands in for torch.distributed.fsdp.ShardingStrategy (torch 1.13's FSDP does not
    import on Python 3.11): accepted by name."""
    FULL_SHARD = 1
    SHARD_GRAD_OP = 2


def test_strategy_arguments_are_resolved_by_name_and_bad_ones_named(daemon):
    def fn(rank, c):
        with pytest.raises(ValueError, match="sharding_strategy: 'ZERO3' is not one of"):
            FlatShardModule(tower(), c, sharding_strategy="ZERO3")
        model = FlatShardModule(tower(), c, sharding_strategy=TorchLike.SHARD_GRAD_OP)
        return model.sharding_strategy, json.loads(model.policy_json)["sharding_strategy"]

    for got in run_group(daemon.address, WORLD, fn).values():
        assert got == (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP")


@pytest.mark.parametrize("strategy", ["NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_daemon_strategies_train_like_full_shard(daemon, strategy):
    # NO_SHARD: every rank holds whole units, gradients all-reduced (the same float32 sums as
    # the reduce-scatter's, so equal to round-off); HYBRID_SHARD on one node shards over the
    # whole group, as FULL_SHARD. The trainer keeps units unsharded from forward to backward
    # under NO_SHARD and _HYBRID_SHARD_ZERO2.
    full = train(daemon, "FULL_SHARD")
    other = train(daemon, strategy)
    keeps = strategy in ("NO_SHARD", "_HYBRID_SHARD_ZERO2")
    for rank in range(WORLD):
        f_params, f_grads, _, _, units, f_sd = full[rank]
        o_params, o_grads, o_summons, o_policy, _, o_sd = other[rank]
        assert o_policy == ("HYBRID_SHARD" if strategy == "_HYBRID_SHARD_ZERO2" else strategy)
        assert set(o_sd) == set(f_sd)
        if strategy == "NO_SHARD":  # whole units on every rank: compare the full values
            for name, v in f_sd.items():
                assert torch.allclose(o_sd[name], v, rtol=1e-6, atol=1e-7), name
        else:
            for a, b in zip(f_params + f_grads, o_params + o_grads):
                assert torch.equal(a, b)
        if keeps:
            assert o_summons == [units] * STEPS
