"""Published weights in GPU memory from Python (issue 25, README "Versions in GPU memory"),
against `flatshardd --simulate_gpus` (device memory is host shared memory there).

What this checks: `Client.publish(..., device=N)` places a version on the daemon's GPU N
(`PublishedVersion.device`, `flatshard.weights.list()`); a reader that opens simulated device
memory (`Reader(..., _simulated_gpus=True)`) gets read-only tensors holding the committed
values; a reader whose torch has no CUDA gets FailedPreconditionError naming the version and
the GPU (and memoryviews()/numpy() say they read host memory); bad devices and grants are
named errors that publish nothing. What stays unverified without a GPU: torch consuming the
real CUDA capsule (a cuda:N tensor over CUDA IPC memory).
"""

import os

import pytest
import torch

import flatshard
import flatshard.testing
import flatshard.weights
from conftest import MLP_POLICY, mlp_manifest


@pytest.fixture
def gpu_daemon():
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=2",)) as d:
        yield d


@pytest.fixture
def trainer(gpu_daemon, group):
    """One rank with device shards (simulated GPU 0): fc1.weight = 0..14, fc1.bias = -3,
    committed (live-only changes never in a version: weights_device_test)."""
    c = flatshard.Client(gpu_daemon.address, call_timeout=30, join_timeout=30,
                         _simulated_gpus=True)
    c.join(group, 1, 0)
    reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
    assert all(v.device == 0 for v in reg.shards)
    for fqn, t in reg.init_summon.params.items():
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
    reg.init_summon.params["fc1.bias"].fill_(-3.0)
    reg.init_summon.end()
    c.commit("")
    yield c
    c.close()


def test_device_version_holds_the_committed_step_and_names_its_gpu(gpu_daemon, trainer):
    info = trainer.publish("", "dev", device=1)
    assert (info.name, info.version, info.device) == ("dev", 1, 1)
    assert info.owner_uid == os.getuid()
    host = trainer.publish("", "dev")
    assert (host.version, host.device) == (2, -1)
    listed = flatshard.weights.list(address=gpu_daemon.address)
    assert [(v.version, v.device) for v in listed if v.name == "dev"] == [(1, 1), (2, -1)]
    with flatshard.weights.Reader(gpu_daemon.address, _simulated_gpus=True) as r:
        with r.open("dev", 1) as w:
            assert (w.version, w.device, w.info.device) == (1, 1, 1)
            assert torch.equal(w["fc1.weight"], torch.arange(15.0).view(5, 3))
            assert torch.equal(w["fc1.bias"], torch.full((5,), -3.0))
            assert torch.equal(w["fc2.weight"], torch.arange(10.0).view(2, 5))
            assert isinstance(w["fc1.bias"], flatshard.ReadOnlyTensor)
            with pytest.raises(flatshard.ReadOnlyViewError):
                w["fc1.bias"].add_(1.0)
            assert w.memoryviews()["fc1.bias"].tolist() == [-3.0] * 5
        with r.open("dev", 2) as w:  # the host version of the same name
            assert w.device == -1
            assert torch.equal(w["fc1.bias"], torch.full((5,), -3.0))


def test_bf16_cast_on_the_device_path(gpu_daemon, trainer):
    info = trainer.publish("", "cast", dtype="bfloat16", device=0)
    assert info.device == 0
    with flatshard.weights.Reader(gpu_daemon.address, _simulated_gpus=True) as r:
        with r.open("cast") as w:
            assert w.dtype_name("fc1.weight") == "bfloat16"
            assert torch.equal(w["fc1.weight"].float(), torch.arange(15.0).view(5, 3))


def test_a_reader_without_cuda_is_told_why(gpu_daemon, trainer):
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: it would try to open the simulated handle")
    trainer.publish("", "dev", device=1)
    # The plain reader's CUDA IPC opener cannot open device memory on this machine.
    with pytest.raises(flatshard.FlatshardError) as e:
        flatshard.weights.open("dev", address=gpu_daemon.address)
    assert 'weights "dev" version 1: it is in device memory of the daemon\'s GPU 1' in \
        e.value.message


def test_bad_devices_and_grants_are_named_and_publish_nothing(gpu_daemon, trainer):
    with pytest.raises(flatshard.FailedPreconditionError) as e:
        trainer.publish("", "bad", device=7)
    assert "does not use GPU 7 (its GPUs: 0, 1)" in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        trainer.publish("", "bad", device=0, reader_uids=[4242])
    assert "options.reader_uids must be empty" in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        trainer.publish("", "bad", device=0, reader_token="tok")
    assert "options.reader_token must be empty" in e.value.message
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(flatshard.InvalidArgumentError) as e:
            trainer.publish("", "bad", device=bad)
        assert "device must be a GPU ordinal" in e.value.message
    assert [v for v in flatshard.weights.list(address=gpu_daemon.address)
            if v.name == "bad"] == []
