"""The rest of FSDP's training recipe through flatshard.torch: gradient accumulation with
no_sync(), gradient clipping, and activation checkpointing (torch.utils.checkpoint, re-entrant
or not) around or inside wrapped units. Ranks are threads, each with its own Client, on one flatshardd per test.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_recipe.py
"""
import math
import threading

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy, summon_full_params
from torch.utils.checkpoint import checkpoint
from conftest import run_group

WORLD = 2
MICRO_BATCHES = 4
_RNG = threading.Lock()


class Net(nn.Module):
    """Three units with ModuleWrapPolicy({nn.Linear}): fc1, fc2 and the root (none left)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def net():
    with _RNG:  # ranks are threads: take turns with torch's global generator
        torch.manual_seed(0)
        return Net()


def micro_batch(rank, k):
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(5, 4, generator=g)


class CountingClient:
    """The rank's client, counting the reduce-scatters the wrapper starts."""

    def __init__(self, client):
        self._client = client
        self.reduce_scatters = 0

    def begin_reduce_scatter(self, *args, **kwargs):
        self.reduce_scatters += 1
        return self._client.begin_reduce_scatter(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def grads_after(daemon, use_no_sync):
    """Every rank's sharded gradients after MICRO_BATCHES backward passes (the first ones
    inside no_sync() when use_no_sync), and the reduce-scatters each pass started."""

    def fn(rank, c):
        model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        counting = CountingClient(model._client)
        model._client = counting
        started = []
        for k in range(MICRO_BATCHES):
            last = k == MICRO_BATCHES - 1
            before = counting.reduce_scatters
            if use_no_sync and not last:
                with model.no_sync():
                    model(micro_batch(rank, k)).square().sum().backward()
                assert all(p.grad is None for p in model.sharded_parameters()), \
                    "no_sync() changed a sharded gradient"
            else:
                model(micro_batch(rank, k)).square().sum().backward()
            started.append(counting.reduce_scatters - before)
        return [p.grad.clone() for p in model.sharded_parameters()], started

    return run_group(daemon.address, WORLD, fn)


def test_no_sync_accumulates_locally_and_reduce_scatters_once(daemon):
    plain = grads_after(daemon, use_no_sync=False)
    synced = grads_after(daemon, use_no_sync=True)
    for rank in range(WORLD):
        want, every_pass = plain[rank]
        got, passes = synced[rank]
        units = every_pass[0]
        assert units > 0 and every_pass == [units] * MICRO_BATCHES
        # No collective inside no_sync(); the synced backward reduces each unit once.
        assert passes == [0] * (MICRO_BATCHES - 1) + [units]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            # The same sums in another order: equal to float32 round-off.
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()


def test_no_sync_is_refused_inside_a_forward_backward(daemon):
    def fn(rank, c):
        model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        out = model(micro_batch(rank, 0))
        with pytest.raises(AssertionError, match="no_sync: called inside"):
            with model.no_sync():
                pass
        out.sum().backward()  # the step goes on as if nothing happened
        return all(p.grad is not None for p in model.sharded_parameters())

    assert all(run_group(daemon.address, WORLD, fn).values())


# ------------------------------------------------------------------ activation checkpointing
class Block(nn.Module):
    """A wrapped unit (ModuleWrapPolicy({Block})); with `inside`, its first layer runs under
    torch.utils.checkpoint and its second does not (the unit's gradients then arrive in two
    parts, both reduce-scattered)."""

    def __init__(self, inside, reentrant):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.inside, self.reentrant = inside, reentrant

    def forward(self, x):
        h = checkpoint(self.fc, x, use_reentrant=self.reentrant) if self.inside else self.fc(x)
        return x + self.out(torch.tanh(h))


class Tower(nn.Module):
    """`where`: None (no checkpointing), "around" (each wrapped block runs under
    torch.utils.checkpoint) or "inside" (each block checkpoints its layer)."""

    def __init__(self, where, reentrant):
        super().__init__()
        self.blocks = nn.ModuleList([Block(where == "inside", reentrant) for _ in range(3)])
        self.head = nn.Linear(8, 1)
        self.around, self.reentrant = where == "around", reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant) if self.around else b(x)
        return self.head(x)


