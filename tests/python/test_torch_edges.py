"""flatshard.torch's sharp edges (issue 22), each against real daemons, ranks as threads:
a FlatShardModule nested in a user's module keeps the nn.Module state-dict contract; an error
inside the wrapper leaves it usable; sync_module_states broadcasts buffers too; a checkpoint
never silently misses uncommitted steps; a re-attach that finds the shards gone raises.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_edges.py
"""
import threading

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy, TrainingState, summon_full_params
from conftest import run_group

WORLD = 2
_RNG = threading.Lock()


class Inner(nn.Module):
    """Units with ModuleWrapPolicy({nn.Linear}): the root (bn's parameters), fc1, fc2."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Outer(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.head = nn.Linear(2, 1)
        self.body = body

    def forward(self, x):
        return self.head(self.body(x))


def inner(seed=0):
    with _RNG:  # ranks are threads: take turns with torch's global generator
        torch.manual_seed(seed)
        return Inner()


def wrap(c, module=None, **kw):
    kw.setdefault("auto_wrap_policy", ModuleWrapPolicy({nn.Linear}))
    return FlatShardModule(module if module is not None else inner(), c, **kw)


def batch(rank, step=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=g)


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def run_ranks(address, fn, world=WORLD, group=None, timeout=60):
    """fn(rank, client) on every rank, each a thread with its own joined Client."""
    return run_group(address, world, fn, group=group, timeout=timeout)


# ----------------------------------------------------------------------------- 1. nesting
def test_nested_wrapper_keeps_the_state_dict_contract(daemon):
    plain = Outer(inner())
    want_keys = list(plain.state_dict())
    target = {k: (v + 0.5 if v.is_floating_point() else v + 3)
              for k, v in plain.state_dict().items()}

    def fn(rank, c):
        outer = Outer(wrap(c))
        outer.head.load_state_dict(plain.head.state_dict())
        got = {}
        sd = outer.state_dict()
        got["keys"], got["sd"] = list(sd), {k: v.clone() for k, v in sd.items()}
        got["prefixed"] = list(outer.body.state_dict(prefix="p.", keep_vars=True))
        res = outer.load_state_dict(target)
        got["res"] = (res.missing_keys, res.unexpected_keys)
        got["after"] = {k: v.clone() for k, v in outer.state_dict().items()}
        # strict semantics: a missing and an unexpected key are reported with their full keys
        bad = {k: v for k, v in target.items() if k != "body.fc1.bias"}
        bad["body.nope"] = torch.zeros(1)
        with pytest.raises(RuntimeError, match=r'(?s)Missing key\(s\).*"body.fc1.bias".*'
                                               r'Unexpected key\(s\).*"body.nope"'):
            outer.load_state_dict(bad)
        res = outer.load_state_dict(bad, strict=False)
        got["loose"] = (res.missing_keys, res.unexpected_keys)
        top = outer.body.load_state_dict({k[5:]: v for k, v in target.items()
                                          if k.startswith("body.")})
        got["top"] = (top.missing_keys, top.unexpected_keys)
        assert outer.body.training_state == TrainingState.IDLE
        outer(batch(rank)).sum().backward()  # and the wrapper still trains
        return got

    for got in run_ranks(daemon.address, fn).values():
        assert got["keys"] == want_keys
        for k in want_keys:
            assert torch.equal(got["sd"][k], plain.state_dict()[k]), k
            assert torch.equal(got["after"][k], target[k]), k
        assert got["prefixed"] == ["p." + k[5:] for k in want_keys if k.startswith("body.")]
        assert got["res"] == ([], [])
        assert got["loose"] == (["body.fc1.bias"], ["body.nope"])
        assert got["top"] == ([], [])


# ----------------------------------------------------------------------------- 2. errors
def test_errors_inside_the_wrapper_leave_it_usable(daemon):
    def fn(rank, c):
        fs = wrap(c)
        x = batch(rank)
        with torch.no_grad():  # (a forward with grad waits for its backward)
            want = fs(x)
        for call in (fs, fs.module):  # the wrapper, or its module (unit hooks) directly
            with pytest.raises(AssertionError, match="inside summon_full_params"):
                with summon_full_params(fs, writeback=False):
                    call(x)
            assert fs.training_state == TrainingState.IDLE
            with torch.no_grad():
                assert torch.equal(fs(x), want)  # the very next forward works
        # A forward that fails inside a unit.
        with pytest.raises(RuntimeError):
            fs(torch.zeros(6, 5))
        with torch.no_grad():
            assert torch.equal(fs(x), want)

        # A backward that fails (a user hook), before it reaches the wrapper or halfway
        # through its units: summon, commit, forward and backward work next.
        def boom(grad):
            raise ValueError("boom")

        def boom_inside(module, args, out):
            out.register_hook(boom)  # fc2's gradients are reduce-scattered, fc1's never

        for where in ("outside", "inside"):
            h = fs.module.fc1.register_forward_hook(
                boom_inside if where == "inside" else lambda *a: None)
            out = fs(x)
            h.remove()
            if where == "outside":
                out = out * 2
                out.register_hook(boom)
            with pytest.raises(ValueError, match="boom"):
                out.sum().backward()
            with summon_full_params(fs, writeback=False):
                pass
            assert fs.training_state in (TrainingState.IDLE, TrainingState.FORWARD_BACKWARD)
            fs.commit()
            fs(x).sum().backward()
            assert fs.training_state == TrainingState.IDLE
        return fs.training_state

    assert set(run_ranks(daemon.address, fn).values()) == {TrainingState.IDLE}


# ----------------------------------------------------------------------------- 3. buffers
def test_sync_module_states_broadcasts_buffers(daemon):
    def fn(rank, c):
        m = inner()
        m.register_buffer("f64", torch.tensor([1 / 3, -0.0, float("inf")], dtype=torch.float64))
        m.register_buffer("flags", torch.tensor([True, False]), persistent=False)
        if rank == 1:
            with torch.no_grad():
                for p in m.parameters():
                    p.fill_(-1.0)
            m.bn.running_mean.add_(1.4)
            m.bn.running_var.mul_(3)
            m.bn.num_batches_tracked.fill_(7)
            m.f64.fill_(2.0)
            m.flags.fill_(True)
        fs = wrap(c, m, sync_module_states=True)
        with summon_full_params(fs, with_grads=True, writeback=False):
            grads = [p.grad for p in fs.module.parameters()]
        return dict(fs.module.named_buffers()), fs.full_state_dict(), grads, fs.generation

    got = run_ranks(daemon.address, fn)
    for name, b in got[0][0].items():
        assert torch.equal(got[1][0][name], b), name
        assert got[1][0][name].dtype == b.dtype
    assert torch.equal(got[1][0]["f64"], torch.tensor([1 / 3, -0.0, float("inf")],
                                                      dtype=torch.float64))
    assert torch.equal(got[1][0]["f64"].signbit(), got[0][0]["f64"].signbit())
    for k, v in got[0][1].items():
        assert torch.equal(got[1][1][k], v), k
    for r in (0, 1):  # no gradient left behind, and still the initial generation
        assert all(g is None or not g.any() for g in got[r][2]) and got[r][3] == 0


# ----------------------------------------------------------------------------- 4. checkpoint
def test_save_checkpoint_refuses_uncommitted_steps(daemon, tmp_path):
    def fn(rank, c):
        fs = wrap(c)
        opt = torch.optim.SGD(fs.sharded_parameters(), lr=0.1)
        for step in range(2):  # torch's usual loop: no commit
            opt.zero_grad()
            fs(batch(rank, step)).sum().backward()
            opt.step()
        out = {}
        if rank == 0:
            with pytest.raises(flatshard.FailedPreconditionError,
                               match=r"2 uncommitted optimizer steps.*model\.commit\(\)"):
                fs.save_checkpoint(str(tmp_path / "bad"))
        trained = fs.full_state_dict()
        fs.commit()
        if rank == 0:
            out["info"] = fs.save_checkpoint(str(tmp_path / "good"))
            # A writeback summon commits too: nothing uncommitted after it.
            with torch.no_grad():
                fs.sharded_parameters()[0].add_(1.0)
        with summon_full_params(fs):
            pass
        if rank == 0:
            out["again"] = fs.save_checkpoint(str(tmp_path / "again"))
        out["trained"], out["gen"] = trained, fs.generation
        return out

    got = run_ranks(daemon.address, fn)
    assert got[0]["info"]["generation"] == 1 and got[0]["again"]["generation"] == 2

    def check(rank, c):
        fs = wrap(c)
        # A load needs no summon open on any rank: every rank's wrap (its summons) first.
        barrier.wait(20)
        if rank == 0:
            fs.load_checkpoint(str(tmp_path / "good"))
        barrier.wait(20)
        if rank == 1:
            fs.refresh_views()
        return fs.full_state_dict()

    barrier = threading.Barrier(WORLD)
    for sd in run_ranks(daemon.address, check).values():
        for k, v in got[0]["trained"].items():
            if "running" not in k and "batches" not in k:  # checkpoints hold parameters
                assert torch.equal(sd[k], v), k


# ----------------------------------------------------------------------------- 5. restart
def test_reattach_after_the_shards_were_lost_raises(group):
    with flatshard.testing.LocalDaemon() as d:  # no --state_dir: a restart loses the shards
        clients = [flatshard.Client(d.address, call_timeout=20.0, join_timeout=20.0)
                   for _ in range(WORLD)]
        wrappers = {}
        try:
            def first(rank):
                clients[rank].join(group, WORLD, rank)
                fs = wrappers[rank] = wrap(clients[rank])
                fs.commit()
                return fs.commit()

            _threads(first)
            d.restart()

            def again(rank):
                c = clients[rank]
                try:
                    c.leave()
                except flatshard.FlatshardError:
                    pass
                c.join(group, WORLD, rank)
                with pytest.raises(flatshard.ShardsLostError, match="generation 2"):
                    wrappers[rank].reattach()
                # A restarted trainer says it expects to re-attach: told the same way.
                with pytest.raises(flatshard.ShardsLostError, match="require_reattach"):
                    wrap(c, require_reattach=True)
                return wrap(c).generation  # starting over is still possible, knowingly

            assert _threads(again) == [0, 0]
        finally:
            for c in clients:
                c.close()


def _threads(fn):
    results, errors = [None] * WORLD, [None] * WORLD

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(WORLD)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
        assert not t.is_alive()
    for e in errors:
        if e is not None:
            raise e
    return results
