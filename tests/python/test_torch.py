"""flatshard.torch against real daemons: manifests, policies, the FULL_SHARD wrapper,
summon_full_params (every option and error), state dicts, the optimizer over the shards.

Ranks are threads here (one flatshard.Client each; every blocking call releases the GIL), on
one flatshardd process per test. test_torch_train.py runs ranks as processes.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch.py
"""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import (ERR_IN_FORWARD_BACKWARD, ERR_NESTED_SUMMON, FlatShardModule,
                             ModuleWrapPolicy, TrainingState, always_wrap_policy,
                             lambda_auto_wrap_policy, manifest_of, policy_json,
                             size_based_auto_wrap_policy, summon_full_params)

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import gpt  # noqa: E402
import run_gpt  # noqa: E402
from conftest import run_group  # noqa: E402

BATCH = 4


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def run_ranks(daemon, world, fn, timeout=120):
    """fn(rank, client) on every rank of a fresh group, as threads (conftest.run_group)."""
    return run_group(daemon.address, world, fn, timeout=timeout)


_RNG = threading.Lock()


def build_gpt():
    """gpt.build_gpt(0) seeds torch's global generator: threads (ranks) take turns."""
    with _RNG:
        return gpt.build_gpt(0)


def wrapped_gpt(client, **kw):
    kw.setdefault("auto_wrap_policy", ModuleWrapPolicy({gpt.Block}))
    return FlatShardModule(build_gpt(), client, **kw)


