"""flatshard.Client against a real flatshardd process: connect, join, register, summon,
zero-copy views, reduce-scatter, shard views, leave, counters."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import flatshard
from conftest import (MLP_POLICY, Barrier, connect, mlp_manifest, read_model, run_ranks,
                      shard_views_when_ready, unit_of)


def ctl():
    return str(Path(os.environ["FLATSHARD_DAEMON"]).resolve().parent.parent / "client" /
               "flatshardctl")


def test_single_rank_roundtrip(daemon, group):
    c = connect(daemon)
    assert not c.joined and c.lease_status is None
    c.join(group, 1, 0)
    assert c.joined and c.registered_modules == []
    reg = c.register("", mlp_manifest(), MLP_POLICY)
    assert reg.module == "" and reg.init_summon is None
    assert [u["module"] for u in reg.plan["units"]] == ["fc1", "fc2"]
    fc1 = unit_of(reg.plan, "fc1")
    assert [p["fqn"] for p in fc1["params"]] == ["fc1.weight", "fc1.bias"]
    assert [s.unit for s in reg.shards] == sorted(s.unit for s in reg.shards)

    with c.summon("") as s:
        assert s.has_views and sorted(s.units) == sorted(u["index"] for u in reg.plan["units"])
        p = s.params
        assert set(p) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        assert p["fc1.weight"].shape == (5, 3) and p["fc1.weight"].dtype == torch.float32
        assert p["fc2.bias"].shape == (2,)
        assert torch.count_nonzero(p["fc1.weight"]) == 0  # init zeros
        p["fc1.weight"].copy_(torch.arange(15, dtype=torch.float32).view(5, 3))
        p["fc2.bias"].fill_(7.0)
    assert s.ended and s.params == {} and not s.has_views
    s.end()  # idempotent

    # The daemon wrote the edits back into its shards: the shard views (another mapping of
    # other segments) and a new summon see them.
    shards = {v.unit: v for v in c.shard_views("")}
    sh = shards[fc1["index"]]
    assert sh.shard_numel == fc1["shard_numel"] and sh.shard_offset == 0
    assert sh.dtype == torch.float32 and sh.device == -1
    assert torch.equal(sh.shard[:15], torch.arange(15, dtype=torch.float32))
    with c.summon("", writeback=False) as s2:
        assert torch.equal(s2.params["fc1.weight"].flatten(), torch.arange(15.0))
        assert torch.equal(s2.params["fc2.bias"], torch.full((2,), 7.0))
    c.leave()
    assert not c.joined
    c.close()
    assert c.closed
    with pytest.raises(flatshard.FailedPreconditionError) as e:
        c.join(group, 1, 0)
    assert e.value.code == "FAILED_PRECONDITION" and "closed" in e.value.message


def test_socket_path_without_unix_scheme(daemon, group, monkeypatch):
    # A filesystem path is "unix:<path>": absolute, ./relative, or relative with a directory.
    sock = Path(daemon.socket)
    for address, cwd in ((str(sock), None), ("./" + sock.name, sock.parent),
                         (f"{sock.parent.name}/{sock.name}", sock.parent.parent)):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        c = flatshard.Client(address, call_timeout=5, join_timeout=5, max_attempts=1)
        assert c.address == "unix:" + address
        c.join(group, 1, 0)
        c.leave()
        c.close()


def test_plan_is_flatshardctl_plan_json(daemon, group):
    manifest, policy = read_model("gpt_tied")
    c = connect(daemon)
    c.join(group, 1, 0)
    reg = c.register("", manifest, policy)
    d = Path(daemon.log).parent
    (d / "m.json").write_text(manifest)
    (d / "p.json").write_text(policy)
    out = subprocess.run([ctl(), "plan", f"--manifest={d / 'm.json'}", f"--policy={d / 'p.json'}",
                          "--world-size=1", "--json"], check=True, capture_output=True,
                         text=True, timeout=60)
    assert reg.plan == json.loads(out.stdout)
    c.close()


def test_tied_params_alias_and_flat_buffer(daemon, group):
    manifest, policy = read_model("gpt_tied")
    c = connect(daemon)
    c.join(group, 1, 0)
    reg = c.register("", manifest, policy)
    tied = [(u, sh) for u in reg.plan["units"] for sh in u.get("shared", [])]
    assert tied, "gpt_tied has a tied FQN"
    unit, alias = tied[0]
    with c.summon("") as s:
        p = s.params
        assert p[alias["fqn"]].data_ptr() == p[alias["same_as"]].data_ptr()
        assert p[alias["fqn"]].shape == p[alias["same_as"]].shape
        # flat(unit) is the whole padded buffer; each param is a slice of it at its offset.
        flat = s.flat(unit["index"])
        assert flat.shape == (unit["padded_numel"],) and flat.dim() == 1
        for prm in unit["params"]:
            t = p[prm["fqn"]]
            assert t.data_ptr() == flat.data_ptr() + prm["offset"] * flat.element_size()
            assert tuple(t.shape) == tuple(prm["shape"])
        flat[: unit["numel"]].copy_(torch.linspace(-1, 1, unit["numel"]))
        first = unit["params"][0]
        assert torch.equal(p[first["fqn"]].flatten(),
                           torch.linspace(-1, 1, unit["numel"])[: first["numel"]])
        assert torch.equal(p[alias["fqn"]], p[alias["same_as"]])
    with c.summon("", writeback=False) as s:
        assert torch.equal(s.flat(unit["index"])[: unit["numel"]],
                           torch.linspace(-1, 1, unit["numel"]))
    c.close()


def test_numpy_params_share_memory(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    c.register("", mlp_manifest(), MLP_POLICY)
    with c.summon("") as s:
        arrays, tensors = s.numpy_params, s.params
        a = arrays["fc1.weight"]
        assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == (5, 3)
        assert a.flags.writeable
        a[2, 1] = 42.0
        assert tensors["fc1.weight"][2, 1].item() == 42.0
        assert a.ctypes.data == tensors["fc1.weight"].data_ptr()
    with c.summon("", writeback=False) as s:
        assert s.numpy_params["fc1.weight"][2, 1] == 42.0
    c.close()


def test_multi_rank_threads_from_every_rank_summon_reduce_scatter(daemon, group):
    """Three ranks as threads of one process (each a Client): works only because every
    blocking call releases the GIL (Join and the collectives wait for the other threads)."""
    world = 3
    manifest = mlp_manifest()
    barrier = Barrier(world)

    def rank_fn(rank):
        c = connect(daemon)
        c.join(group, world, rank)
        reg = c.register("", manifest, MLP_POLICY, init="from_every_rank")
        init = reg.init_summon
        assert init is not None and init.has_views
        for fqn, t in init.params.items():
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 0.5)
        init.end()
        fc1, fc2 = unit_of(reg.plan, "fc1"), unit_of(reg.plan, "fc2")
        assert fc1["shard_numel"] == 7 and fc1["padded_numel"] == 21

        # Every rank sees the full values; each shard is its range.
        with c.summon("", "fc1", writeback=False) as s:
            assert sorted(s.units) == [fc1["index"]]
            assert torch.equal(s.params["fc1.bias"], torch.arange(5.0) + 0.5)
            assert "fc2.weight" not in s.params
        sh = {v.unit: v for v in c.shard_views("")}[fc1["index"]]
        assert sh.shard_offset == rank * 7
        full = torch.cat([torch.arange(15.0) + 0.5, torch.arange(5.0) + 0.5, torch.zeros(1)])
        assert torch.equal(sh.shard, full[rank * 7:(rank + 1) * 7])

        # rank0_only + writeback: rank 0 edits, every rank's shard gets it.
        with c.summon("", rank0_only=True, writeback=True) as s:
            if rank == 0:
                assert s.has_views
                s.params["fc2.bias"].copy_(torch.tensor([-1.0, -2.0]))
            else:
                assert not s.has_views and s.params == {}
        barrier.wait()
        with c.summon("", "fc2", writeback=False) as s:
            assert torch.equal(s.params["fc2.bias"], torch.tensor([-1.0, -2.0]))

        # Reduce-scatter: avg of (rank+1) * ones -> 2; sum with accumulate adds 6 more.
        g = torch.full((fc1["numel"],), float(rank + 1))  # unpadded numel: padding zero
        c.reduce_scatter_grads("", fc1["index"], g, op="avg")
        sh = {v.unit: v for v in c.shard_views("")}[fc1["index"]]
        valid = max(0, min(7, fc1["numel"] - rank * 7))
        assert sh.grad is not None
        assert torch.equal(sh.grad[:valid], torch.full((valid,), 2.0))
        p = c.begin_reduce_scatter("", fc1["index"], op="sum", accumulate=True)
        assert p.unit == fc1["index"] and p.numel == fc1["padded_numel"]
        assert p.flat.shape == (21,) and p.flat.dtype == torch.float32
        p.grads["fc1.weight"].fill_(float(rank + 1))
        p.grads["fc1.bias"].fill_(float(rank + 1))
        p.finish()
        p.finish()  # idempotent
        sh = {v.unit: v for v in c.shard_views("")}[fc1["index"]]
        assert torch.equal(sh.grad[:valid], torch.full((valid,), 8.0))

        # with_grads: the full gradient comes back (units without one report none).
        with c.summon("", with_grads=True, writeback=False) as s:
            assert torch.equal(s.grads["fc1.weight"], torch.full((5, 3), 8.0))
            assert "fc2.weight" not in s.grads
            assert torch.equal(s.flat_grad(fc1["index"])[:20], torch.full((20,), 8.0))
        c.leave()
        c.close()
        return rank

    assert run_ranks(world, rank_fn) == [0, 1, 2]


def test_started_summons_and_reduce_scatters(daemon, group):
    """summon_async and finish_async: started calls complete while the caller goes on, keep
    one collective order with the calls after them, and report their errors at wait()."""
    world = 2

    def rank_fn(rank):
        c = connect(daemon)
        c.join(group, world, rank)
        reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_every_rank")
        for t in reg.init_summon.params.values():
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 0.5)
        reg.init_summon.end()
        fc1, fc2 = unit_of(reg.plan, "fc1"), unit_of(reg.plan, "fc2")
        # Two started, the second before the first was waited for; then a synchronous one.
        a = c.summon_async("", "fc2", writeback=False)
        b = c.summon_async("", "fc1", writeback=False)
        assert isinstance(a, flatshard.PendingSummon)
        with c.summon("", "", recurse=False, writeback=False):  # the root: holds nothing
            assert a.ready and b.ready  # the synchronous summon waited for both
        with b.wait() as s1, a.wait() as s2:
            assert torch.equal(s1.params["fc1.bias"], torch.arange(5.0) + 0.5)
            assert torch.equal(s2.params["fc2.bias"], torch.arange(2.0) + 0.5)
        # An error of a started summon comes at wait(), as summon raises it.
        with c.summon("", "fc1", writeback=True):
            refused = c.summon_async("", "fc1", writeback=True)
            with pytest.raises(flatshard.FailedPreconditionError, match="already unsharding"):
                refused.wait()
        with pytest.raises(flatshard.NotFoundError):
            c.summon_async("no-such-module", "")
        # A started reduce-scatter: the shard has its slice once wait() returned.
        p = c.begin_reduce_scatter("", fc2["index"], op="sum")
        p.flat.fill_(float(rank + 1))
        f = p.finish_async()
        assert isinstance(f, flatshard.FinishingReduceScatter) and f.unit == fc2["index"]
        f.wait()
        f.wait()  # the same result again
        with pytest.raises(flatshard.FailedPreconditionError, match="finish_async"):
            p.finish()
        sh = {v.unit: v for v in c.shard_views("")}[fc2["index"]]
        assert torch.equal(sh.grad, torch.full((sh.shard_numel,), 3.0))
        # The same unit's next phase one waits for its started phase two (and only for that:
        # tests/integration/client_overlap_test.cc), so the two gradients never mix.
        p = c.begin_reduce_scatter("", fc2["index"], op="sum")
        p.flat.fill_(float(rank + 1))
        f = p.finish_async()
        again = c.begin_reduce_scatter("", fc2["index"], op="sum")
        assert f.ready
        again.flat.fill_(10.0 * (rank + 1))
        f.wait()
        sh = {v.unit: v for v in c.shard_views("")}[fc2["index"]]
        assert torch.equal(sh.grad, torch.full((sh.shard_numel,), 3.0))
        again.finish()
        sh = {v.unit: v for v in c.shard_views("")}[fc2["index"]]
        assert torch.equal(sh.grad, torch.full((sh.shard_numel,), 30.0))
        c.leave()
        c.close()
        return rank

    assert run_ranks(world, rank_fn) == [0, 1]


def test_from_rank0_init(daemon, group):
    world = 2

    def rank_fn(rank):
        c = connect(daemon)
        c.join(group, world, rank)
        reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
        if rank == 0:
            for t in reg.init_summon.params.values():
                t.fill_(3.0)
        reg.init_summon.end()
        with c.summon("", writeback=False) as s:
            assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in s.params.values())
        c.close()

    run_ranks(world, rank_fn)


def test_summon_options(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    reg = c.register("", mlp_manifest(), MLP_POLICY)
    fc1 = unit_of(reg.plan, "fc1")
    # recurse=False at a unit root: that unit only.
    with c.summon("", "fc1", recurse=False) as s:
        assert s.units == [fc1["index"]] and set(s.params) == {"fc1.weight", "fc1.bias"}
    # recurse=False at a path that is no unit root: nothing unsharded, the daemon says so.
    # offload_to_cpu: host views (this daemon has only host memory anyway).
    with c.summon("", offload_to_cpu=True) as s:
        assert all(t.device.type == "cpu" for t in s.params.values())
        s.params["fc1.bias"].fill_(1.5)
    with c.summon("", with_grads=True, writeback=False) as s:
        assert s.grads == {}  # no gradient yet
        assert torch.equal(s.params["fc1.bias"], torch.full((5,), 1.5))
    assert isinstance(s.id, int) and isinstance(s.note, str)
    c.close()


def test_summon_path_not_a_unit_root(daemon, group):
    manifest, policy = read_model("gpt_tied")
    c = connect(daemon)
    c.join(group, 1, 0)
    reg = c.register("", manifest, policy)
    roots = {u["module"] for u in reg.plan["units"]}
    path = next(p for p in ("h.0.ln_1", "h.0.attn", "wte") if p not in roots)
    with c.summon("", path, recurse=False) as s:
        assert s.units == [] and not s.has_views and s.params == {}
        assert "not a unit root" in s.note
    c.close()


def test_steady_state_maps_nothing(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    c.register("", mlp_manifest(), MLP_POLICY)
    for _ in range(2):
        with c.summon("") as s:
            s.params["fc1.bias"].add_(1.0)
    before = c.segment_map_calls
    assert before > 0 and c.ipc_open_calls == 0
    for _ in range(5):
        with c.summon("") as s:
            s.params["fc1.bias"].add_(1.0)
    assert c.segment_map_calls == before
    with c.summon("", writeback=False) as s:
        assert torch.equal(s.params["fc1.bias"], torch.full((5,), 7.0))
    c.close()


def test_bfloat16_and_float16_units(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    c.register("bf", mlp_manifest("bfloat16"), MLP_POLICY)
    c.register("half", mlp_manifest("float16"), MLP_POLICY)
    with c.summon("bf") as s:
        w = s.params["fc1.weight"]
        assert w.dtype == torch.bfloat16 and w.shape == (5, 3)
        w.fill_(1.5)
        a = s.numpy_params["fc1.weight"]
        assert a.dtype == np.uint16 and a.shape == (5, 3)
        assert torch.equal(torch.from_numpy(a.view(np.int16)).view(torch.bfloat16), w)
    with c.summon("half") as s:
        assert s.params["fc2.weight"].dtype == torch.float16
        assert s.numpy_params["fc2.weight"].dtype == np.float16
        s.params["fc2.weight"].fill_(0.25)
    shards = c.shard_views("bf")
    assert all(v.dtype == torch.bfloat16 for v in shards)
    fc1 = [v for v in shards if v.shard_numel >= 15][0]
    assert torch.equal(fc1.shard[:15], torch.full((15,), 1.5, dtype=torch.bfloat16))
    with c.summon("half", writeback=False) as s:
        assert torch.equal(s.params["fc2.weight"], torch.full((2, 5), 0.25, dtype=torch.float16))
    c.close()


def test_shard_views_are_writable_and_zero_copy(daemon, group):
    """The optimizer writes shards in place; the next summon all-gathers the new values."""
    c = connect(daemon)
    c.join(group, 1, 0)
    reg = c.register("", mlp_manifest(), MLP_POLICY)
    fc2 = unit_of(reg.plan, "fc2")
    v = {s.unit: s for s in c.shard_views("")}[fc2["index"]]
    v.shard[:12] = torch.arange(12.0)
    assert v.numpy_shard[3] == 3.0
    with c.summon("", "fc2", writeback=False) as s:
        assert torch.equal(s.params["fc2.weight"].flatten(), torch.arange(10.0))
        assert torch.equal(s.params["fc2.bias"], torch.tensor([10.0, 11.0]))
    c.close()


def test_rejoin_lists_registered_modules(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    c.register("", mlp_manifest(), MLP_POLICY)
    with c.summon("") as s:
        s.params["fc1.bias"].fill_(9.0)
    c.close()
    c2 = connect(daemon)
    c2.join(group, 1, 0)
    assert c2.registered_modules == [""]
    c2.register("", mlp_manifest(), MLP_POLICY)  # re-attach
    with c2.summon("", writeback=False) as s:
        assert torch.equal(s.params["fc1.bias"], torch.full((5,), 9.0))
    c2.close()


def test_context_manager_ends_on_exception(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    c.register("", mlp_manifest(), MLP_POLICY)
    with pytest.raises(KeyError):
        with c.summon("") as s:
            s.params["fc1.bias"].fill_(4.0)
            raise KeyError("boom")
    assert s.ended
    # Ended (with writeback): a second summon is allowed and sees the write.
    with c.summon("", writeback=False) as s2:
        assert torch.equal(s2.params["fc1.bias"], torch.full((5,), 4.0))
    c.close()


def test_real_processes(daemon, group, tmp_path):
    """Two ranks as separate Python processes."""
    script = tmp_path / "rank.py"
    script.write_text(f"""
