"""Full optimizer state dicts (flatshard.torch.full_optim_state_dict, optim_state_dict,
optim_state_dict_to_load): keyed like the unwrapped model's optimizer, equal to a
single-process Adam's on the same data, loadable by a plain torch.optim optimizer and back
into a fresh wrapper (bit-exact afterwards), with the optimizer state in the trainer and in
the daemon (keep_optimizer_state). Ranks are threads on one flatshardd per test.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_optim_state_dict.py
"""
import copy
import threading

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import (FlatShardModule, ModuleWrapPolicy, full_optim_state_dict,
                             keep_optimizer_state, optim_state_dict, optim_state_dict_to_load)
from conftest import run_group

WORLD = 2
STEPS, MORE = 3, 2
LR = 0.01
_RNG = threading.Lock()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 15)  # 75 + 15: units whose shards split parameters
        self.fc2 = nn.Linear(15, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def net():
    with _RNG:  # ranks are threads: take turns with torch's global generator
        torch.manual_seed(0)
        return Net()


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 4, generator=g)


def reference_step(plain, opt, step):
    """One single-process step on every rank's batch, averaged (the wrapper's "avg")."""
    opt.zero_grad()
    loss = sum(plain(batch(r, step)).square().sum() for r in range(WORLD)) / WORLD
    loss.backward()
    opt.step()


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def wrapped(c, name, orig, keep):
    model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                            use_orig_params=orig, name=name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if keep:
        keep_optimizer_state(opt, model)
    return model, opt


def train(model, opt, rank, steps):
    for step in steps:
        opt.zero_grad()
        model(batch(rank, step)).square().sum().backward()
        model.step(opt)