def tower_grads(daemon, where, reentrant):
    def fn(rank, c):
        with _RNG:
            torch.manual_seed(0)
            module = Tower(where, reentrant)
        model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy({Block}))
        g = torch.Generator().manual_seed(rank)
        # Re-entrant checkpointing needs an input that requires grad.
        x = torch.randn(4, 8, generator=g, requires_grad=True)
        model(x).square().sum().backward()
        return [p.grad.clone() for p in model.sharded_parameters()], x.grad.clone()

    return run_group(daemon.address, WORLD, fn)


@pytest.mark.parametrize("where", ["around", "inside"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_gradients(daemon, where, reentrant):
    # The recomputation calls the unit (around) or one of its layers (inside) again during
    # backward: the unit is summoned again, and re-entrant checkpointing's own backward
    # reaches the unit's reduce-scatter.
    want = tower_grads(daemon, None, reentrant)
    got = tower_grads(daemon, where, reentrant)
    for rank in range(WORLD):
        (g_params, g_x), (w_params, w_x) = got[rank], want[rank]
        assert len(g_params) == len(w_params) > 0
        for g, w in zip(g_params, w_params):
            assert torch.equal(g, w)  # the same ops in the same order: bit for bit
        assert torch.equal(g_x, w_x)


# ------------------------------------------------------------------ gradient clipping
def reference_clipped(max_norm, norm_type):
    """A single process: the rank-averaged gradients of one backward (the wrapper's "avg"
    reduce), clipped by torch.nn.utils.clip_grad_norm_. Returns (total norm, grads by name)."""
    grads = {}
    for rank in range(WORLD):
        plain = net()
        plain(micro_batch(rank, 0)).square().sum().backward()
        for name, p in plain.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad / WORLD
    plain = net()
    for name, p in plain.named_parameters():
        p.grad = grads[name].clone()
    total = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    return total, {name: p.grad for name, p in plain.named_parameters()}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "no_clip"])
def test_clip_grad_norm_matches_torch_on_the_averaged_gradients(daemon, max_norm, norm_type):
    want_total, want = reference_clipped(max_norm, norm_type)

    def fn(rank, c):
        model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                use_orig_params=True)
        model(micro_batch(rank, 0)).square().sum().backward()
        total = model.clip_grad_norm_(max_norm, norm_type)
        with summon_full_params(model, writeback=False, with_grads=True):
            grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        return total, grads

    got = run_group(daemon.address, WORLD, fn)
    assert torch.equal(got[0][0], got[1][0]), "every rank computes the same total norm"
    for total, grads in got.values():
        assert torch.allclose(total, want_total.float(), rtol=1e-5)
        assert set(grads) == set(want)
        for name in want:
            assert torch.allclose(grads[name], want[name], rtol=1e-5, atol=1e-7), name


def test_clip_grad_norm_without_gradients_is_zero_and_changes_nothing(daemon):
    def fn(rank, c):
        model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        return model.clip_grad_norm_(1.0)

    assert all(torch.equal(t, torch.tensor(0.0))
               for t in run_group(daemon.address, WORLD, fn).values())


class CollectiveCounter:
    """The rank's client, counting the all-reduces and summons the wrapper makes."""

    def __init__(self, client):
        self._client = client
        self.all_reduces = 0
        self.summons = 0

    def all_reduce(self, *args, **kwargs):
        self.all_reduces += 1
        return self._client.all_reduce(*args, **kwargs)

    def summon(self, *args, **kwargs):
        self.summons += 1
        return self._client.summon(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_clip_grad_norm_is_one_all_reduce_and_equals_the_gathered_norm(daemon, norm_type):
    def fn(rank, c):
        model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        model(micro_batch(rank, 0)).square().sum().backward()
        # The norm of the full gradients, gathered (what clip_grad_norm_ did before).
        with summon_full_params(model, writeback=False, with_grads=True):
            full = [p.grad.clone() for p in model.module.parameters()]
        gathered = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in full]), norm_type)
        counter = CollectiveCounter(model._client)
        model._client = counter
        total = model.clip_grad_norm_(1e6, norm_type)
        return total, gathered, counter.all_reduces, counter.summons

    got = run_group(daemon.address, WORLD, fn)
    assert torch.equal(got[0][0], got[1][0]), "bit-identical on every rank"
    for total, gathered, all_reduces, summons in got.values():
        assert (all_reduces, summons) == (1, 0)  # one collective, no gradient gathered
        assert total.dtype == torch.float32
        assert torch.allclose(total, gathered.float(), rtol=1e-6)