import sys, torch, flatshard
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import mlp_manifest, MLP_POLICY
rank = int(sys.argv[1])
c = flatshard.Client({daemon.address!r}, call_timeout=30, join_timeout=30)
c.join({group!r}, 2, rank)
reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
if rank == 0:
    for t in reg.init_summon.params.values():
        t.fill_(2.0)
reg.init_summon.end()
fc1 = [u for u in reg.plan["units"] if u["module"] == "fc1"][0]
c.reduce_scatter_grads("", fc1["index"], torch.full((fc1["padded_numel"],), float(rank)), op="sum")
with c.summon("", with_grads=True, writeback=False) as s:
    assert torch.equal(s.params["fc2.weight"], torch.full((2, 5), 2.0))
    assert torch.equal(s.grads["fc1.bias"], torch.full((5,), 1.0))
c.leave()
c.close()
print("rank", rank, "ok")
""")
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        assert f"rank {r} ok" in out


def wait_rank_state(daemon, group, rank, state, timeout):
    """Polls `flatshardctl groups --json` until `rank` of `group` is in `state`."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        out = subprocess.run([ctl(), "groups", f"--socket={daemon.socket}", "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        for g in json.loads(out.stdout)["groups"]:
            if g["group"] == group:
                seen = {r["rank"]: r["state"] for r in g["ranks"]}
                if seen.get(rank) == state:
                    return
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} of {group} not {state} after {timeout} s: {seen}")