@pytest.mark.parametrize("keep", [False, True], ids=["trainer_state", "daemon_state"])
@pytest.mark.parametrize("orig", [False, True], ids=["flat_params", "orig_params"])
def test_full_optim_state_dict_round_trips(daemon, orig, keep):
    def fn(rank, c):
        model, opt = wrapped(c, "a", orig, keep)
        train(model, opt, rank, range(STEPS))
        rank0 = full_optim_state_dict(model, opt)  # rank0_only=True
        osd = FlatShardModule.optim_state_dict(model, opt)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, rank, range(STEPS, STEPS + MORE))
        final_a = [p.detach().clone() for p in model.sharded_parameters()]
        full_a = {k: v.clone() for k, v in model.state_dict().items()}
        # A fresh wrapper loads the model and the optimizer state, and continues bit-exact.
        fresh, fresh_opt = wrapped(c, "b", orig, keep)
        fresh.load_state_dict(sd)
        fresh_opt.load_state_dict(optim_state_dict_to_load(fresh, fresh_opt, osd))
        train(fresh, fresh_opt, rank, range(STEPS, STEPS + MORE))
        final_b = [p.detach().clone() for p in fresh.sharded_parameters()]
        return rank0, osd, sd, full_a, final_a, final_b

    got = run_group(daemon.address, WORLD, fn)
    assert got[1][0] == {}, "rank0_only: the other ranks get an empty dict"
    assert set(got[0][0]["state"]) == set(got[0][1]["state"])

    plain = net()
    ref_opt = torch.optim.Adam(plain.parameters(), lr=LR)
    for step in range(STEPS):
        reference_step(plain, ref_opt, step)
    want = ref_opt.state_dict()
    for rank in range(WORLD):
        osd = got[rank][1]
        assert osd["param_groups"] == want["param_groups"]
        assert set(osd["state"]) == set(want["state"]) == {0, 1, 2, 3}
        for i, st in want["state"].items():
            assert set(osd["state"][i]) == set(st)
            assert torch.equal(osd["state"][i]["step"], st["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                assert osd["state"][i][name].shape == st[name].shape
                assert torch.allclose(osd["state"][i][name], st[name], rtol=1e-4, atol=1e-7), \
                    (i, name, (osd["state"][i][name] - st[name]).abs().max())
        # Every rank's dict is the same, bit for bit.
        for i, st in osd["state"].items():
            for name, v in st.items():
                assert torch.equal(v, got[0][1]["state"][i][name])
        # Back into a fresh wrapper: the same steps give the same shards, bit for bit.
        for a, b in zip(got[rank][4], got[rank][5]):
            assert torch.equal(a, b)

    # A plain optimizer on the unwrapped model loads it and continues like the wrapper.
    plain = net()
    plain.load_state_dict(got[0][2])
    plain_opt = torch.optim.Adam(plain.parameters(), lr=LR)
    plain_opt.load_state_dict(got[0][1])
    for step in range(STEPS, STEPS + MORE):
        reference_step(plain, plain_opt, step)
    for name, v in plain.state_dict().items():
        assert torch.allclose(v, got[0][3][name], rtol=1e-5, atol=1e-6), name


def test_loaded_state_survives_another_rank_registering_first(daemon):
    # Optimizer state in the daemon, loaded into a fresh wrapper: rank 1's first step
    # registers the state spec before rank 0's first step. Rank 0's loaded state must go to
    # the daemon, not be replaced by the daemon's fresh zeros (CI saw this order by chance).
    registered = threading.Event()

    def fn(rank, c):
        model, opt = wrapped(c, "a", True, True)
        train(model, opt, rank, range(STEPS))
        osd = FlatShardModule.optim_state_dict(model, opt)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, rank, range(STEPS, STEPS + MORE))
        final_a = [p.detach().clone() for p in model.sharded_parameters()]
        fresh, fresh_opt = wrapped(c, "b", True, True)
        fresh.load_state_dict(sd)
        fresh_opt.load_state_dict(optim_state_dict_to_load(fresh, fresh_opt, osd))
        for step in range(STEPS, STEPS + MORE):
            fresh_opt.zero_grad()
            fresh(batch(rank, step)).square().sum().backward()
            if step == STEPS and rank == 0:
                assert registered.wait(60), "rank 1 never stepped"
            fresh_opt.step()
            if step == STEPS and rank == 1:
                registered.set()
            fresh.commit()
        final_b = [p.detach().clone() for p in fresh.sharded_parameters()]
        return final_a, final_b

    for rank, (final_a, final_b) in run_group(daemon.address, WORLD, fn).items():
        for a, b in zip(final_a, final_b):
            assert torch.equal(a, b), rank


def test_a_plain_optimizers_state_dict_loads_into_the_wrapper(daemon):
    # Trained in one process, continued sharded: the same values as continuing in one process.
    plain = net()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=LR)
    for step in range(STEPS):
        reference_step(plain, plain_opt, step)
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    osd = copy.deepcopy(plain_opt.state_dict())  # state_dict() holds the live tensors
    for step in range(STEPS, STEPS + MORE):
        reference_step(plain, plain_opt, step)

    def fn(rank, c):
        model, opt = wrapped(c, "", False, False)
        model.load_state_dict(sd)
        opt.load_state_dict(optim_state_dict_to_load(model, opt, osd))
        train(model, opt, rank, range(STEPS, STEPS + MORE))
        return model.state_dict()

    for got in run_group(daemon.address, WORLD, fn).values():
        for name, v in plain.state_dict().items():
            assert torch.allclose(got[name], v, rtol=1e-5, atol=1e-6), name


def test_ranks_with_different_optimizer_state_are_named(daemon):
    def fn(rank, c):
        model, opt = wrapped(c, "", False, False)
        if rank == 0:  # only rank 0's optimizer has state
            train_grads = [p for p in model.sharded_parameters()]
            for p in train_grads:
                p.grad = torch.zeros_like(p)
            opt.step()
        with pytest.raises(ValueError, match="the ranks' optimizers hold different state"):
            full_optim_state_dict(model, opt)
        return True

    assert all(run_group(daemon.address, WORLD, fn).values())
