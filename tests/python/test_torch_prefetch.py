"""Forward and backward prefetch (FSDP's forward_prefetch, BackwardPrefetch): the next unit's
all-gather is started while this unit computes. Training with prefetch on must give the very
same parameters as with it off, also with no_sync() accumulation, activation checkpointing and
a forward order that changes between iterations. Ranks are threads, each with its own Client,
on one flatshardd per test.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_prefetch.py
"""
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import flatshard.testing
from flatshard.torch import BackwardPrefetch, FlatShardModule, ModuleWrapPolicy
from torch.utils.checkpoint import checkpoint
from conftest import run_group

WORLD = 2
STEPS = 4
_RNG = threading.Lock()

CONFIGS = {
    "off": dict(backward_prefetch=None),
    "backward_pre": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE),
    "backward_post": dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST),
    "forward_and_backward_pre": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                                     forward_prefetch=True, limit_all_gathers=True),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Tower(nn.Module):
    """Five units with ModuleWrapPolicy({Block}): four blocks and the root (the head).
    `swap_at`: from that step on, blocks 1 and 2 run in the other order. `checkpointed`:
    each block under activation checkpointing (its forward runs again in backward)."""

    def __init__(self, checkpointed=False, swap_at=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.checkpointed = checkpointed
        self.swap_at = swap_at
        self.step = 0

    def forward(self, x):
        order = [0, 1, 2, 3]
        if self.swap_at is not None and self.step >= self.swap_at:
            order = [0, 2, 1, 3]
        for i in order:
            b = self.blocks[i]
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return self.head(x)


@pytest.fixture(scope="module")
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def train(daemon, config, checkpointed=False, swap_at=None, accumulate=False):
    """Every rank's full parameters and prefetch stats after STEPS SGD steps (each of two
    micro-batches, the first inside no_sync() when `accumulate`), and the warnings raised
    (by every rank: warnings.catch_warnings is process-wide)."""

    def fn(rank, c):
        with _RNG:  # ranks are threads: take turns with torch's global generator
            torch.manual_seed(0)
            module = Tower(checkpointed, swap_at)
        model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                **CONFIGS[config])
        opt = torch.optim.SGD(model.sharded_parameters(), lr=0.1)
        for step in range(STEPS):
            module.step = step
            g = torch.Generator().manual_seed(100 * rank + step)
            xs = [torch.randn(4, 8, generator=g) for _ in range(2)]
            opt.zero_grad(set_to_none=True)
            if accumulate:
                with model.no_sync():
                    model(xs[0]).square().mean().backward()
                model(xs[1]).square().mean().backward()
            else:
                model(torch.cat(xs)).square().mean().backward()
            model.step(opt)
        with FlatShardModule.summon_full_params(model, writeback=False):
            full = {n: p.detach().clone() for n, p in module.named_parameters()}
        return full, model.prefetch_stats

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_group(daemon.address, WORLD, fn)
    return out, [str(w.message) for w in caught]


def assert_same_params(got, want):
    got, want = got[0], want[0]
    for rank in range(WORLD):
        g, w = got[rank][0], want[rank][0]
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), (rank, name)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "off"])
def test_prefetch_trains_exactly_as_without_it(daemon, config):
    want = train(daemon, "off")
    got = train(daemon, config)
    assert_same_params(got, want)
    assert not got[1], got[1]
    for rank in range(WORLD):
        off_stats, stats = want[0][rank][1], got[0][rank][1]
        assert off_stats["prefetched"] == 0
        assert stats["summons"] == off_stats["summons"], (stats, off_stats)
        if config == "backward_post":
            # A unit's backward often starts before the previous unit's reduce-scatter is
            # done: fewer prefetches, as with FSDP's BACKWARD_POST.
            assert stats["prefetched"] >= STEPS - 1, stats
        else:
            # From the second iteration on, the backward's blocks after the first (and the
            # forward's, with forward_prefetch) are prefetched.
            per_step = 3 + (4 if config == "forward_and_backward_pre" else 0)
            assert stats["prefetched"] >= (STEPS - 1) * per_step, stats


@pytest.mark.parametrize("checkpointed,accumulate", [(True, False), (False, True)],
                         ids=["activation_checkpointing", "no_sync"])
def test_prefetch_with_the_rest_of_the_recipe(daemon, checkpointed, accumulate):
    want = train(daemon, "off", checkpointed=checkpointed, accumulate=accumulate)
    got = train(daemon, "forward_and_backward_pre", checkpointed=checkpointed,
                accumulate=accumulate)
    assert_same_params(got, want)
    assert all(got[0][r][1]["prefetched"] > 0 for r in range(WORLD))


def test_a_changed_order_warns_once_and_still_trains_exactly(daemon):
    want = train(daemon, "off", swap_at=2)
    got = train(daemon, "forward_and_backward_pre", swap_at=2)
    assert_same_params(got, want)
    warned = [w for w in got[1] if "prefetching follows the first" in w]
    assert len(warned) == WORLD, got[1]  # once per rank
    assert "order [0, 1, 3, 2, 4]" in warned[0], warned[0]