def test_rank_killed_with_a_started_summon_in_flight(daemon, group, tmp_path):
    """Rank 1 starts a summon and is SIGKILLed while it is in flight: rank 0's collectives fail
    at once with UNAVAILABLE naming rank 1 (not at their deadline; the first may still pair
    with the victim's summon if that reached the daemon), and rank 0's shard still holds the
    committed initial values."""
    script = tmp_path / "victim.py"
    script.write_text(f"""
import os, signal, sys, flatshard
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import mlp_manifest, MLP_POLICY
c = flatshard.Client({daemon.address!r}, call_timeout=60, join_timeout=30)
c.join({group!r}, 2, 1)
reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
reg.init_summon.end()
started = c.summon_async("", "fc1", writeback=False)
print("started", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""")
    victim = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    c = connect(daemon, call_timeout=60.0)
    c.join(group, 2, 0)
    reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
    for t in reg.init_summon.params.values():
        t.fill_(2.0)
    reg.init_summon.end()
    out, _ = victim.communicate(timeout=60)
    assert victim.returncode == -9 and "started" in out, out
    t0 = time.monotonic()
    # Wait for the daemon to call rank 1 lost.
    wait_rank_state(daemon, group, 1, "lost", timeout=20)
    # The victim's summon may have reached the daemon before its lease ended: an op a departed
    # rank already submitted completes (server/group/membership.cc FailDeferred), so rank 0's
    # first summon may pair with it and succeed; the collective after it cannot complete.
    try:
        c.summon("", "fc1", writeback=False).end()
        paired = True
    except flatshard.UnavailableError as e:
        assert "rank 1" in str(e), e
        paired = False
    if paired:
        with pytest.raises(flatshard.UnavailableError, match="rank 1"):
            c.summon("", "fc1", writeback=False).end()
    assert time.monotonic() - t0 < 20, "the error came at the deadline, not at once"
    shards = {v.unit: v for v in shard_views_when_ready(c)}
    fc1 = unit_of(reg.plan, "fc1")
    valid = min(fc1["shard_numel"], fc1["numel"])
    assert torch.equal(shards[fc1["index"]].shard[:valid], torch.full((valid,), 2.0))
    c.close()


