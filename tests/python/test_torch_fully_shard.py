"""flatshard.torch.fully_shard (FSDP2's entry point over FlatShardModule) and FlatShardModule's
own retry of a register the daemon refuses with UNAVAILABLE "... register again". Ranks are
threads, each with its own Client, on one flatshardd per test.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_fully_shard.py
"""
import threading
import uuid

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import (FlatShardModule, MixedPrecision, MixedPrecisionPolicy,
                             ModuleWrapPolicy, ShardingStrategy, fully_shard,
                             summon_full_params)
from conftest import run_group
from small_torch_models import Block, Net, batch

WORLD = 2
STEPS = 3
_RNG = threading.Lock()


def net():
    with _RNG:  # ranks are threads: Net() seeds torch's global generator
        return Net()


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def train(model, opt, rank, step_fn, named=()):
    """STEPS committed SGD steps; the losses, then the parameters and gradients of `named`
    ((fqn, parameter) pairs), in fqn order."""
    losses = []
    for step in range(STEPS):
        x, y = batch(10 * rank + step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        losses.append(loss.detach().clone())
        step_fn(opt)
    named = sorted(named, key=lambda np: np[0])
    params = [p.detach().clone() for _, p in named]
    grads = [p.grad.clone() for _, p in named]
    return losses, params, grads


def with_fully_shard(daemon, reshard, mp_policy=None):
    def fn(rank, c):
        model = net()
        before = [id(p) for p in model.parameters()]
        for b in model.blocks:
            assert fully_shard(b, reshard_after_forward=reshard, mp_policy=mp_policy) is b
        assert fully_shard(model, client=c, reshard_after_forward=reshard,
                           mp_policy=mp_policy) is model
        assert isinstance(model, Net) and type(model).__name__ == "FlatShardNet"
        assert [id(p) for p in model.parameters()] == before  # the same Parameter objects
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        out = train(model, opt, rank, model.step, list(model.named_parameters()))
        assert len(out[1]) == 12 and model.generation == STEPS
        full = model.flatshard.state_dict()
        with summon_full_params(model):  # the root itself names its wrapper
            assert torch.equal(model.blocks[0].fc.weight, full["blocks.0.fc.weight"])
        own = model.state_dict()  # the module's own: this rank's 1-D parts
        assert torch.equal(own["inp.weight"], model.inp.weight.detach().reshape(-1))
        return out + ([u.path for u in model.flatshard._units],
                      model.flatshard.sharding_strategy, model.flatshard.state_dict())

    return run_group(daemon.address, WORLD, fn)


def with_wrapper(daemon, strategy, mixed_precision=None):
    def fn(rank, c):
        model = FlatShardModule(net(), c, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                use_orig_params=True, sharding_strategy=strategy,
                                mixed_precision=mixed_precision)
        opt = torch.optim.SGD(model.sharded_parameters(), lr=0.1, momentum=0.9)
        out = train(model, opt, rank, model.step, model.named_sharded_parameters())
        return out + ([u.path for u in model._units], model.sharding_strategy,
                      model.state_dict())

    return run_group(daemon.address, WORLD, fn)


def assert_same(a, b):
    for rank in range(WORLD):
        (a_loss, a_params, a_grads, a_units, a_strategy, a_sd) = a[rank]
        (b_loss, b_params, b_grads, b_units, b_strategy, b_sd) = b[rank]
        assert (a_units, a_strategy) == (b_units, b_strategy)
        assert a_units == ["", "blocks.0", "blocks.1"]
        for x, y in zip(a_loss + a_params + a_grads, b_loss + b_params + b_grads):
            assert x.dtype == y.dtype and torch.equal(x, y)  # bit for bit
        assert list(a_sd) == list(b_sd)
        assert all(torch.equal(a_sd[k], b_sd[k]) for k in a_sd)


@pytest.mark.parametrize("reshard,strategy", [(True, ShardingStrategy.FULL_SHARD),
                                              (False, ShardingStrategy.SHARD_GRAD_OP)],
                         ids=["reshard", "no_reshard"])
def test_fully_shard_trains_as_flat_shard_module_bit_for_bit(daemon, reshard, strategy):
    assert_same(with_fully_shard(daemon, reshard), with_wrapper(daemon, strategy))


def test_fully_shard_mixed_precision_policy_as_mixed_precision(daemon):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    same = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                          cast_forward_inputs=True, _module_classes_to_ignore=())
    a = with_fully_shard(daemon, True, mp)
    assert_same(a, with_wrapper(daemon, ShardingStrategy.FULL_SHARD, same))
    assert all(p.dtype == torch.float32 for p in a[0][1])  # float32 shards for the optimizer


class NoClient:
    """Stands where a client goes: any use of it fails the test (nothing may reach it)."""

    def __getattr__(self, name):
        raise AssertionError(f"the client was used ({name}) by a call that must refuse first")


class CPUOffloadPolicy:
    pass


