"""The core of the package without torch, in this interpreter (which has torch): `import
flatshard` leaves torch unimported, and with torch made unimportable (sys.modules["torch"] =
None, in a child process) the core works with memoryviews while every tensor feature raises an
ImportError naming torch. The venv test (wheel/) checks the same with no torch installed."""

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import sys
    BLOCK = sys.argv[1] == "block"
    if BLOCK:
        sys.modules["torch"] = None  # import torch -> ModuleNotFoundError(name="torch")
    import flatshard, flatshard.testing
    assert "torch" not in sys.modules or BLOCK, "import flatshard imported torch"
    if not BLOCK:
        print("no torch imported")
        sys.exit(0)

    def needs_torch(what, fn):
        try:
            fn()
        except ImportError as e:
            assert "torch" in str(e) and e.name == "torch", (what, e)
        else:
            raise AssertionError(what + " worked without torch")

    needs_torch("ReadOnlyTensor", lambda: flatshard.ReadOnlyTensor)
    manifest = {"format": "flatshard.manifest/1", "root": {
        "id": 0, "type": "Net", "bases": ["Module"], "children": [], "params": [
            {"name": "w", "id": 0, "shape": [4], "dtype": "float32", "requires_grad": True}]}}
    with flatshard.testing.LocalDaemon() as d, flatshard.Client(d.address) as c:
        c.join("no-torch", 1, 0)
        reg = c.register("", manifest, init="from_rank0")
        w = reg.init_summon.memoryview_params["w"]
        for i, x in enumerate((0.0, 2.5, 0.0, 0.0)):
            w[i] = x
        needs_torch("Summoned.params", lambda: reg.init_summon.params)
        needs_torch("Summoned.flat", lambda: reg.init_summon.flat(0))
        reg.init_summon.end()
        s = c.summon("")
        assert s.memoryview_params["w"].tolist() == [0.0, 2.5, 0.0, 0.0]
        s.end()
        st = c.register_state("", [("m", "float32", "shard")])
        needs_torch("UnitShard.shard", lambda: st[0].shard)
        needs_torch("UnitShard.dtype", lambda: st[0].dtype)
        needs_torch("UnitShard.state", lambda: st[0].state("m"))
        assert st[0].dtype_name == "float32" and st[0].memoryview_shard.tolist()[1] == 2.5
        p = c.begin_reduce_scatter("", 0)
        needs_torch("PendingReduceScatter.flat", lambda: p.flat)
        g = p.memoryview_flat
        assert g.format == "f" and not g.readonly and len(g) == p.numel >= 4
        for i, x in enumerate((1.0, -2.0, 0.5, 4.0)):
            g[i] = x
        p.finish()
        gs = c.shard_views("")[0].memoryview_grad
        assert gs is not None and gs.tolist()[:4] == [1.0, -2.0, 0.5, 4.0], gs.tolist()
        needs_torch("reduce_scatter_grads", lambda: c.reduce_scatter_grads("", 0, [0.0] * 4))
        # Published weights: publish and read them back as memoryviews.
        c.commit("")
        info = c.publish("", "no-torch-weights", dtype="float16")
        import struct
        import flatshard.weights
        with flatshard.weights.open("no-torch-weights", address=d.address) as wv:
            assert (wv.version, wv.dtype_name("w"), wv.shape("w")) == (1, "float16", (4,))
            needs_torch("Weights tensors", lambda: wv["w"])
            mv = wv.memoryviews()["w"]
            assert mv.readonly and mv.format == "e" and mv.nbytes == 8
            assert bytes(mv) == struct.pack("=4e", 0.0, 2.5, 0.0, 0.0)  # tolist() lacks "e"
        assert info.version == 1 and info.tensors == 1
        c.leave()
    print("core ok without torch")
''')


def _run(mode):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_does_not_import_torch():
    r = _run("plain")
    assert r.returncode == 0 and "no torch imported" in r.stdout, r.stdout + r.stderr


def test_core_works_and_tensor_features_name_torch_when_torch_is_missing():
    r = _run("block")
    assert r.returncode == 0 and "core ok without torch" in r.stdout, r.stdout + r.stderr[-3000:]