def test_grads_writeback_and_rank0_only_read(daemon, group):
    """with_grads + writeback persists gradient edits into the gradient shards; rank0_only
    without writeback gives rank 0 read-only views and the others none."""
    world = 2

    def rank_fn(rank):
        c = connect(daemon)
        c.join(group, world, rank)
        reg = c.register("", mlp_manifest(), MLP_POLICY)
        fc2 = unit_of(reg.plan, "fc2")
        c.reduce_scatter_grads("", fc2["index"], torch.ones(fc2["padded_numel"]), op="sum")
        with c.summon("", "fc2", with_grads=True) as s:
            g = s.grads["fc2.weight"]
            assert type(g) is torch.Tensor and torch.equal(g, torch.full((2, 5), 2.0))
            s.grads["fc2.weight"].fill_(5.0)
            s.grads["fc2.bias"].fill_(5.0)
        sh = {v.unit: v for v in c.shard_views("")}[fc2["index"]]
        valid = max(0, min(sh.shard_numel, fc2["numel"] - sh.shard_offset))
        assert torch.equal(sh.grad[:valid], torch.full((valid,), 5.0))
        with c.summon("", rank0_only=True, writeback=False, with_grads=True) as s:
            if rank == 0:
                assert isinstance(s.params["fc2.weight"], flatshard.ReadOnlyTensor)
                assert isinstance(s.grads["fc2.weight"], flatshard.ReadOnlyTensor)
                assert torch.equal(s.grads["fc2.bias"], torch.full((2,), 5.0))
                with pytest.raises(flatshard.ReadOnlyViewError):
                    s.grads["fc2.bias"].zero_()
            else:
                assert not s.has_views and s.grads == {} and s.units
        c.close()

    run_ranks(world, rank_fn)


