"""Run by an installed flatshard wheel's interpreter (a venv without system site packages, no
torch, no numpy): the core imports and does real work against a real flatshardd
($FLATSHARD_DAEMON): join, register a small module, fill it through the init summon, summon it
back and check the values, through memoryviews. Prints "wheel ok: <package dir>"."""

import os
import struct
import sys
import uuid

import flatshard
import flatshard.testing

pkg_dir = os.path.dirname(flatshard.__file__)
assert pkg_dir.startswith(sys.prefix), (pkg_dir, sys.prefix)  # the venv's copy, not the tree's
assert sys.prefix != sys.base_prefix, "not a virtual environment"
for name in ("py.typed", "_C.pyi"):
    assert os.path.isfile(os.path.join(pkg_dir, name)), name
assert "torch" not in sys.modules, "import flatshard imported torch"
try:
    import torch  # noqa: F401
    has_torch = True
except ImportError:
    has_torch = False

MANIFEST = {
    "format": "flatshard.manifest/1",
    "root": {"id": 0, "type": "Net", "bases": ["Module"], "children": [], "params": [
        {"name": "weight", "id": 0, "shape": [2, 3], "dtype": "float32", "requires_grad": True},
        {"name": "bias", "id": 1, "shape": [2], "dtype": "float32", "requires_grad": True},
    ]},
}

with flatshard.testing.LocalDaemon() as daemon:
    c = flatshard.Client(daemon.address)
    c.join("wheel-" + uuid.uuid4().hex[:8], 1, 0)
    reg = c.register("", MANIFEST, init="from_rank0")
    assert reg.init_summon is not None and len(reg.plan["units"]) == 1, reg
    views = reg.init_summon.memoryview_params
    w, b = views["weight"], views["bias"]
    assert (w.format, w.shape, w.readonly) == ("f", (2, 3), False), (w.format, w.shape)
    assert (b.format, b.shape) == ("f", (2,)), (b.format, b.shape)
    for i in range(2):
        for j in range(3):
            w[i, j] = 10 * i + j + 0.5
    b[0], b[1] = -7.0, 2.0**40
    reg.init_summon.end()

    with c.summon("", writeback=False) as s:
        got = s.memoryview_params
        assert got["weight"].tolist() == [[0.5, 1.5, 2.5], [10.5, 11.5, 12.5]], got["weight"].tolist()
        assert got["bias"].tolist() == [-7.0, 2.0**40]
        assert got["weight"].readonly
        try:
            got["weight"][0, 0] = 1.0
            raise AssertionError("a read-only summon's memoryview took a write")
        except TypeError:
            pass
        if not has_torch:
            try:
                s.params
                raise AssertionError("Summoned.params without torch did not raise")
            except ImportError as e:
                assert "torch" in str(e) and "memoryview_params" in str(e), e

    shards = c.shard_views("")
    assert shards.generation == 0, shards.generation  # the initial values
    assert len(shards) == 1 and shards[0].dtype_name == "float32", shards
    flat = struct.unpack(f"<{shards[0].shard_numel}f", bytes(shards[0].memoryview_shard))
    assert flat[:8] == (0.5, 1.5, 2.5, 10.5, 11.5, 12.5, -7.0, 2.0**40), flat  # one rank: all
    c.leave()
    c.close()
print("wheel ok:", pkg_dir, "torch" if has_torch else "no torch")
