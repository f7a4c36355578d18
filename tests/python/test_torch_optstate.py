"""flatshard.torch.keep_optimizer_state: a torch.optim optimizer's state lives in the daemon
(Client.register_state), commits and rolls back with the shards, and a restarted trainer
resumes with it.

- in process, one rank: SGD with momentum, Adam and AdamW, use_orig_params False and True,
  train exactly like plain torch (bit for bit), with every state tensor a view of daemon
  memory; a trainer whose client goes away after an uncommitted optimizer step comes back
  with the committed step's optimizer state and finishes equal to an uninterrupted run;
- processes (examples/python/train_rank.py): a rank SIGKILLed after its AdamW step, before
  the commit, restarts and finishes equal to the single-process reference: bit for bit with
  one rank, within run_gpt's tolerances with two (both restarted).

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_optstate.py
"""
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.torch import FlatShardModule, ModuleWrapPolicy, keep_optimizer_state
from conftest import Barrier, connect, run_ranks
from small_torch_models import Block, Net, batch

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import gpt  # noqa: E402
import run_gpt  # noqa: E402


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
}


def _train(model, opt, steps, fs=None, start=0):
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy((fs or model)(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if fs is None:
            opt.step()
        else:
            fs.step(opt)


def _reference(kind, steps):
    model = Net()
    opt = OPTIMIZERS[kind](model.parameters())
    _train(model, opt, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_SEED = threading.Lock()  # Net() seeds torch's global generator: ranks (threads) take turns


def _wrapped(client, use_orig_params):
    with _SEED:
        net = Net()
    return FlatShardModule(net, client, auto_wrap_policy=ModuleWrapPolicy({Block}),
                           use_orig_params=use_orig_params)


def _full(fs):
    return {k: v.clone() for k, v in fs.full_state_dict().items()}


def _in_daemon_memory(opt, link, fs, expect=True):
    """Every shard-shaped state tensor of every parameter points into the daemon's buffer of
    its unit (at the parameter's offset); `expect=False`: none does. Returns how many."""
    from flatshard.torch.optim import _slots
    slots = _slots(fs)
    checked = 0
    for p in fs.sharded_parameters():
        slot = slots[id(p)]
        for name, t in opt.state[p].items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.numel() == 0:
                continue
            buf = link.state_views(slot.unit)[name]
            at = t.data_ptr() == buf.data_ptr() + slot.offset * buf.element_size()
            assert at == expect, name
            checked += 1
    return checked


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig_params"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_state_lives_in_the_daemon_and_trains_like_torch(daemon, group, kind,
                                                                    use_orig_params):
    c = connect(daemon)
    c.join(group, 1, 0)
    fs = _wrapped(c, use_orig_params)
    opt = OPTIMIZERS[kind](fs.sharded_parameters())
    link = keep_optimizer_state(opt, fs)
    assert link.specs is None  # derived from the optimizer's first step
    _train(fs.module, opt, 3, fs)
    names = {"sgd_momentum": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq", "step"],
             "adamw": ["exp_avg", "exp_avg_sq", "step"]}[kind]
    assert [s[0] for s in link.specs] == names
    assert all(s[2] == ("scalar" if s[0] == "step" else "shard") for s in link.specs)
    assert _in_daemon_memory(opt, link, fs) > 0
    # The daemon's scalar `step` holds the optimizer's count.
    if kind != "sgd_momentum":
        for u in range(len(fs.plan["units"])):
            views = link.state_views(u)
            if views:
                assert views["step"].item() == 3.0
    got = _full(fs)
    want = _reference(kind, 3)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from plain torch"
    with pytest.raises(RuntimeError, match="kept already"):
        keep_optimizer_state(opt, fs)
    c.close()


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig_params"])
def test_restarted_trainer_resumes_with_the_committed_optimizer_state(daemon, group,
                                                                      use_orig_params):
    """AdamW, one rank: two committed steps, then an optimizer step that is never committed;
    the client goes away (a crashed trainer). A new client, wrapper and optimizer re-attach:
    the optimizer's state equals the one after commit 2 (not the uncommitted step's, not a
    fresh one), and two more steps end equal, bit for bit, to four uninterrupted steps."""
    c = connect(daemon)
    c.join(group, 1, 0)
    fs = _wrapped(c, use_orig_params)
    opt = OPTIMIZERS["adamw"](fs.sharded_parameters())
    keep_optimizer_state(opt, fs)
    _train(fs.module, opt, 2, fs)
    assert fs.generation == 2
    saved = [{k: v.clone() for k, v in opt.state[p].items()} for p in fs.sharded_parameters()]
    x, y = batch(2)
    nn.functional.cross_entropy(fs(x), y).backward()
    opt.step()  # in place, never committed
    assert any(not torch.equal(opt.state[p]["exp_avg"], s["exp_avg"])
               for p, s in zip(fs.sharded_parameters(), saved) if p.numel())
    c.close()

    back = connect(daemon)
    back.join(group, 1, 0)
    fs2 = _wrapped(back, use_orig_params)
    assert fs2.reattached and fs2.generation == 2
    opt2 = OPTIMIZERS["adamw"](fs2.sharded_parameters())
    link = keep_optimizer_state(opt2, fs2)
    assert [s[0] for s in link.specs] == ["exp_avg", "exp_avg_sq", "step"]  # before any step
    for p, s in zip(fs2.sharded_parameters(), saved):
        st = opt2.state[p]
        assert sorted(st) == sorted(s)
        for k in s:
            assert torch.equal(st[k], s[k]), f"{k} was not the committed step's"
    _train(fs2.module, opt2, 2, fs2, start=fs2.generation)
    got = _full(fs2)
    want = _reference("adamw", 4)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: the restarted run differs"
    back.close()


def test_daemon_killed_mid_training_keeps_the_committed_optimizer_state(tmp_path, group):
    """AdamW, one rank, keep_optimizer_state, a daemon with --state_dir: two committed steps,
    an optimizer step never committed, then the DAEMON is SIGKILLed and started again (the
    trainer dies with it and restarts). The new trainer re-attaches at generation 2 with the
    committed optimizer state (the restart records carry the state buffers: not zeros, not
    the uncommitted step's) and two more steps end bit for bit equal to four uninterrupted
    ones."""
    with flatshard.testing.LocalDaemon(extra_args=(f"--state_dir={tmp_path / 'state'}",)) as d:
        c = connect(d)
        c.join(group, 1, 0)
        fs = _wrapped(c, False)
        opt = OPTIMIZERS["adamw"](fs.sharded_parameters())
        keep_optimizer_state(opt, fs)
        _train(fs.module, opt, 2, fs)
        assert fs.generation == 2
        saved = [{k: v.clone() for k, v in opt.state[p].items()}
                 for p in fs.sharded_parameters()]
        x, y = batch(2)
        nn.functional.cross_entropy(fs(x), y).backward()
        opt.step()  # in place, never committed
        d.restart()  # SIGKILL, then the same flags and state directory
        c.close()

        back = connect(d)
        back.join(group, 1, 0)
        fs2 = _wrapped(back, False)
        assert fs2.reattached and fs2.generation == 2
        opt2 = OPTIMIZERS["adamw"](fs2.sharded_parameters())
        link = keep_optimizer_state(opt2, fs2)
        assert [s[0] for s in link.specs] == ["exp_avg", "exp_avg_sq", "step"]
        for p, s in zip(fs2.sharded_parameters(), saved):
            st = opt2.state[p]
            assert sorted(st) == sorted(s)
            for k in s:
                assert torch.equal(st[k], s[k]), f"{k} was not the committed step's"
        _train(fs2.module, opt2, 2, fs2, start=fs2.generation)
        got = _full(fs2)
        want = _reference("adamw", 4)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k}: the run across a daemon restart differs"
        back.close()


def test_loaded_optimizer_state_goes_to_the_daemon(daemon, group):
    """opt.load_state_dict replaces the state tensors with copies: before the next step they
    are copied into the daemon's buffers and replaced by views again (step count included),
    so training goes on exactly as with plain torch loading the same state dict."""
    import copy
    c = connect(daemon)
    c.join(group, 1, 0)
    fs = _wrapped(c, False)
    opt = OPTIMIZERS["adam"](fs.sharded_parameters())
    link = keep_optimizer_state(opt, fs)
    _train(fs.module, opt, 2, fs)
    saved = copy.deepcopy(opt.state_dict())
    _train(fs.module, opt, 1, fs, start=2)
    opt.load_state_dict(saved)  # back to step 2's moments (parameters stay at step 3's)
    assert _in_daemon_memory(opt, link, fs, expect=False) > 0  # loaded copies
    _train(fs.module, opt, 1, fs, start=3)
    assert _in_daemon_memory(opt, link, fs) > 0
    for u in range(len(fs.plan["units"])):
        if link.state_views(u):
            assert link.state_views(u)["step"].item() == 3.0
    # Plain torch, same sequence.
    model = Net()
    ref = OPTIMIZERS["adam"](model.parameters())
    _train(model, ref, 2)
    ref_saved = copy.deepcopy(ref.state_dict())
    _train(model, ref, 1, start=2)
    ref.load_state_dict(ref_saved)
    _train(model, ref, 1, start=3)
    got = _full(fs)
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k
    c.close()


def _local_train(fs, opt, rank, steps, start):
    """Two ranks: each its half of the global batch (the gradients are averaged)."""
    for step in range(start, start + steps):
        x, y = batch(step)
        x, y = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
        loss = nn.functional.cross_entropy(fs(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        fs.step(opt)


def test_survivor_and_restarted_rank_resume_with_the_committed_optimizer_state(daemon, group):
    """Two ranks (threads), AdamW kept in the daemon: two committed steps, then both update
    shards and optimizer state in place and rank 1 dies before the commit. Rank 0 survives
    (commit fails naming rank 1, leave, join, reattach): its optimizer's moments are rolled
    back in place and its step count is the committed one at its next step; rank 1 restarts
    (new client, wrapper and optimizer) with the committed state. Both finish equal to plain
    torch on the global batch."""
    clients = [connect(daemon) for _ in range(2)]
    died, left = Barrier(2), threading.Event()
    saved = {}

    def rank(r):
        c = clients[r]
        c.join(group, 2, r)
        fs = _wrapped(c, False)
        opt = OPTIMIZERS["adamw"](fs.sharded_parameters())
        link = keep_optimizer_state(opt, fs)
        _local_train(fs, opt, r, 2, 0)
        saved[r] = [{k: v.clone() for k, v in opt.state[p].items()}
                    for p in fs.sharded_parameters()]
        x, y = batch(2)
        nn.functional.cross_entropy(fs(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        opt.step()  # shards and optimizer state updated in place, never committed
        if r == 1:
            c.close()
            died.wait()
            assert left.wait(60), "the survivor did not leave"
            back = connect(daemon)
            back.join(group, 2, 1)
            fs = _wrapped(back, False)
            assert fs.reattached and fs.generation == 2
            opt = OPTIMIZERS["adamw"](fs.sharded_parameters())
            link = keep_optimizer_state(opt, fs)
            clients[1] = back
        else:
            died.wait()
            with pytest.raises(flatshard.UnavailableError, match="rank 1"):
                fs.commit()
            c.leave()
            left.set()
            c.join(group, 2, 0)
            assert fs.reattach() == 2
            for u in range(len(fs.plan["units"])):
                if link.state_views(u):
                    assert link.state_views(u)["step"].item() == 2.0
        for p, st in zip(fs.sharded_parameters(), saved[r]):
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], st[k]), f"rank {r}: {k} not step 2's"
        _local_train(fs, opt, r, 2, 2)
        assert fs.generation == 4
        if r == 0:
            assert all(opt.state[p]["step"].item() == 4.0 for p in fs.sharded_parameters())
        return _full(fs)

    got = run_ranks(2, rank)
    want = _reference("adamw", 4)
    for k in want:
        for r in (0, 1):
            torch.testing.assert_close(got[r][k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    for c in clients:
        c.close()


# --- processes --------------------------------------------------------------------------------

STEPS, KILL = 6, 3
COMMON = ["--steps", str(STEPS), "--batch", "12", "--optimizer", "adamw",
          "--daemon-optimizer-state", "--call-timeout", "20"]
VICTIM = ["--die-at-step", str(KILL), "--die-in", "commit"]


def _steps(events):
    return [(e["step"], e["generation"]) for e in events if e["event"] == "step"]


def test_killed_adamw_rank_resumes_with_its_optimizer_state_bit_exact():
    """One rank, AdamW with its state in the daemon: SIGKILLed in step 3 after the optimizer
    updated shards and state in place, before the commit. Restarted, it re-attaches at
    generation 3 and finishes equal, bit for bit, to the uninterrupted single-process
    reference (with its optimizer state lost, steps 3-5 would start from fresh moments)."""
    with run_gpt.Job(1) as job:
        first = job.collect(job.launch(1, COMMON + VICTIM, tag="first"), timeout=200,
                            tag="first")
        assert first[0][0] == -9, f"rank 0 should have been killed: {first[0]}"
        assert _steps(first[0][1]) == [(s, s + 1) for s in range(KILL)]
        second = job.collect(job.launch(1, COMMON, tag="second"), timeout=200, tag="second")
        rc, events, err = second[0]
        assert rc == 0, err
        attached = [e for e in events if e["event"] == "attached"]
        assert attached[0]["reattached"] and attached[0]["generation"] == KILL, events
        specs = [e for e in events if e["event"] == "optimizer_state"]
        assert [s[0] for s in specs[0]["specs"]] == ["exp_avg", "exp_avg_sq", "step"], specs
        assert _steps(events) == [(s, s + 1) for s in range(KILL, STEPS)]
        final = job.final("second")
    assert not job.stop_problems, job.stop_problems
    ref_losses, ref_sd = gpt.train_reference(STEPS, 12, optimizer="adamw")
    losses = run_gpt.mean_losses({0: (0, first[0][1] + events, "")}, 1)
    assert list(losses.values()) == ref_losses
    for k in ref_sd:
        assert torch.equal(final[k], ref_sd[k]), f"{k} differs from the reference"


def test_two_killed_adamw_ranks_resume_with_their_optimizer_state():
    """Two ranks: rank 1 is SIGKILLed in step 3 after its AdamW step, rank 0's commit fails;
    both restart, re-attach at generation 3 with the committed optimizer state and finish
    equal to the reference within run_gpt's tolerances."""
    with run_gpt.Job(1) as job:
        procs = job.launch(2, COMMON, tag="first", only={0})
        procs.update(job.launch(2, COMMON + VICTIM, tag="first", only={1}))
        first = job.collect(procs, timeout=200, tag="first")
        assert first[1][0] == -9 and first[0][0] != 0, first
        second = job.collect(job.launch(2, COMMON, tag="second"), timeout=200, tag="second")
        for r, (rc, events, err) in second.items():
            assert rc == 0, f"rank {r}: {err}"
            attached = [e for e in events if e["event"] == "attached"]
            assert attached[0]["generation"] == KILL, events
        final = job.final("second")
    assert not job.stop_problems, job.stop_problems
    ref_losses, ref_sd = gpt.train_reference(STEPS, 12, optimizer="adamw")
    both = {r: (0, first[r][1] + second[r][1], "") for r in (0, 1)}
    losses = list(run_gpt.mean_losses(both, 2).values())
    _, _, _, problems = run_gpt.compare(losses, final, ref_losses, ref_sd)
    assert not problems, "\n".join(problems)