def test_context_managers_and_numpy_shards(daemon, group):
    with connect(daemon) as c:
        c.join(group, 1, 0)
        reg = c.register("", mlp_manifest(), MLP_POLICY)
        fc1 = unit_of(reg.plan, "fc1")
        with c.begin_reduce_scatter("", fc1["index"], op="sum") as p:
            p.flat.fill_(0.5)
        assert p.finished
        v = {s.unit: s for s in c.shard_views("")}[fc1["index"]]
        g = v.numpy_grad
        assert isinstance(g, np.ndarray) and g.flags.writeable and g.shape == (v.shard_numel,)
        assert np.all(g[:20] == 0.5) and g.ctypes.data == v.grad.data_ptr()
        g[0] = 3.0  # the optimizer may write gradient shards in place too
        assert v.grad[0].item() == 3.0
        assert "UnitShard(unit=" in repr(v) and "Summoned(" in repr(c.summon("", writeback=False))
    assert c.closed


def test_group_over_two_daemons(tmp_path):
    """Ranks joining through their own daemons, naming daemon 0 as coordinator (the bytes
    move between the daemons over UCX, TCP loopback on one host)."""
    import flatshard.testing
    with flatshard.testing.LocalDaemon(peer=True, node_name="node0") as d0, \
            flatshard.testing.LocalDaemon(peer=True, node_name="node1") as d1:
        assert d0.peer_address and d0.peer_address != d1.peer_address
        daemons = [d0, d1]

        def rank_fn(rank):
            c = flatshard.Client(daemons[rank].address, call_timeout=30, join_timeout=30)
            c.join("two-nodes", 2, rank, token="t", coordinator=d0.peer_address)
            reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
            if rank == 0:
                for t in reg.init_summon.params.values():
                    t.fill_(1.25)
            reg.init_summon.end()
            fc1 = unit_of(reg.plan, "fc1")
            c.reduce_scatter_grads("", fc1["index"], torch.full((20,), float(rank + 1)), op="avg")
            with c.summon("", with_grads=True, writeback=False) as s:
                assert torch.equal(s.params["fc2.weight"], torch.full((2, 5), 1.25))
                assert torch.equal(s.grads["fc1.bias"], torch.full((5,), 1.5))
            c.leave()
            c.close()

        run_ranks(2, rank_fn)
