"""Checkpoints with optimizer state (README "Checkpoints") against real flatshardd processes:
the committed state buffers (Client.register_state) are saved with the shards and loaded back
bit for bit; under another world size or wrap policy SHARD states reshard by FQN and element
range like the parameters and a SCALAR state takes the saved value of the unit holding the new
unit's first parameter; a module without state gets the checkpoint's (created by the load);
a spec mismatch is refused naming the state and field, with nothing changed; AdamW kept in
the daemon (keep_optimizer_state) saved, loaded by a new job on a fresh daemon, continues bit
for bit like an uninterrupted run.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_checkpoint_state.py
"""
import json
import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy, keep_optimizer_state
from conftest import MLP_POLICY, Barrier, connect, mlp_manifest, run_ranks
from small_torch_models import Block, Net, batch

ADAM = [("exp_avg", "float32", "shard"), ("exp_avg_sq", "float64", "shard"),
        ("step", "float64", "scalar")]
# The whole MLP in one unit (no policy): another wrap policy than MLP_POLICY's three units.
NO_POLICY = ""


def ctl():
    daemon = os.environ.get("FLATSHARD_DAEMON")
    if daemon:
        return str(Path(daemon).resolve().parents[1] / "client" / "flatshardctl")
    return "flatshardctl"


def _group(prefix="cs"):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _gather(plan, views_by_rank, get):
    """{fqn: 1-D tensor} of the whole parameter gathered from every rank's shard-shaped
    `get(view)` (the flat buffer of each unit is its ranks' shards in rank order)."""
    out = {}
    for u in plan["units"]:
        parts = []
        for views in views_by_rank:
            v = [x for x in views if x.unit == u["index"]][0]
            parts.append(get(v).clone())
        flat = torch.cat(parts) if parts else torch.empty(0)
        for p in u["params"]:
            out[p["fqn"]] = flat[p["offset"]:p["offset"] + p["numel"]]
    return out


def _unit_of(plan, fqn):
    for u in plan["units"]:
        if any(p["fqn"] == fqn for p in u["params"]):
            return u["index"]
    raise KeyError(fqn)


def _fill_state(views, rank, seed):
    """Distinct values per rank, unit, state and element (and a step per unit)."""
    for v in views:
        n = v.shard_numel
        base = seed + 1000 * rank + 100 * v.unit
        v.state("exp_avg").copy_(torch.arange(n, dtype=torch.float32) * 0.5 + base)
        v.state("exp_avg_sq").copy_(torch.arange(n, dtype=torch.float64) * 0.25 - base)
        v.state("step").fill_(float(seed + v.unit))
        v.shard.copy_(torch.arange(n, dtype=torch.float32) + base + 0.125)


def _snapshot(views):
    return [(v.unit, v.shard.clone(), {k: t.clone() for k, t in v.states.items()})
            for v in views]


def _same(a, b):
    if len(a) != len(b):
        return False
    for (u1, s1, st1), (u2, s2, st2) in zip(a, b):
        if u1 != u2 or not torch.equal(s1, s2) or sorted(st1) != sorted(st2):
            return False
        if any(not torch.equal(st1[k], st2[k]) for k in st1):
            return False
    return True


