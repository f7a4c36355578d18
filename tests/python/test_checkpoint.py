"""Checkpoints and safetensors against a real flatshardd process (README "Checkpoints"):
save, modify, load -> bit-exact restore; load into another world size and another wrap
policy -> values equal by FQN; `flatshardctl checkpoint export` of a torch model equals its
state_dict() read back by an independent safetensors reader (numpy + struct, written from the
published format, not from flatshard's code); import of a safetensors file as initial values;
`checkpoint inspect` naming a corrupt file. Ranks are threads (one Client each).

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_checkpoint.py
"""
import json
import os
import struct
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy, always_wrap_policy

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import gpt  # noqa: E402

_RNG = threading.Lock()


def ctl():
    daemon = os.environ.get("FLATSHARD_DAEMON")
    if daemon:
        return str(Path(daemon).resolve().parents[1] / "client" / "flatshardctl")
    return "flatshardctl"


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def build_gpt(seed=0):
    with _RNG:
        return gpt.build_gpt(seed)


def run_ranks(daemon, world, fn, group=None, timeout=120):
    """fn(rank, client, barrier) on `world` threads joined to one group; results by rank."""
    group = group or "ck-" + uuid.uuid4().hex[:8]
    barrier = threading.Barrier(world, timeout=timeout)
    results, errors = {}, {}

    def body(rank):
        c = flatshard.Client(daemon.address, call_timeout=60.0, join_timeout=60.0)
        try:
            c.join(group, world, rank)
            results[rank] = fn(rank, c, barrier)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors[rank] = e
            barrier.abort()
        finally:
            c.close()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"a rank did not finish within {timeout}s"
    if errors:
        raise errors[min(errors)]
    return results


def shard_bytes(client):
    return [bytes(v.shard.numpy().tobytes()) for v in client.shard_views("")]


# ---- an independent safetensors reader and writer (the published format) ----

_NP = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64,
       "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    buf = data[8 + n:]
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1]) for v in header.values())
    at = 0
    for b, e in spans:  # contiguous, no overlap, covering the byte buffer
        assert b == at, (b, at)
        at = e
    assert at == len(buf)
    out = {}
    for name, v in header.items():
        b, e = v["data_offsets"]
        arr = np.frombuffer(buf[b:e], dtype=_NP[v["dtype"]]).reshape(v["shape"])
        out[name] = arr
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        raw = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64"}[t.dtype],
                        "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- tests ----