@pytest.mark.parametrize("kwargs,field", [
    ({"reshard_after_forward": 2}, "reshard_after_forward"),
    ({"mesh": object()}, "mesh"),
    ({"shard_placement_fn": lambda p: None}, "shard_placement_fn"),
    ({"offload_policy": CPUOffloadPolicy()}, "offload_policy"),
    ({"ignored_params": {nn.Parameter(torch.zeros(1))}}, "ignored_params"),
    ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                        output_dtype=torch.float32)}, "output_dtype"),
    ({"mp_policy": "bf16"}, "mp_policy"),
    ({"auto_wrap_policy": None}, "auto_wrap_policy"),
    ({"name": "x"}, "name"),  # FlatShardModule's arguments: the root's call only
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_arguments_are_refused_naming_them_and_nothing_changes(kwargs, field):
    model = net()
    for target in (model.blocks[0], model):
        with pytest.raises((ValueError, TypeError)) as e:
            fully_shard(target, **kwargs)
        assert field in str(e.value)
        if field != "name":
            with pytest.raises((ValueError, TypeError), match=field):
                fully_shard(target, client=NoClient(), **kwargs)
        assert "_flatshard_fully_shard" not in target.__dict__
        assert type(target) in (Block, Net) and not target._forward_pre_hooks
    assert "_flatshard_fully_shard" not in model.blocks[0].__dict__


def test_misuses_are_refused_before_anything_registers():
    model = net()
    with pytest.raises(TypeError, match="one nn.Module"):
        fully_shard(list(model.blocks))
    fully_shard(model.blocks[0], reshard_after_forward=False)
    with pytest.raises(ValueError, match="already"):
        fully_shard(model.blocks[0])
    # Units and root must agree: one strategy per registered model; checked before the
    # client is used.
    with pytest.raises(ValueError, match=r"reshard_after_forward is False on blocks\.0"):
        fully_shard(model, client=NoClient())
    assert type(model) is Net
    # A marked unit that no root registered refuses to run locally, unsharded.
    with pytest.raises(RuntimeError, match="no root registered it"):
        model(batch(0)[0])
    other = net()
    fully_shard(other.blocks[1], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"mp_policy of blocks\.1"):
        fully_shard(other, client=NoClient())


def test_only_the_outermost_call_registers(daemon):
    def fn(rank, c):
        model = net()
        fully_shard(model.blocks[0], client=c, name="blocks.0")
        with pytest.raises(ValueError, match="only the outermost"):
            fully_shard(model, client=c)
        with pytest.raises(ValueError, match="inside a model registered already"):
            fully_shard(model.blocks[0].fc)
        assert type(model) is Net
        assert list(c.registered_modules) == [] or "" not in c.registered_modules
        return type(model.blocks[0]).__name__

    assert run_group(daemon.address, 1, fn) == {0: "FlatShardBlock"}


# ---------------------------------------------------------------- re-register retry (issue 22)
AGAIN = ('group g: module "" is being rolled back to its committed generation; '
         'register again')


class Refusing:
    """A joined flatshard.Client whose next `refusals` registers are refused as the daemon
    refuses them while a re-formed group rolls the module back (the refusal changes nothing
    in the daemon; the real register runs after them)."""

    def __init__(self, client, refusals, message=AGAIN):
        self._c = client
        self.refusals = refusals
        self.message = message
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._c, name)

    def register(self, *args, **kwargs):
        self.calls += 1
        if self.refusals > 0:
            self.refusals -= 1
            raise flatshard.UnavailableError(self.message)
        return self._c.register(*args, **kwargs)


def test_register_and_reattach_retry_a_refused_register(daemon):
    group = "t-" + uuid.uuid4().hex[:8]

    def fn(rank, c):
        client = Refusing(c, 3 if rank == 1 else 0)
        model = FlatShardModule(net(), client, auto_wrap_policy=ModuleWrapPolicy({Block}))
        assert client.calls == (4 if rank == 1 else 1)
        opt = torch.optim.SGD(model.sharded_parameters(), lr=0.1)
        train(model, opt, rank, model.step)
        # A failure later: every rank joins again and re-attaches, rank 0 refused twice.
        c.leave()
        c.join(group, WORLD, rank)
        client.refusals, client.calls = (2 if rank == 0 else 0), 0
        assert model.reattach() == STEPS
        assert client.calls == (3 if rank == 0 else 1)
        train(model, opt, rank, model.step)
        return model.generation

    assert run_group(daemon.address, WORLD, fn, group=group) == {0: 2 * STEPS, 1: 2 * STEPS}


def test_register_retry_ends_at_register_timeout_and_other_errors_are_not_retried(daemon):
    def fn(rank, c):
        always = Refusing(c, 10 ** 6)
        with pytest.raises(flatshard.UnavailableError, match="register again"):
            FlatShardModule(net(), always, register_timeout=0.2)
        other = Refusing(c, 1, "group g: rank 1 left")
        with pytest.raises(flatshard.UnavailableError, match="rank 1 left"):
            FlatShardModule(net(), other)
        assert other.calls == 1
        for bad in (0, -1.0, "60", None):
            with pytest.raises(ValueError, match="register_timeout"):
                FlatShardModule(net(), c, register_timeout=bad)
        # Nothing was registered by the refused calls: a registration now is a fresh one.
        model = FlatShardModule(net(), c)
        return model.reattached, model.generation

    assert run_group(daemon.address, 1, fn) == {0: (False, 0)}
