"""Read-only summons (writes raise, the process survives) and view lifetime (tensors
outliving their summon, Client and daemon)."""

import copy
import gc
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flatshard
from conftest import MLP_POLICY, connect, mlp_manifest, unit_of


@pytest.fixture
def client(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    reg = c.register("", mlp_manifest(), MLP_POLICY)
    with c.summon("") as s:
        s.params["fc1.weight"].copy_(torch.arange(15.0).view(5, 3))
        s.params["fc1.bias"].fill_(1.0)
    c.reg = reg
    yield c
    c.close()


WRITES = [
    ("add_", lambda t: t.add_(1)),
    ("zero_", lambda t: t.zero_()),
    ("fill_", lambda t: t.fill_(3.0)),
    ("copy_", lambda t: t.copy_(torch.ones_like(t))),
    ("setitem", lambda t: t.__setitem__(0, 5.0)),
    ("iadd", lambda t: t.__iadd__(1)),
    ("imul", lambda t: t.__imul__(2)),
    ("out=", lambda t: torch.add(t, 1, out=t)),
    ("view then write", lambda t: t.view(-1).fill_(1.0)),
    ("slice then write", lambda t: t[1:].mul_(2)),
    ("detach then write", lambda t: t.detach().add_(1)),
    ("relu inplace", lambda t: F.relu(t, inplace=True)),
    ("hardtanh positional inplace", lambda t: F.hardtanh(t, -1.0, 1.0, True)),
    ("dropout positional inplace", lambda t: F.dropout(t, 0.5, True, True)),
    ("foreach", lambda t: torch._foreach_add_([torch.zeros(1), t], 1.0)),
    ("nn.init", lambda t: torch.nn.init.uniform_(t)),
    (".data write", lambda t: t.data.add_(1)),
    ("set via view_as", lambda t: t.view_as(t).copy_(t + 1)),
    ("index_put_", lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(9.0))),
    ("clamp_", lambda t: t.clamp_(max=0.0)),
    ("masked_fill_", lambda t: t.masked_fill_(t > 0, 0.0)),
]


@pytest.mark.parametrize("name,write", WRITES, ids=[w[0] for w in WRITES])
def test_read_only_write_raises(client, name, write):
    with client.summon("", writeback=False) as s:
        t = s.params["fc1.weight"]
        assert isinstance(t, flatshard.ReadOnlyTensor)
        before = t.clone()
        with pytest.raises(flatshard.ReadOnlyViewError) as e:
            write(t)
        assert "read-only" in str(e.value)
        assert torch.equal(t, before)  # nothing was written; the process is alive
    with client.summon("", writeback=False) as s:
        assert torch.equal(s.params["fc1.weight"], torch.arange(15.0).view(5, 3))


def test_read_only_reads_and_fresh_results(client):
    with client.summon("", writeback=False) as s:
        w, b = s.params["fc1.weight"], s.params["fc1.bias"]
        x = torch.ones(2, 3)
        y = F.linear(x, w, b)  # reads work
        assert type(y) is torch.Tensor and torch.equal(y, x @ torch.arange(15.0).view(5, 3).T + 1)
        y.add_(1)  # fresh results are ordinary writable tensors
        c = w.clone()
        assert type(c) is torch.Tensor
        c.add_(1)
        assert w.sum().item() == sum(range(15))
        assert isinstance(w.T, flatshard.ReadOnlyTensor)  # views stay guarded
        w.requires_grad_(True).requires_grad_(False)  # in-place metadata ops are fine
        assert isinstance(w[0], flatshard.ReadOnlyTensor)
        other = torch.zeros(5, 3)
        other.copy_(w)  # a read-only tensor as the source is fine
        assert torch.equal(other, w)
        # numpy: read-only arrays, a write raises ValueError.
        a = w.numpy()
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0, 0] = 1.0
        na = s.numpy_params["fc1.weight"]
        assert not na.flags.writeable and na.ctypes.data == w.data_ptr()
        with pytest.raises(ValueError):
            na[0, 0] = 1.0
        with pytest.raises(ValueError):
            np.asarray(w)[0, 0] = 1.0
        with pytest.raises(flatshard.ReadOnlyViewError):
            s.flat(client.reg.plan["units"][0]["index"]).zero_()
        assert "ReadOnly" in repr(w)
        # state-dict style copies are private, ordinary tensors.
        dc = copy.deepcopy({"w": w})["w"]
        assert type(dc) is torch.Tensor and dc.data_ptr() != w.data_ptr()
        dc.add_(1)
        buf = io.BytesIO()
        torch.save({"w": w}, buf)
        buf.seek(0)
        loaded = torch.load(buf)["w"]
        assert type(loaded) is torch.Tensor and torch.equal(loaded, w)
    with client.summon("", writeback=False) as s:
        assert torch.equal(s.params["fc1.weight"], torch.arange(15.0).view(5, 3))


def test_writable_summon_tensors_are_plain(client):
    with client.summon("") as s:
        t = s.params["fc1.weight"]
        assert type(t) is torch.Tensor
        assert s.numpy_params["fc1.weight"].flags.writeable


def test_tensor_outlives_summon(client):
    """After End the tensor stays mapped (no crash); writes to it are lost."""
    s = client.summon("")
    t = s.params["fc1.bias"]
    flat = s.flat(unit_of(client.reg.plan, "fc1")["index"])
    arr = s.numpy_params["fc1.bias"]
    s.end()
    assert s.params == {}
    _ = t.sum().item() + flat.sum().item() + float(arr.sum())  # readable, whatever it holds
    t.fill_(123.0)  # lost: the bytes are the daemon's again
    arr[:] = 77.0
    del s
    gc.collect()
    with client.summon("", writeback=False) as s2:
        assert torch.equal(s2.params["fc1.bias"], torch.ones(5))


def test_summon_dropped_without_end_is_ended(client):
    s = client.summon("")
    t = s.params["fc1.bias"]
    t.fill_(2.0)
    del s
    gc.collect()  # the C++ SummonedParams ends it (with writeback) on destruction
    with client.summon("", writeback=False) as s2:
        assert torch.equal(s2.params["fc1.bias"], torch.full((5,), 2.0))
    t.add_(1)  # still mapped, no crash


def test_views_outlive_client_and_daemon(daemon, group):
    c = connect(daemon)
    c.join(group, 1, 0)
    c.register("", mlp_manifest(), MLP_POLICY)
    s = c.summon("")
    s.params["fc1.bias"].fill_(6.0)
    t = s.params["fc1.bias"]
    ro_shards = c.shard_views("")
    shard = ro_shards[0].shard
    p = c.begin_reduce_scatter("", ro_shards[0].unit)
    g = p.flat
    p.finish()
    c.close()  # the lease ends: the daemon ends the summon without writeback
    with pytest.raises(flatshard.FailedPreconditionError):
        s.end()
    assert torch.equal(t, torch.full((5,), 6.0))  # still mapped after the Client is gone
    daemon.stop()  # the daemon removes its segments; our mappings stay
    assert t.sum().item() == 30.0
    shard.add_(1)
    g.add_(1)
    del s, ro_shards, p
    gc.collect()
    assert t.sum().item() == 30.0


def test_summon_from_another_thread(client):
    """A Client made in one thread summons from another."""
    import threading
    errs = []

    def reader():
        try:
            for _ in range(5):
                with client.summon("", "fc1", writeback=False) as s:
                    assert s.params["fc1.bias"].sum().item() == 5.0
        except Exception as e:  # reported below
            errs.append(e)

    th = threading.Thread(target=reader)
    th.start()
    th.join(60)
    assert not th.is_alive() and not errs, errs