def train(fs, rank, world, steps, opt=None, set_to_none=True):
    opt = opt or gpt.make_optimizer(fs.sharded_parameters())
    losses = []
    for step in range(steps):
        x, y = gpt.local_batch(step, BATCH, fs.module.cfg, rank, world)
        loss = fs(x, y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def reference_grads(batch_step=0):
    """The full gradients of the reference model on the global batch of step `batch_step`."""
    m = gpt.build_gpt(0)
    x, y = gpt.global_batch(batch_step, BATCH, m.cfg)
    m(x, y).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


# ----------------------------------------------------------------------------- manifests
class Base(nn.Module):
    pass


class Leaf(Base):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Leaf()
        self.b = Leaf()
        self.shared = self.a          # a shared module: one instance at two paths
        self.frozen = nn.Linear(4, 2)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(4)
        self.dbl = nn.Linear(2, 2).double()


def test_manifest_of_records_ties_shared_modules_buffers_requires_grad_and_dtypes():
    doc = manifest_of(Net())
    root = doc["root"]
    assert doc["format"] == "flatshard.manifest/1"
    kids = {c["name"]: c["module"] for c in root["children"]}
    assert kids["shared"] == {"ref": kids["a"]["id"]}
    assert kids["a"]["type"] == "Leaf" and kids["a"]["bases"] == ["Base", "Module"]
    frozen = kids["frozen"]["params"]
    assert [p["requires_grad"] for p in frozen] == [False, False]
    assert {b["name"] for b in kids["bn"]["buffers"]} == {"running_mean", "running_var",
                                                          "num_batches_tracked"}
    assert kids["dbl"]["params"][0]["dtype"] == "float64"
    g = manifest_of(gpt.build_gpt(0))["root"]
    by = {c["name"]: c["module"] for c in g["children"]}
    assert by["lm_head"]["params"][0]["id"] == by["wte"]["params"][0]["id"]  # tied


def test_fixture_script_is_a_thin_wrapper_with_the_same_output():
    script = SOURCE_DIR / "scripts" / "fsdp_fixtures" / "flatshard_manifest.py"
    text = subprocess.run([sys.executable, str(script), "models:gpt_tied"], check=True,
                          capture_output=True, text=True, cwd=script.parent).stdout
    sys.path.insert(0, str(script.parent))
    try:
        import models
    finally:
        sys.path.pop(0)
    from flatshard.torch.manifest import dumps
    assert text == dumps(manifest_of(models.gpt_tied()))
    assert "def visit" not in script.read_text()  # one home: the logic is not copied there


# ----------------------------------------------------------------------------- policies
def plan_units(daemon, module, **kw):
    def fn(rank, c):
        fs = FlatShardModule(module, c, **kw)
        return fs.plan
    plan = run_ranks(daemon, 1, fn)[0]
    return [u["module"] for u in plan["units"]], plan


def test_policies_resolve_as_fsdp(daemon):
    m = gpt.build_gpt(0)
    units, _ = plan_units(daemon, m, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
    assert units == ["", "h.0", "h.1", "h.2"]
    # size based: every Block has 28272 params, the root's remainder 6288.
    doc = policy_json(m, size_based_auto_wrap_policy(min_num_params=20000))
    assert doc["auto_wrap"] == {"kind": "size_based", "min_num_params": 20000,
                                "force_leaf_types": ["MultiheadAttention"],
                                "exclude_wrap_types": ["ModuleDict", "ModuleList"]}
    assert plan_units(daemon, gpt.build_gpt(0),
                      auto_wrap_policy=size_based_auto_wrap_policy(min_num_params=20000))[0] \
        == ["", "h.0", "h.1", "h.2"]
    # FSDP's callable protocol, resolved to explicit paths.
    import functools
    fn = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda mod: isinstance(mod, gpt.MLP))
    assert policy_json(m, fn)["auto_wrap"] == {"kind": "explicit",
                                               "paths": ["h.0.mlp", "h.1.mlp", "h.2.mlp"]}
    assert plan_units(daemon, gpt.build_gpt(0), auto_wrap_policy=fn)[0] == \
        ["", "h.0.mlp", "h.1.mlp", "h.2.mlp"]
    assert policy_json(m, always_wrap_policy)["auto_wrap"] == {"kind": "always"}


def test_module_wrap_policy_matches_base_classes_and_ignored_modules(daemon):
    net = Net()
    units, plan = plan_units(daemon, net, auto_wrap_policy=ModuleWrapPolicy({Base}),
                             ignored_modules=[net.b, net.frozen, net.dbl])
    assert units == ["", "a"]  # Leaf matched through its base; b ignored; shared a once
    assert set(plan["ignored_params"]) == {"b.lin.weight", "b.lin.bias", "frozen.weight",
                                           "frozen.bias", "dbl.weight", "dbl.bias"}
    # A unit mixing dtypes is refused as FSDP refuses it, naming both parameters.
    with pytest.raises(flatshard.InvalidArgumentError, match="uniform dtype.*frozen.weight"):
        plan_units(daemon, Net(), auto_wrap_policy=ModuleWrapPolicy({Base}))
    with pytest.raises(ValueError, match="ignored_modules: Linear is not a submodule"):
        policy_json(net, None, [nn.Linear(1, 1)])


def test_use_orig_params_aligns_and_exposes_original_parameters(daemon):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 1)  # 3 + 1 elements
            self.b = nn.Linear(1, 1, bias=False)  # 1 element: aligned to 4 after a

    def fn(rank, c):
        fs = FlatShardModule(Odd(), c, use_orig_params=True)
        u = fs.plan["units"][0]
        offsets = [p["offset"] for p in u["params"]]
        names = [n for n, _ in fs.named_parameters()]
        shapes = [tuple(p.shape) for p in fs.sharded_parameters()]
        return offsets, names, shapes, fs.plan["units"][0]["padded_numel"]

    got = run_ranks(daemon, 2, fn)
    offsets, names, shapes, padded = got[0]
    assert offsets == [0, 4, 8] and padded == 10  # 16-byte alignment, padded to world size
    assert names == ["a.weight", "a.bias", "b.weight"]
    assert shapes == [(3,), (1,), (0,)]              # rank 0 owns [0, 5)
    assert got[1][2] == [(0,), (0,), (1,)]           # rank 1 owns [5, 10)


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_two_ranks_train_like_one_process(daemon, use_orig_params):
    steps = 3

    def fn(rank, c):
        fs = wrapped_gpt(c, use_orig_params=use_orig_params)
        losses = train(fs, rank, 2, steps)
        return losses, fs.full_state_dict()

    got = run_ranks(daemon, 2, fn)
    ref_losses, ref_sd = gpt.train_reference(steps, BATCH)
    losses = [(a + b) / 2 for a, b in zip(got[0][0], got[1][0])]
    for rank in (0, 1):  # tolerances: examples/python/run_gpt.py
        _, _, _, problems = run_gpt.compare(losses, got[rank][1], ref_losses, ref_sd)
        assert not problems, problems