def test_state_saved_scrambled_loaded_bit_exact_and_inspected(tmp_path):
    ckpt = str(tmp_path / "ck")
    group = _group()
    with flatshard.testing.LocalDaemon() as d:
        barrier = Barrier(2)

        def rank_fn(r):
            c = connect(d)
            try:
                c.join(group, 2, r)
                c.register("", mlp_manifest(), MLP_POLICY)
                views = c.register_state("", ADAM)
                _fill_state(views, r, seed=3)
                assert c.commit("") == 1
                saved = _snapshot(c.shard_views(""))
                barrier.wait()
                if r == 0:
                    info = c.save_checkpoint("", ckpt)
                    assert info["generation"] == 1
                barrier.wait()
                _fill_state(views, r, seed=77)  # scramble: another committed step
                assert c.commit("") == 2
                assert not _same(_snapshot(c.shard_views("")), saved)
                barrier.wait()
                if r == 0:
                    assert c.load_checkpoint("", ckpt)["generation"] == 1
                barrier.wait()
                got = _snapshot(c.shard_views(""))
                assert _same(got, saved), f"rank {r}: state or shards differ after the load"
                # The committed copies hold the loaded step too: the next commit keeps it.
                assert c.commit("") == 2
                assert _same(_snapshot(c.shard_views("")), saved)
                return True
            finally:
                c.close()

        assert run_ranks(2, rank_fn) == [True, True]
    meta = json.loads(Path(ckpt, "metadata.json").read_text())
    assert meta["optimizer_state"] == [{"name": n, "dtype": t, "shape": s} for n, t, s in ADAM]
    names = {(t["rank"], t["unit"], t["name"]) for t in meta["tensors"]}
    units = len(meta["plan"]["units"])
    for r in range(2):
        for u in range(units):
            for n, _, _ in ADAM:
                assert (r, u, n) in names
    out = subprocess.run([ctl(), "checkpoint", "inspect", ckpt, "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    states = {s["name"]: s for s in doc["optimizer_state"]}
    assert sorted(states) == ["exp_avg", "exp_avg_sq", "step"]
    shard_elems = sum(u["shard_numel"] for u in meta["plan"]["units"]) * 2  # both ranks
    assert states["exp_avg"]["bytes"] == shard_elems * 4
    assert states["exp_avg_sq"]["bytes"] == shard_elems * 8
    assert states["step"]["bytes"] == units * 2 * 8
    text = subprocess.run([ctl(), "checkpoint", "inspect", ckpt], capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0 and "exp_avg_sq" in text.stdout, text.stdout
    # A data file's state bytes flipped: the load is refused naming the file, nothing changed.
    rank1 = Path(ckpt, "rank-00001-of-00002.bin")
    entry = [t for t in meta["tensors"] if t["rank"] == 1 and t["name"] == "exp_avg_sq"][0]
    raw = bytearray(rank1.read_bytes())
    raw[entry["offset"]] ^= 0xFF
    rank1.write_bytes(bytes(raw))
    with flatshard.testing.LocalDaemon() as d:
        c = connect(d)
        c.join(_group(), 1, 0)
        c.register("", mlp_manifest(), MLP_POLICY)
        c.register_state("", ADAM)
        before = _snapshot(c.shard_views(""))
        with pytest.raises(flatshard.FlatshardError, match=r"rank-00001-of-00002.bin.*corrupt"):
            c.load_checkpoint("", ckpt)
        assert _same(_snapshot(c.shard_views("")), before)
        c.close()


def _save_two_ranks(d, ckpt, seed):
    """World 2, MLP_POLICY, ADAM state filled; returns (plan, full params, full state)."""
    group = _group()
    barrier = Barrier(2)
    plans, views_by_rank = {}, {}

    gathered = {}

    # Gathered by rank 0 while every rank's client (and its mappings) is alive.
    def rank_fn_gather(r):
        c = connect(d)
        try:
            c.join(group, 2, r)
            plans[r] = c.register("", mlp_manifest(), MLP_POLICY).plan
            views = c.register_state("", ADAM)
            _fill_state(views, r, seed)
            c.commit("")
            views_by_rank[r] = c.shard_views("")
            barrier.wait()
            if r == 0:
                c.save_checkpoint("", ckpt)
                vb = [views_by_rank[0], views_by_rank[1]]
                gathered["params"] = _gather(plans[0], vb, lambda v: v.shard)
                for n, _, s in ADAM:
                    if s == "shard":
                        gathered[n] = _gather(plans[0], vb, lambda v, n=n: v.state(n))
            barrier.wait()
            return True
        finally:
            c.close()

    run_ranks(2, rank_fn_gather)
    return plans[0], gathered


@pytest.mark.parametrize("world,policy", [(3, MLP_POLICY), (1, NO_POLICY), (4, NO_POLICY)],
                         ids=["world3", "world1_one_unit", "world4_one_unit"])
def test_state_reshards_by_fqn_into_another_world_size_and_wrap_policy(tmp_path, world, policy):
    ckpt = str(tmp_path / "ck")
    with flatshard.testing.LocalDaemon() as d:
        saved_plan, want = _save_two_ranks(d, ckpt, seed=5)
        group = _group()
        barrier = Barrier(world)
        got = {}

        def rank_fn(r):
            c = connect(d)
            try:
                c.join(group, world, r)
                reg = c.register("", mlp_manifest(), policy)
                c.register_state("", ADAM)
                barrier.wait()
                if r == 0:
                    assert c.load_checkpoint("", ckpt)["ranks"] == world
                barrier.wait()
                got[r] = (reg.plan, c.shard_views(""))
                barrier.wait()
                if r == 0:
                    vb = [got[k][1] for k in range(world)]
                    plan = reg.plan
                    out = {"params": _gather(plan, vb, lambda v: v.shard)}
                    for n, _, s in ADAM:
                        if s == "shard":
                            out[n] = _gather(plan, vb, lambda v, n=n: v.state(n))
                    # SCALAR: every new unit holds the step of the saved unit holding its
                    # first parameter (seed + saved unit index, _fill_state).
                    steps = {}
                    for u in plan["units"]:
                        first = min(u["params"], key=lambda p: p["offset"], default=None)
                        for views in vb:
                            v = [x for x in views if x.unit == u["index"]][0]
                            steps.setdefault(u["index"], set()).add(v.state("step").item())
                        if first is not None:
                            assert steps[u["index"]] == {float(5 + _unit_of(saved_plan,
                                                                            first["fqn"]))}
                    got["full"] = out
                barrier.wait()
                return True
            finally:
                c.close()

        run_ranks(world, rank_fn)
    full = got["full"]
    for key in ["params", "exp_avg", "exp_avg_sq"]:
        assert sorted(full[key]) == sorted(want[key])
        for fqn in want[key]:
            assert torch.equal(full[key][fqn], want[key][fqn]), (key, fqn)


def test_load_creates_state_in_a_module_without_and_refuses_another_spec(tmp_path):
    ckpt = str(tmp_path / "ck")
    with flatshard.testing.LocalDaemon() as d:
        _save_two_ranks(d, ckpt, seed=9)
        saved = {}
        # Same world and plan, a module without state: the load creates it.
        group = _group()
        barrier = Barrier(2)

        def rank_fn(r):
            c = connect(d)
            try:
                c.join(group, 2, r)
                c.register("", mlp_manifest(), MLP_POLICY)
                assert c.shard_views("").state_specs == []
                barrier.wait()
                if r == 0:
                    c.load_checkpoint("", ckpt)
                barrier.wait()
                views = c.shard_views("")
                assert views.state_specs == ADAM
                expect = {}
                for v in views:
                    ref = torch.arange(v.shard_numel, dtype=torch.float32) * 0.5 + \
                        (9 + 1000 * r + 100 * v.unit)
                    expect[v.unit] = ref
                    assert torch.equal(v.state("exp_avg"), ref), (r, v.unit)
                    assert v.state("step").item() == 9 + v.unit
                # A rank re-attaching with the same spec gets the loaded buffers.
                again = c.register_state("", ADAM)
                for v in again:
                    assert torch.equal(v.state("exp_avg"), expect[v.unit])
                assert c.commit("") == 2
                saved[r] = True
                return True
            finally:
                c.close()

        run_ranks(2, rank_fn)
        assert saved == {0: True, 1: True}

        # Another spec: refused naming the state and the field; nothing changes.
        c = connect(d)
        c.join(_group(), 1, 0)
        c.register("", mlp_manifest(), MLP_POLICY)
        views = c.register_state("", [("exp_avg", "float16", "shard"),
                                      ("exp_avg_sq", "float64", "shard"),
                                      ("step", "float64", "scalar")])
        for v in views:
            v.state("exp_avg").fill_(1.5)
            v.shard.fill_(2.5)
        c.commit("")
        before = _snapshot(c.shard_views(""))
        with pytest.raises(flatshard.FailedPreconditionError,
                           match=r'state "exp_avg": dtype float32, the module\'s is float16'):
            c.load_checkpoint("", ckpt)
        assert _same(_snapshot(c.shard_views("")), before)
        c.close()


# ---- torch: AdamW kept in the daemon, saved, resumed by a new job ----

def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _train(model, opt, start, steps, fs=None):
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy((fs or model)(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if fs is None:
            opt.step()
        else:
            fs.step(opt)


@pytest.mark.parametrize("load_first", [True, False], ids=["load_then_keep", "keep_then_load"])
def test_adamw_saved_and_resumed_by_a_new_job_is_bit_exact(tmp_path, load_first):
    ckpt = str(tmp_path / "ck")
    ref = Net()
    ref_opt = _adamw(ref.parameters())
    _train(ref, ref_opt, 0, 5)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    with flatshard.testing.LocalDaemon() as d:
        c = connect(d)
        c.join(_group("job1"), 1, 0)
        fs = FlatShardModule(Net(), c, auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = _adamw(fs.sharded_parameters())
        keep_optimizer_state(opt, fs)
        _train(fs.module, opt, 0, 3, fs)
        assert fs.generation == 3
        fs.save_checkpoint(ckpt)
        c.close()

    # A new job on a fresh daemon: another initial model, its own optimizer.
    with flatshard.testing.LocalDaemon() as d:
        c = connect(d)
        c.join(_group("job2"), 1, 0)
        torch.manual_seed(1234)
        fresh = Net()
        with torch.no_grad():
            for p in fresh.parameters():
                p.normal_()
        fs = FlatShardModule(fresh, c, auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = _adamw(fs.sharded_parameters())
        if load_first:
            fs.load_checkpoint(ckpt)
            keep_optimizer_state(opt, fs)
        else:
            keep_optimizer_state(opt, fs)
            fs.load_checkpoint(ckpt)
        _train(fs.module, opt, 3, 2, fs)
        got = {k: v.clone() for k, v in fs.full_state_dict().items()}
        for p in fs.sharded_parameters():
            if p.numel():
                assert opt.state[p]["step"].item() == 5.0
        c.close()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"


def _round_trip(daemons, world, group, ckpt, client_kw=None, join_kw=None, loader=0):
    """Every rank: register ADAM state, fill, commit, (rank 0) save, scramble, commit,
    (rank `loader`) load; returns {rank: (saved snapshot, loaded snapshot)}."""
    barrier = Barrier(world)
    out = {}

    def rank_fn(r):
        c = connect(daemons[r], **(client_kw or {}))
        try:
            c.join(group, world, r, **(join_kw or {}))
            c.register("", mlp_manifest(), MLP_POLICY)
            views = c.register_state("", ADAM)
            _fill_state(views, r, seed=21)
            assert c.commit("") == 1
            saved = _snapshot(c.shard_views(""))
            barrier.wait()
            if r == 0:
                assert c.save_checkpoint("", ckpt)["ranks"] == world
            barrier.wait()
            _fill_state(views, r, seed=-40)
            assert c.commit("") == 2
            barrier.wait()
            if r == loader:
                assert c.load_checkpoint("", ckpt)["generation"] == 1
            barrier.wait()
            out[r] = (saved, _snapshot(c.shard_views("")))
            assert c.commit("") == 2
            return True
        finally:
            c.close()

    run_ranks(world, rank_fn)
    return out


def test_state_of_simulated_gpu_ranks_goes_through_host_memory(tmp_path):
    """`--simulate_gpus`: state buffers in "device" memory, saved and loaded through host
    staging; the GPU group's checkpoint then loads into a host-memory group of one rank."""
    ckpt = str(tmp_path / "gpu")
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=2",)) as d:
        out = _round_trip([d, d], 2, _group("gpu"), ckpt, client_kw={"_simulated_gpus": True})
    for r, (saved, loaded) in out.items():
        assert _same(saved, loaded), f"rank {r}"
    with flatshard.testing.LocalDaemon() as d:
        c = connect(d)
        c.join(_group(), 1, 0)
        reg = c.register("", mlp_manifest(), MLP_POLICY)
        c.load_checkpoint("", ckpt)
        views = c.shard_views("")
        states = {r: {unit: st for unit, _, st in out[r][0]} for r in range(2)}
        for u in reg.plan["units"]:
            v = [x for x in views if x.unit == u["index"]][0]
            joined = torch.cat([states[r][u["index"]]["exp_avg"] for r in range(2)])[:u["numel"]]
            assert torch.equal(v.state("exp_avg")[:u["numel"]], joined), u["index"]
            assert v.state("step").item() == 21 + u["index"]
        c.close()


def test_state_across_two_daemons_saved_and_loaded_at_the_other(tmp_path):
    """A group over two daemons (2 ranks each): each daemon writes its ranks' state; the load
    asked at the other daemon brings every rank's state back bit for bit."""
    ckpt = str(tmp_path / "two")
    with flatshard.testing.LocalDaemon(peer=True, node_name="node0") as d0, \
            flatshard.testing.LocalDaemon(peer=True, node_name="node1") as d1:
        out = _round_trip([d0, d0, d1, d1], 4, _group("two"), ckpt,
                          join_kw={"token": "tok", "coordinator": d0.peer_address}, loader=3)
    for r, (saved, loaded) in out.items():
        assert _same(saved, loaded), f"rank {r}"
    meta = json.loads(Path(ckpt, "metadata.json").read_text())
    assert {t["rank"] for t in meta["tensors"] if t["name"] == "exp_avg"} == {0, 1, 2, 3}


_SEED = threading.Lock()  # Net() seeds torch's global generator: ranks (threads) take turns


def _threads(daemon, world, fn, timeout=120):
    group = _group("tw")
    barrier = Barrier(world)

    def body(r):
        c = connect(daemon)
        try:
            c.join(group, world, r)
            return fn(r, c, barrier)
        finally:
            c.close()

    return run_ranks(world, body, timeout)


def test_adamw_of_two_ranks_resumed_by_three_ranks_of_a_new_job(tmp_path):
    """AdamW kept in the daemon, 2 ranks (every rank the same batch, so the averaged gradient
    is the full one) for 3 steps, saved; a new job of 3 ranks on a fresh daemon loads it (the
    state resharded by FQN, `step` per unit) and trains 2 more: equal to 5 uninterrupted steps
    of plain torch within float32 tolerances."""
    ckpt = str(tmp_path / "ck")
    ref = Net()
    ref_opt = _adamw(ref.parameters())
    _train(ref, ref_opt, 0, 5)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def job1(r, c, barrier):
        with _SEED:
            net = Net()
        fs = FlatShardModule(net, c, auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = _adamw(fs.sharded_parameters())
        keep_optimizer_state(opt, fs)
        _train(fs.module, opt, 0, 3, fs)
        barrier.wait()
        if r == 0:
            fs.save_checkpoint(ckpt)
        barrier.wait()
        return fs.generation

    with flatshard.testing.LocalDaemon() as d:
        assert _threads(d, 2, job1) == [3, 3]

    def job2(r, c, barrier):
        with _SEED:
            net = Net()
            with torch.no_grad():
                for p in net.parameters():
                    p.uniform_(-1, 1)  # not the saved values
        fs = FlatShardModule(net, c, auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = _adamw(fs.sharded_parameters())
        barrier.wait()
        if r == 0:
            fs.load_checkpoint(ckpt)
        barrier.wait()
        fs.refresh_views()
        keep_optimizer_state(opt, fs)
        _train(fs.module, opt, 3, 2, fs)
        steps = {opt.state[p]["step"].item() for p in fs.sharded_parameters() if p.numel()}
        return steps, {k: v.clone() for k, v in fs.full_state_dict().items()}

    with flatshard.testing.LocalDaemon() as d:
        got = _threads(d, 3, job2)
    for steps, sd in got:
        assert steps == {5.0}
        for k in want:
            assert torch.allclose(sd[k], want[k], rtol=1e-5, atol=1e-6), \
                f"{k}: max diff {(sd[k] - want[k]).abs().max().item()}"
