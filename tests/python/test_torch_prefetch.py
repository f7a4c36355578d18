"""Forward and backward prefetch (FSDP's forward_prefetch, BackwardPrefetch): the next unit's
all-gather is started while this unit computes. Training with prefetch on must give the very
same parameters as with it off, also with no_sync() accumulation, activation checkpointing and
a forward order that changes between iterations. Ranks are threads, each with its own Client,
on one flatshardd per test.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_prefetch.py
"""
import threading
import time
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


def _rpcs(metrics_url):
    """flatshard_rpcs_total by method (every status code summed)."""
    import re
    import urllib.request
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^flatshard_rpcs_total\{([^}]*)\} (\S+)$', text, re.M):
        method = re.search(r'method="([^"]+)"', m.group(1)).group(1)
        out[method] = out.get(method, 0) + float(m.group(2))
    return out


@pytest.mark.parametrize("config", ["off", "backward_pre", "forward_and_backward_pre"])
def test_one_round_trip_per_unit_transition(tmp_path, config):
    """A unit's End rides on the next unit's Summon RPC (end_first): in steady state a step
    makes one Summon RPC per unit summoned and EndSummon RPCs only for the units still open
    when the backward ends, counted by the daemon's own metrics. The backward prefetches
    only the units the first backward used (block 0's weights are not needed in backward)."""
    addr_file = tmp_path / "metrics.addr"
    steps = 3
    with flatshard.testing.LocalDaemon(extra_args=[
            "--metrics_address=127.0.0.1:0", f"--metrics_address_file={addr_file}"]) as d:
        for _ in range(500):  # written once the endpoint listens
            if addr_file.exists() and addr_file.read_text().strip():
                break
            time.sleep(0.01)
        url = f"http://{addr_file.read_text().strip()}/metrics"
        counts = {}

        def fn(rank, c):
            with _RNG:
                torch.manual_seed(0)
                module = Tower()
            model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    **CONFIGS[config])
            opt = torch.optim.SGD(model.sharded_parameters(), lr=0.1)
            barrier.wait()
            for step in range(steps + 1):
                if step == 1:  # the first iteration records the order: count from here
                    if barrier.wait() == 0:
                        counts["before"] = _rpcs(url)
                    barrier.wait()
                opt.zero_grad(set_to_none=True)
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
            if barrier.wait() == 0:
                counts["after"] = _rpcs(url)
            barrier.wait()
            return model.prefetch_stats

        barrier = threading.Barrier(WORLD)
        stats = run_group(d.address, WORLD, fn)
    before, after = counts["before"], counts["after"]
    per_step = {k: (after.get(k, 0) - before.get(k, 0)) / (steps * WORLD)
                for k in ("Summon", "EndSummon")}
    # Forward: the root and four blocks; backward: blocks 3..1 (block 0's input needs no
    # gradient, so its weights are not needed again; the root's forward summon stays open
    # for its backward, as FSDP's root).
    summons_per_step = 8
    assert all(s["summons"] == summons_per_step * (steps + 1) for s in stats.values()), stats
    assert per_step["Summon"] == summons_per_step, per_step
    # EndSummon only for the units open when the backward ends (nothing follows to ride on):
    # the root, whose gradients complete last, and the last blocks (two with BACKWARD_PRE,
    # whose prefetch ran ahead of their releases); 9 before end_first.
    assert per_step["EndSummon"] <= (2 if config == "off" else 3), per_step