def test_optimizer_steps_the_daemon_shards_in_place(daemon):
    def fn(rank, c):
        fs = wrapped_gpt(c)
        views = {s.unit: s for s in c.shard_views("")}
        params = fs.sharded_parameters()
        same_memory = [p.data_ptr() == views[i].shard.data_ptr() for i, p in enumerate(params)]
        assert all(p.grad is None for p in params)
        train(fs, rank, 2, 1)
        views = {s.unit: s for s in c.shard_views("")}
        grads_in_daemon = [p.grad is not None and p.grad.data_ptr() == views[i].grad.data_ptr()
                           for i, p in enumerate(params)]
        # set_to_none=False zeroes the gradient shards in place; the next backward adds.
        train(fs, rank, 2, 1, set_to_none=False)
        return same_memory, grads_in_daemon

    for same_memory, grads_in_daemon in run_ranks(daemon, 2, fn).values():
        assert all(same_memory) and all(grads_in_daemon)


def test_step_commits_and_generation_counts_commits(daemon):
    """model.step(opt) = opt.step() + the collective commit; model.generation follows the
    commits (writeback summons commit too) and equals the client's view of the shards."""
    def fn(rank, c):
        fs = wrapped_gpt(c)
        assert fs.generation == 0 and c.shard_views("").generation == 0
        opt = torch.optim.SGD(fs.sharded_parameters(), lr=0.1)
        got = []
        for step in range(2):
            x, y = gpt.local_batch(step, BATCH, fs.module.cfg, rank, 2)
            loss = fs(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            got.append(fs.step(opt))
        with summon_full_params(fs, writeback=True):
            with pytest.raises(AssertionError, match="inside summon_full_params"):
                fs.commit()
        got.append(fs.generation)
        with summon_full_params(fs, writeback=False):
            pass
        got.append(fs.generation)  # a read-only summon does not commit
        got.append(fs.commit())
        got.append(c.shard_views("").generation)
        return got

    assert run_ranks(daemon, 2, fn) == {0: [1, 2, 3, 3, 4, 4], 1: [1, 2, 3, 3, 4, 4]}


def test_gradients_are_the_averaged_full_gradients(daemon):
    ref = reference_grads()

    def fn(rank, c):
        fs = wrapped_gpt(c)
        x, y = gpt.local_batch(0, BATCH, fs.module.cfg, rank, 2)
        fs(x, y).backward()
        assert fs.training_state == TrainingState.IDLE
        # with_grads without use_orig_params and with offload_to_cpu: both NotImplementedError
        # in FSDP, supported by flatshard (spec/semantics.md §3).
        with summon_full_params(fs, with_grads=True, writeback=False, offload_to_cpu=True):
            return {n: p.grad.clone() for n, p in fs.module.named_parameters()}

    for grads in run_ranks(daemon, 2, fn).values():
        assert sorted(grads) == sorted(ref)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_eval_forward_under_no_grad_needs_no_backward(daemon):
    def fn(rank, c):
        fs = wrapped_gpt(c)
        x, y = gpt.local_batch(0, BATCH, fs.module.cfg, 0, 1)
        with torch.no_grad():
            a = float(fs(x, y))
        b = float(build_gpt()(x, y))
        return a, b, fs.training_state

    a, b, state = run_ranks(daemon, 2, fn)[0]
    assert a == pytest.approx(b, rel=1e-6) and state == TrainingState.IDLE


# ----------------------------------------------------------------------------- summon
def initial():
    return {k: v.clone() for k, v in gpt.build_gpt(0).state_dict().items()}


def test_summon_full_params_default_writeback_persists(daemon):
    init = initial()

    def fn(rank, c):
        fs = wrapped_gpt(c)
        # Outside a summon the parameters are this rank's 1-D part of each (FSDP's sharded
        # views): h.0's flat buffer is 28272 elements, 14136 per rank.
        assert fs.module.h[0].mlp.c_fc.weight.dim() == 1
        with summon_full_params(fs):
            w = fs.module.h[0].ln_1.weight
            assert w.shape == (48,) and isinstance(w, nn.Parameter)
            torch.testing.assert_close(w.detach(), init["h.0.ln_1.weight"])
            with torch.no_grad():
                w.add_(1.0)
                fs.module.wte.weight[0].fill_(7.0)  # tied: lm_head.weight sees it too
            assert float(fs.module.lm_head.weight[0, 0]) == 7.0
        assert fs.training_state == TrainingState.IDLE
        with summon_full_params(fs, writeback=False):
            return (fs.module.h[0].ln_1.weight.clone(), fs.module.lm_head.weight[0].clone())

    for w, head in run_ranks(daemon, 2, fn).values():
        torch.testing.assert_close(w, init["h.0.ln_1.weight"] + 1.0)
        assert torch.all(head == 7.0)


def test_summon_without_writeback_refuses_writes(daemon):
    init = initial()

    def fn(rank, c):
        fs = wrapped_gpt(c)
        with summon_full_params(fs, writeback=False):
            with pytest.raises(flatshard.ReadOnlyViewError):
                with torch.no_grad():
                    fs.module.ln_f.weight.mul_(2)
        with summon_full_params(fs, writeback=False):
            return fs.module.ln_f.weight.clone()

    for w in run_ranks(daemon, 2, fn).values():
        torch.testing.assert_close(w, init["ln_f.weight"])


def test_summon_rank0_only_and_writeback_with_rank0_only(daemon):
    """rank0_only: only rank 0 sees full parameters. writeback with rank0_only (FSDP:
    NotImplementedError; flatshard: beyond FSDP) brings rank 0's edit to every shard."""
    init = initial()

    def fn(rank, c):
        fs = wrapped_gpt(c)
        with summon_full_params(fs, rank0_only=True, writeback=False):
            shape = tuple(fs.module.h[0].mlp.c_fc.weight.shape)
        with summon_full_params(fs, rank0_only=True, writeback=True):
            if rank == 0:
                with torch.no_grad():
                    fs.module.ln_f.weight.fill_(3.0)
        with summon_full_params(fs, writeback=False):
            return shape, fs.module.ln_f.weight.clone()

    got = run_ranks(daemon, 2, fn)
    assert got[0][0] == (192, 48) and len(got[1][0]) == 1  # rank 1 keeps its shard view
    for _, w in got.values():
        assert torch.all(w == 3.0)
    assert not torch.all(init["ln_f.weight"] == 3.0)


def test_summon_offload_to_cpu_recurse_and_submodules(daemon):
    init = initial()

    def fn(rank, c):
        fs = wrapped_gpt(c)
        with summon_full_params(fs, offload_to_cpu=True, rank0_only=True, writeback=False):
            off = fs.module.h[1].mlp.c_fc.weight.clone() if rank == 0 else None
        with summon_full_params(fs, recurse=False, writeback=False):
            root_full = tuple(fs.module.wpe.weight.shape)    # the root unit
            block_sharded = fs.module.h[0].mlp.c_fc.weight.dim()  # h.0 is its own unit
        with summon_full_params(fs.module.h[2], writeback=False):
            sub_full = tuple(fs.module.h[2].mlp.c_fc.weight.shape)
            other = fs.module.h[1].mlp.c_fc.weight.dim()
        return off, root_full, block_sharded, sub_full, other

    got = run_ranks(daemon, 2, fn)
    torch.testing.assert_close(got[0][0], init["h.1.mlp.c_fc.weight"])
    for r in (0, 1):
        assert got[r][1:] == ((32, 48), 1, (192, 48), 1)


def test_summon_errors_have_fsdp_wording(daemon):
    def fn(rank, c):
        fs = wrapped_gpt(c)
        seen = []
        with summon_full_params(fs):
            with pytest.raises(AssertionError, match=ERR_NESTED_SUMMON):
                with summon_full_params(fs):
                    pass
        assert fs.training_state == TrainingState.IDLE

        def in_forward(module, args):
            with pytest.raises(AssertionError, match=ERR_IN_FORWARD_BACKWARD):
                with summon_full_params(fs):
                    pass
            seen.append("forward")

        h = fs.module.h[1].register_forward_pre_hook(in_forward)
        x, y = gpt.local_batch(0, BATCH, fs.module.cfg, rank, 2)
        loss = fs(x, y)
        h.remove()

        def in_backward(grad):
            with pytest.raises(AssertionError, match=ERR_IN_FORWARD_BACKWARD):
                with summon_full_params(fs):
                    pass
            seen.append("backward")
            return grad

        loss.register_hook(in_backward)
        loss.backward()
        with summon_full_params(fs):  # fine again after backward
            pass
        with pytest.raises(ValueError, match="is not inside a FlatShardModule"):
            with summon_full_params(nn.Linear(1, 1)):
                pass
        return seen

    for seen in run_ranks(daemon, 2, fn).values():
        assert seen == ["forward", "backward"]
    assert ERR_NESTED_SUMMON == "Cannot manually unshard parameters when already unsharding parameters"
    assert ERR_IN_FORWARD_BACKWARD == "Cannot manually unshard parameters during forward/backward"


def test_with_grads_before_any_gradient_reports_none(daemon):
    def fn(rank, c):
        fs = wrapped_gpt(c)
        with summon_full_params(fs, with_grads=True, writeback=False):
            return fs.module.ln_f.weight.grad

    assert all(g is None for g in run_ranks(daemon, 2, fn).values())


# ----------------------------------------------------------------------------- state dicts
def test_full_state_dict_loads_into_a_plain_module(daemon):
    init = initial()

    def fn(rank, c):
        fs = wrapped_gpt(c)
        full = fs.state_dict()
        r0 = fs.full_state_dict(rank0_only=True, offload_to_cpu=True)
        return full, r0

    got = run_ranks(daemon, 2, fn)
    assert got[1][1] == {}
    for sd in (got[0][0], got[1][0], got[0][1]):
        assert list(sd) == list(init)
        plain = gpt.GPT(gpt.GPTConfig())
        plain.load_state_dict(sd)  # strict
        for k in init:
            assert torch.equal(sd[k], init[k]), k


def test_load_full_state_dict_and_sharded_state_dict_round_trip(daemon):
    target = {k: v + 0.25 for k, v in initial().items()}

    def fn(rank, c):
        fs = wrapped_gpt(c)
        fs.load_state_dict(target)
        after_load = fs.full_state_dict()
        mine = fs.sharded_state_dict()
        fs.load_full_state_dict(target if rank == 0 else None, rank0_only=True)
        with torch.no_grad():
            for p in fs.sharded_parameters():
                p.zero_()
        fs.load_sharded_state_dict(mine)
        back = fs.full_state_dict()
        bad = dict(mine)
        bad["_flatshard_sharded"] = dict(mine["_flatshard_sharded"], rank=1 - rank)
        with pytest.raises(ValueError, match="rank is"):
            fs.load_sharded_state_dict(bad)
        return after_load, back, sorted(k for k in mine if k != "_flatshard_sharded")

    for after_load, back, keys in run_ranks(daemon, 2, fn).values():
        for k in target:
            torch.testing.assert_close(after_load[k], target[k])
            torch.testing.assert_close(back[k], target[k])
        assert keys == ["flat_param", "h.0.flat_param", "h.1.flat_param", "h.2.flat_param"]


def test_sync_module_states_takes_rank0_values(daemon):
    init = initial()

    def fn(rank, c):
        model = build_gpt()
        if rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(-1.0)
        fs = FlatShardModule(model, c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
                             sync_module_states=True)
        return fs.full_state_dict()

    for sd in run_ranks(daemon, 2, fn).values():
        for k in init:
            assert torch.equal(sd[k], init[k]), k


def test_wrapper_needs_a_joined_client(daemon):
    c = flatshard.Client(daemon.address)
    try:
        with pytest.raises(RuntimeError, match="has not joined"):
            FlatShardModule(gpt.build_gpt(0), c)
    finally:
        c.close()


def test_ignored_modules_stay_local_and_train(daemon):
    """As FSDP: an ignored module's parameters are ordinary full tensors of this process, in
    parameters(), with local (not averaged) gradients; the rest is sharded."""
    def fn(rank, c):
        model = build_gpt()
        fs = FlatShardModule(model, c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
                             ignored_modules=[model.h[2]])
        w = model.h[2].mlp.c_fc.weight
        names = [n for n, _ in fs.named_parameters()]
        x, y = gpt.local_batch(0, BATCH, model.cfg, rank, 2)
        fs(x, y).backward()
        return (tuple(w.shape), "h.2.mlp.c_fc.weight" in names, w.grad is not None,
                [u["module"] for u in fs.plan["units"]], fs.full_state_dict())

    got = run_ranks(daemon, 2, fn)
    for shape, listed, has_grad, units, sd in got.values():
        assert shape == (192, 48) and listed and has_grad
        assert units == ["", "h.0", "h.1"]
        assert list(sd) == list(initial())