def test_save_modify_load_is_bit_exact_and_marks_ranks_stale(daemon, tmp_path):
    ckpt = tmp_path / "ckpt"

    def rank_fn(rank, c, barrier):
        model = FlatShardModule(build_gpt(), c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
        with torch.no_grad():
            for p in model.sharded_parameters():
                p.add_(0.25 * (rank + 1))
        assert model.commit() == 1
        saved = shard_bytes(c)
        barrier.wait()
        if rank == 0:
            info = c.save_checkpoint("", str(ckpt))
            assert info["generation"] == 1 and info["files"] == 2 and info["ranks"] == 2
        barrier.wait()
        with torch.no_grad():  # another step on top
            for p in model.sharded_parameters():
                p.mul_(3.0)
        assert model.commit() == 2
        assert shard_bytes(c) != saved
        barrier.wait()
        if rank == 0:
            info = c.load_checkpoint("", str(ckpt))
            assert info["generation"] == 1
        barrier.wait()
        # The load marked every rank stale: a commit before reading the views is refused.
        with pytest.raises(flatshard.FailedPreconditionError, match="read them again"):
            model.commit()
        barrier.wait()
        assert model.refresh_views() == 1
        assert shard_bytes(c) == saved  # bit for bit, every unit of this rank
        assert model.commit() == 2
        return True

    assert run_ranks(daemon, 2, rank_fn) == {0: True, 1: True}
    names = sorted(os.listdir(ckpt))
    assert names == ["metadata.json", "rank-00000-of-00002.bin", "rank-00001-of-00002.bin"]


def full_sd(model):
    return {k: v.clone() for k, v in model.full_state_dict().items()}


def test_load_into_other_world_size_and_wrap_policy(daemon, tmp_path):
    ckpt = tmp_path / "ckpt"

    def save_fn(rank, c, barrier):
        model = FlatShardModule(build_gpt(1), c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
        with torch.no_grad():
            for p in model.sharded_parameters():
                p.add_(torch.arange(p.numel(), dtype=p.dtype) * 1e-3 + rank)
        model.commit()
        sd = full_sd(model)
        barrier.wait()
        if rank == 0:
            c.save_checkpoint("", str(ckpt))
        barrier.wait()
        return sd

    expected = run_ranks(daemon, 2, save_fn)[0]

    for world, policy in [(3, always_wrap_policy), (1, None), (4, ModuleWrapPolicy({gpt.Block}))]:
        def load_fn(rank, c, barrier, policy=policy):
            model = FlatShardModule(build_gpt(2), c, auto_wrap_policy=policy)
            barrier.wait()
            if rank == 0:
                info = model.load_checkpoint(str(ckpt))
                assert info["ranks"] == world
            barrier.wait()
            model.refresh_views()
            return full_sd(model)

        got = run_ranks(daemon, world, load_fn)
        for rank in range(world):
            assert set(got[rank]) == set(expected)
            for k in expected:
                if k == "lm_head.weight" and policy is always_wrap_policy:
                    # flatshard.torch's full_state_dict returns the tied lm_head.weight flat
                    # when it lies in another unit than its module (an existing quirk of
                    # full_state_dict, not of checkpoints); wte.weight is the same tensor.
                    continue
                assert torch.equal(got[rank][k], expected[k]), (world, rank, k)


def test_export_equals_state_dict_and_import_as_initial_values(daemon, tmp_path):
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "model.safetensors"

    def rank_fn(rank, c, barrier):
        model = FlatShardModule(build_gpt(3), c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
        with torch.no_grad():
            for p in model.sharded_parameters():
                p.mul_(1.5)
        model.commit()
        sd = full_sd(model)
        barrier.wait()
        if rank == 0:
            c.save_checkpoint("", str(ckpt))
        barrier.wait()
        return sd

    sd = run_ranks(daemon, 2, rank_fn)[0]
    r = subprocess.run([ctl(), "checkpoint", "export", str(ckpt), "--out", str(out), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tensors, meta = read_safetensors(out)
    # Keys: exactly the unwrapped module's state_dict (tied lm_head.weight too; GPT's only
    # buffer, the attention mask, is not persistent).
    plain = gpt.build_gpt(0)
    assert set(tensors) == set(plain.state_dict())
    assert "lm_head.weight" in tensors and "wte.weight" in tensors
    for k, v in sd.items():
        assert tensors[k].shape == tuple(v.shape), k
        assert np.array_equal(tensors[k], v.numpy()), k
    assert meta["format"] == "pt" and meta["flatshard.generation"] == "1"
    # The exported file loads into a plain torch module.
    plain.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tensors.items()})

    # Import as initial values: a file written by the independent writer, with a buffer-like
    # extra tensor the module does not have (skipped and counted).
    src = gpt.build_gpt(7).state_dict()
    extra = dict(src)
    extra["not.a.param"] = torch.arange(3, dtype=torch.int64)
    written = tmp_path / "init.safetensors"
    write_safetensors(written, extra, {"format": "pt"})

    def import_fn(rank, c, barrier):
        model = FlatShardModule(build_gpt(0), c, auto_wrap_policy=always_wrap_policy)
        barrier.wait()
        if rank == 0:
            info = model.load_checkpoint(safetensors=str(written))
            assert info["unused_tensors"] == 1
            assert info["generation"] == 1
        barrier.wait()
        assert model.refresh_views() == 1
        return full_sd(model)

    got = run_ranks(daemon, 3, import_fn)
    for rank in range(3):
        for k, v in src.items():
            if k == "lm_head.weight":
                continue  # full_state_dict's quirk under always_wrap (see above): wte.weight
            assert torch.equal(got[rank][k], v), (rank, k)


def test_inspect_and_refusals_name_the_file(daemon, tmp_path):
    ckpt = tmp_path / "ckpt"

    def rank_fn(rank, c, barrier):
        FlatShardModule(build_gpt(), c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
        barrier.wait()
        if rank == 0:
            c.save_checkpoint("", str(ckpt))
        barrier.wait()
        if rank == 0:
            f = ckpt / "rank-00001-of-00002.bin"
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            f.write_bytes(bytes(raw))
            with pytest.raises(flatshard.FlatshardError, match="rank-00001-of-00002.bin.*corrupt"):
                c.load_checkpoint("", str(ckpt))
            raw[len(raw) // 2] ^= 0x01
            f.write_bytes(bytes(raw))
            os.rename(ckpt / "metadata.json", ckpt / "m.json")
            with pytest.raises(flatshard.FailedPreconditionError, match="incomplete checkpoint"):
                c.load_checkpoint("", str(ckpt))
            os.rename(ckpt / "m.json", ckpt / "metadata.json")
        barrier.wait()

    run_ranks(daemon, 2, rank_fn)
    r = subprocess.run([ctl(), "checkpoint", "inspect", str(ckpt), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["valid"] and doc["world_size"] == 2 and doc["generation"] == 0
    assert doc["tensor_names"] == ["shard"]
    # A truncated file: refused offline too, naming it.
    f = ckpt / "rank-00000-of-00002.bin"
    f.write_bytes(f.read_bytes()[:-5])
    r = subprocess.run([ctl(), "checkpoint", "inspect", str(ckpt)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "rank-00000-of-00002.bin" in r.stderr and "truncated" in r.stderr


def test_saves_during_commits_hold_one_generation(daemon, tmp_path):
    """Commits run back to back while rank 0 saves three times: every saved file holds the
    checkpoint's generation and nothing else (commit k fills every shard with k), so no save
    mixed two steps, and the commits that landed during a save went through after it."""
    units, rows, cols = 4, 1024, 1024  # 16 MiB of float32 shards over 2 ranks
    man = json.dumps({"format": "flatshard.manifest/1", "root": {
        "id": 0, "type": "Net", "bases": ["Module"], "params": [],
        "children": [{"name": f"l{i}", "module": {
            "id": i + 1, "type": "Linear", "bases": ["Module"], "children": [],
            "params": [{"name": "weight", "id": i, "shape": [rows, cols], "dtype": "float32",
                        "requires_grad": True}]}} for i in range(units)]}})
    pol = json.dumps({"format": "flatshard.policy/1",
                      "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})
    commits = 30
    saved = []

    def rank_fn(rank, c, barrier):
        c.register("", man, pol, init="zeros")
        views = c.shard_views("")
        barrier.wait()
        saver = None
        if rank == 0:
            def save_loop():
                for i in range(3):
                    saved.append(c.save_checkpoint("", str(tmp_path / f"c{i}")))
            saver = threading.Thread(target=save_loop)
        for k in range(1, commits + 1):
            for v in views:
                v.shard.fill_(float(k))
            assert c.commit("") == k
            if k == 1 and saver is not None:
                saver.start()
        if saver is not None:
            saver.join(120)
        barrier.wait()

    run_ranks(daemon, 2, rank_fn)
    assert len(saved) == 3
    print("saved generations", [s["generation"] for s in saved])
    for i in range(3):
        d = tmp_path / f"c{i}"
        meta = json.loads((d / "metadata.json").read_text())
        g = meta["generation"]
        assert 1 <= g <= commits
        for t in meta["tensors"]:
            raw = (d / meta["files"][t["rank"]]["name"]).read_bytes()
            vals = np.frombuffer(raw[t["offset"]:t["offset"] + t["bytes"]], dtype=np.float32)
            assert vals.size == rows * cols // 2
            assert np.all(vals == float(g)), (i, g, t["rank"], t["unit"], np.unique(vals)[:4])


def test_daemon_killed_during_save_leaves_a_refused_checkpoint(tmp_path):
    """kill -9 of the daemon while it writes a checkpoint over an older one in the same
    directory: the directory is refused as incomplete (its metadata went first), never read as
    the old checkpoint with new data or the other way round. The other, completed checkpoint
    is still valid."""
    rows, cols, units = 2048, 2048, 8  # 128 MiB of shards: the write takes a while
    man = json.dumps({"format": "flatshard.manifest/1", "root": {
        "id": 0, "type": "Net", "bases": ["Module"], "params": [],
        "children": [{"name": f"l{i}", "module": {
            "id": i + 1, "type": "Linear", "bases": ["Module"], "children": [],
            "params": [{"name": "weight", "id": i, "shape": [rows, cols], "dtype": "float32",
                        "requires_grad": True}]}} for i in range(units)]}})
    pol = json.dumps({"format": "flatshard.policy/1",
                      "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})
    d = flatshard.testing.LocalDaemon().start()
    try:
        c = flatshard.Client(d.address, call_timeout=60.0)
        c.join("kill-" + uuid.uuid4().hex[:6], 1, 0)
        c.register("", man, pol, init="zeros")
        c.save_checkpoint("", str(tmp_path / "done"))
        c.save_checkpoint("", str(tmp_path / "ckpt"))  # the older checkpoint
        errors = []

        def save():
            try:
                c.save_checkpoint("", str(tmp_path / "ckpt"))
            except flatshard.FlatshardError as e:
                errors.append(e)

        t = threading.Thread(target=save)
        t.start()
        # Kill once the new write is under way: its metadata is gone, some data written.
        for _ in range(2000):
            names = os.listdir(tmp_path / "ckpt")
            if "metadata.json" not in names and any(n.endswith(".tmp") for n in names):
                break
            threading.Event().wait(0.001)
        d.kill()
        t.join(60)
        assert errors, "the save should have failed with the daemon"
        c.close()
    finally:
        d.stop()
    r = subprocess.run([ctl(), "checkpoint", "inspect", str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "metadata.json: missing (an incomplete checkpoint" in r.stderr, r.stderr
    r = subprocess.run([ctl(), "checkpoint", "inspect", str(tmp_path / "done")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_cli_usage_errors(tmp_path):
    def run(*args):
        return subprocess.run([ctl(), "checkpoint", *args], capture_output=True, text=True,
                              timeout=60)
    assert run().returncode == 2
    r = run("--help")
    assert r.returncode == 0 and "inspect DIR" in r.stdout
    r = run("bogus")
    assert r.returncode == 2 and "unknown subcommand" in r.stderr
    r = run("save", "g")
    assert r.returncode == 2 and "--dir DIR is required" in r.stderr
    r = run("save", "g", "--dir", str(tmp_path), "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 1 and r.stderr.startswith("flatshardctl checkpoint save: ")
    r = run("import", "g")
    assert r.returncode == 2 and "--file FILE is required" in r.stderr
    r = run("inspect", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "nothing" in r.stderr
    r = run("export", str(tmp_path))
    assert r.returncode == 2 and "--out FILE is required" in r.stderr
    r = run("inspect", "--help")
    assert r.returncode == 0 and "CRC-32C" in r.stdout


def test_simulated_gpu_ranks_save_and_load_through_host_memory(tmp_path):
    """`flatshardd --simulate_gpus`: the daemon's GPU code paths (shards in "device" memory,
    copies through RankDevices) with host memory standing in. Save, change, load: the shards
    and the committed copies are back, and a checkpoint of a GPU group loads into a host one."""
    man = json.dumps({"format": "flatshard.manifest/1", "root": {
        "id": 0, "type": "Net", "bases": ["Module"], "params": [],
        "children": [{"name": f"l{i}", "module": {
            "id": i + 1, "type": "Linear", "bases": ["Module"], "children": [],
            "params": [{"name": "weight", "id": i, "shape": [33, 7], "dtype": "float32",
                        "requires_grad": True}]}} for i in range(3)]}})
    pol = json.dumps({"format": "flatshard.policy/1",
                      "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})
    ckpt = str(tmp_path / "gpu")
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=2",)) as d:
        group = "gpu-" + uuid.uuid4().hex[:6]
        barrier = threading.Barrier(2, timeout=60)
        out, errors = {}, []

        def body(rank):
            c = flatshard.Client(d.address, call_timeout=60.0, _simulated_gpus=True)
            try:
                c.join(group, 2, rank)
                c.register("", man, pol, init="zeros")
                views = c.shard_views("")
                assert all(v.device >= 0 for v in views)
                for v in views:
                    v.shard.copy_(torch.arange(v.shard.numel(), dtype=torch.float32) + 100 * rank)
                    valid = max(0, min(v.shard_numel, 33 * 7 - v.shard_offset))
                    v.shard[valid:] = 0  # padding stays zero (a load writes zeros there)
                c.commit("")
                want = [v.shard.clone() for v in c.shard_views("")]
                barrier.wait()
                if rank == 0:
                    assert c.save_checkpoint("", ckpt)["generation"] == 1
                barrier.wait()
                for v in views:
                    v.shard.fill_(-1.0)
                c.commit("")
                barrier.wait()
                if rank == 0:
                    assert c.load_checkpoint("", ckpt)["generation"] == 1
                barrier.wait()
                got = [v.shard.clone() for v in c.shard_views("")]
                for u, (a, b) in enumerate(zip(got, want)):
                    assert torch.equal(a, b), (rank, u, a[:8], b[:8])
                assert c.commit("") == 2  # and the committed copies hold the loaded values
                out[rank] = want
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                barrier.abort()
            finally:
                c.close()

        ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        if errors:
            raise errors[0]
    # The GPU group's checkpoint into a host-memory group of one rank: equal by FQN.
    with flatshard.testing.LocalDaemon() as d:
        c = flatshard.Client(d.address, call_timeout=60.0)
        c.join("host-" + uuid.uuid4().hex[:6], 1, 0)
        c.register("", man, pol, init="zeros")
        c.load_checkpoint("", ckpt)
        full = [v.shard.clone() for v in c.shard_views("")]
        c.close()
    for u in range(3):
        n = 33 * 7
        joined = torch.cat([out[0][u], out[1][u]])[:n]
        assert torch.equal(full[u][:n], joined), u


def test_cli_save_load_import_against_the_daemon(daemon, tmp_path):
    """`flatshardctl checkpoint save|load|import` over the daemon's socket (--json), as an
    operator would, while the group's ranks are joined; errors name the group or module."""
    ckpt = tmp_path / "cli"
    group = "cli-" + uuid.uuid4().hex[:6]

    def ctl_json(*args):
        r = subprocess.run([ctl(), "checkpoint", *args, "--socket", daemon.socket, "--json"],
                           capture_output=True, text=True, timeout=120)
        return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else r.stderr)

    def rank_fn(rank, c, barrier):
        model = FlatShardModule(build_gpt(4), c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
        with torch.no_grad():
            for p in model.sharded_parameters():
                p.add_(1.0)
        model.commit()
        want = shard_bytes(c)
        barrier.wait()
        if rank == 0:
            code, out = ctl_json("save", group, "--dir", str(ckpt))
            assert code == 0, out
            assert out["done"] and out["generation"] == 1 and out["files"] == 2
            code, out = ctl_json("save", group, "--dir", str(ckpt), "--module", "nope")
            assert code == 1 and "module \"nope\" is not registered" in out
            code, out = ctl_json("save", "no-such-group", "--dir", str(ckpt))
            assert code == 1 and "no-such-group" in out
        barrier.wait()
        with torch.no_grad():
            for p in model.sharded_parameters():
                p.zero_()
        model.commit()
        barrier.wait()
        if rank == 0:
            code, out = ctl_json("load", group, "--dir", str(ckpt))
            assert code == 0 and out["generation"] == 1, out
        barrier.wait()
        model.refresh_views()
        assert shard_bytes(c) == want
        barrier.wait()
        if rank == 0:
            st = tmp_path / "m.safetensors"
            r = subprocess.run([ctl(), "checkpoint", "export", str(ckpt), "--out", str(st)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            code, out = ctl_json("import", group, "--file", str(st))
            assert code == 0 and out["generation"] == model.generation + 1, out
        barrier.wait()
        model.refresh_views()
        assert shard_bytes(c) == want  # the same values, through a full state dict
        return True

    assert run_ranks(daemon, 2, rank_fn, group=group) == {0: True, 1: True}


def test_save_and_load_across_two_daemons(tmp_path):
    """A group over two daemons (2 ranks each, daemon 0 the coordinator): the daemon asked
    writes its ranks' files and asks the other (CheckpointPeerService on the peer port) to write
    its own into the same directory, then the metadata. Modify, load (asked at the other
    daemon): every rank's shards come back bit for bit. Then the checkpoint loads into a group
    of 3 ranks on one daemon, equal by FQN."""
    ckpt = tmp_path / "two"
    group = "two-" + uuid.uuid4().hex[:6]
    world = 4
    with flatshard.testing.LocalDaemon(peer=True, node_name="node0") as d0, \
            flatshard.testing.LocalDaemon(peer=True, node_name="node1") as d1:
        daemons = [d0, d0, d1, d1]
        barrier = threading.Barrier(world, timeout=120)
        results, errors = {}, []

        def body(rank):
            c = flatshard.Client(daemons[rank].address, call_timeout=60.0, join_timeout=60.0)
            try:
                c.join(group, world, rank, token="tok", coordinator=d0.peer_address)
                model = FlatShardModule(build_gpt(5), c,
                                        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
                with torch.no_grad():
                    for p in model.sharded_parameters():
                        p.add_(0.5 + rank)
                assert model.commit() == 1
                want = shard_bytes(c)
                sd = full_sd(model)
                barrier.wait()
                if rank == 0:
                    info = c.save_checkpoint("", str(ckpt))
                    assert info["files"] == world and info["ranks"] == world, info
                barrier.wait()
                with torch.no_grad():
                    for p in model.sharded_parameters():
                        p.mul_(-2.0)
                assert model.commit() == 2
                barrier.wait()
                if rank == 3:  # asked at the other daemon this time
                    info = c.load_checkpoint("", str(ckpt))
                    assert info["generation"] == 1 and info["ranks"] == world, info
                barrier.wait()
                assert model.refresh_views() == 1
                assert shard_bytes(c) == want
                assert model.commit() == 2  # every rank at one generation again
                results[rank] = sd
            except BaseException as e:  # noqa: BLE001
                errors.append((rank, e))
                barrier.abort()
            finally:
                c.close()

        ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        if errors:
            raise errors[0][1]
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert [f["name"] for f in meta["files"]] == [f"rank-0000{r}-of-00004.bin" for r in range(4)]
    expected = results[0]

    with flatshard.testing.LocalDaemon() as d:
        def load_fn(rank, c, barrier):
            model = FlatShardModule(build_gpt(6), c, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}))
            barrier.wait()
            if rank == 0:
                model.load_checkpoint(str(ckpt))
            barrier.wait()
            model.refresh_views()
            return full_sd(model)

        got = run_ranks(d, 3, load_fn)
    for k, v in expected.items():
        assert torch.equal(got[2][k], v), k
