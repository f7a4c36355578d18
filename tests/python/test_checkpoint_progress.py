"""Progress callbacks of checkpoint calls against a real flatshardd (README "Checkpoints"):
``Client.save_checkpoint``/``load_checkpoint``/``import_safetensors`` and
``FlatShardModule.save_checkpoint``/``load_checkpoint`` call ``progress(done, total)`` on the
caller's thread, the last time with done == total == the report's bytes; a callback that
raises is not called again, the operation runs to its end and then its exception propagates
with the finished operation's report; a failed operation raises its own error.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_checkpoint_progress.py
"""
import json
import struct
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy


@pytest.fixture
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


@pytest.fixture
def client(daemon):
    c = flatshard.Client(daemon.address, call_timeout=60.0, join_timeout=60.0)
    c.join("progress-" + uuid.uuid4().hex[:8], 1, 0)
    yield c
    c.close()


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 8))


def wrapped(client):
    return FlatShardModule(build_model(), client, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def write_safetensors(path, tensors):
    """float32 tensors in the published safetensors layout (8-byte aligned header)."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        raw = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


class Recorder:
    def __init__(self, raise_at=None):
        self.calls = []
        self.threads = set()
        self.raise_at = raise_at

    def __call__(self, done, total):
        self.calls.append((done, total))
        self.threads.add(threading.get_ident())
        if self.raise_at is not None and len(self.calls) == self.raise_at:
            raise StopProgress(f"stop at call {len(self.calls)}")


class StopProgress(Exception):
    pass


def check_calls(rec, info):
    assert rec.threads == {threading.get_ident()}  # the caller's thread
    assert len(rec.calls) >= 2  # when the daemon starts, and the result
    for done, total in rec.calls:
        assert isinstance(done, int) and isinstance(total, int)
        assert 0 <= done <= total
    assert rec.calls[-1] == (info["bytes"], info["bytes"])
    assert info["bytes"] > 0


def test_client_save_load_and_import_report_progress(client, tmp_path):
    model = wrapped(client)
    with torch.no_grad():
        for p in model.sharded_parameters():
            p.add_(1.0)
    assert model.commit() == 1
    rec = Recorder()
    info = client.save_checkpoint("", str(tmp_path / "ckpt"), progress=rec)
    assert info["generation"] == 1 and "progress_error" not in info
    check_calls(rec, info)

    rec = Recorder()
    info = client.load_checkpoint("", str(tmp_path / "ckpt"), rec)
    assert info["generation"] == 1
    check_calls(rec, info)

    write_safetensors(tmp_path / "m.safetensors", build_model().state_dict())
    rec = Recorder()
    info = client.import_safetensors("", str(tmp_path / "m.safetensors"), progress=rec)
    check_calls(rec, info)


def test_a_raising_callback_stops_being_called_and_its_error_follows_the_finished_save(
        client, tmp_path):
    model = wrapped(client)
    assert model.commit() == 1
    rec = Recorder(raise_at=1)
    with pytest.raises(StopProgress, match="stop at call 1") as caught:
        model.save_checkpoint(str(tmp_path / "ckpt"), progress=rec)
    assert len(rec.calls) == 1  # never called again
    report = caught.value.flatshard_checkpoint
    assert report["generation"] == 1 and report["bytes"] > 0
    if hasattr(caught.value, "__notes__"):
        assert "the daemon finished the save anyway" in caught.value.__notes__[0]
    # The save ran to its end: a complete checkpoint that loads.
    assert (tmp_path / "ckpt" / "metadata.json").exists()
    assert client.load_checkpoint("", str(tmp_path / "ckpt"))["generation"] == 1


def test_a_raising_callback_during_a_module_load_leaves_the_module_at_the_loaded_step(
        client, tmp_path):
    model = wrapped(client)
    with torch.no_grad():
        for p in model.sharded_parameters():
            p.fill_(2.0)
    assert model.commit() == 1
    model.save_checkpoint(str(tmp_path / "ckpt"))
    with torch.no_grad():
        for p in model.sharded_parameters():
            p.fill_(5.0)
    assert model.commit() == 2
    rec = Recorder(raise_at=1)
    with pytest.raises(StopProgress):
        model.load_checkpoint(str(tmp_path / "ckpt"), progress=rec)
    assert len(rec.calls) == 1
    # The load finished and this rank's views were read again: the values are the saved ones
    # and a commit is accepted without refresh_views().
    for p in model.sharded_parameters():
        assert torch.all(p == 2.0)
    assert model.commit() == 2


def test_a_failed_operation_raises_its_own_error_and_bad_callbacks_are_refused(client, tmp_path):
    wrapped(client).commit()
    rec = Recorder(raise_at=1)
    with pytest.raises(flatshard.FlatshardError, match="no-such"):
        client.load_checkpoint("", str(tmp_path / "no-such"), progress=rec)
    with pytest.raises(TypeError, match="progress must be callable or None, not int"):
        client.save_checkpoint("", str(tmp_path / "x"), progress=3)
    assert not (tmp_path / "x").exists()
