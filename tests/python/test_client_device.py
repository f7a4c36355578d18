"""Device views against `flatshardd --simulate_gpus` (GPU code paths over host shared memory).

What this checks: the daemon hands out device memory; the Python client opens it through
the (simulated) CUDA IPC opener once per slab, views carry the GPU ordinal, DLPack capsules
describe CUDA memory on that ordinal with the right dtype and shape, and the same bytes read
and written as tensors round-trip through summon/writeback/reduce-scatter. The simulated
client (Client(..., _simulated_gpus=True)) presents the device memory as CPU tensors, since
its "device pointers" are host pointers. What stays unverified without a GPU: torch consuming
a real CUDA capsule (torch.utils.dlpack.from_dlpack on kDLCUDA memory from CUDA IPC) and the
stream ordering (cuda_stream) seen from torch.
"""

import pytest
import torch

import flatshard
from flatshard import _C
from conftest import MLP_POLICY, mlp_manifest, run_ranks, unit_of


@pytest.fixture
def gpu_daemon():
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=2",)) as d:
        yield d


def test_device_views_two_ranks(gpu_daemon, group):
    world = 2

    def rank_fn(rank):
        c = flatshard.Client(gpu_daemon.address, call_timeout=30, join_timeout=30,
                             _simulated_gpus=True)
        c.join(group, world, rank)
        reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_rank0")
        assert [v.device for v in reg.shards] == [rank % 2] * len(reg.shards)
        if rank == 0:
            for fqn, t in reg.init_summon.params.items():
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
        reg.init_summon.end()
        fc1 = unit_of(reg.plan, "fc1")
        with c.summon("") as s:
            w = s.params["fc1.weight"]
            assert torch.equal(w, torch.arange(15.0).view(5, 3))
            desc = s._s.describe(False)
            assert all(d[4] == rank % 2 for d in desc)  # device ordinal of every view
            caps = s._s.dlpack(False, True)  # what a real GPU client hands torch
            info = _C.describe_dlpack(caps[0])
            assert info["device_type"] == "cuda" and info["device_id"] == rank % 2
            assert info["code"] == 2 and info["bits"] == 32 and info["lanes"] == 1
            assert info["shape"] == list(desc[0][3])
            assert info["data"] == s.params[desc[0][0]].data_ptr()
            s.params["fc1.bias"].fill_(-3.0)  # every rank: each keeps its own range
        opens = c.ipc_open_calls
        assert opens > 0
        with c.summon("", writeback=False) as s:
            assert torch.equal(s.params["fc1.bias"], torch.full((5,), -3.0))
            assert isinstance(s.params["fc1.bias"], flatshard.ReadOnlyTensor)
            a = s.numpy_params["fc1.bias"]  # simulated device memory is host memory
            assert not a.flags.writeable and list(a) == [-3.0] * 5
        c.reduce_scatter_grads("", fc1["index"], torch.full((fc1["numel"],), float(rank)),
                               op="sum")
        sh = {v.unit: v for v in c.shard_views("")}[fc1["index"]]
        assert sh.device == rank % 2
        valid = max(0, min(sh.shard_numel, fc1["numel"] - sh.shard_offset))
        assert torch.equal(sh.grad[:valid], torch.ones(valid))
        with c.summon("", with_grads=True, writeback=False) as s:
            assert torch.equal(s.grads["fc1.weight"], torch.ones(5, 3))
        with c.summon("", offload_to_cpu=True, writeback=False) as s:
            assert all(d[4] == -1 for d in s._s.describe(False))  # pinned host memory
            assert torch.equal(s.params["fc1.bias"], torch.full((5,), -3.0))
        steady = c.ipc_open_calls
        for _ in range(3):
            with c.summon("", writeback=False):
                pass
        assert c.ipc_open_calls == steady
        c.close()

    run_ranks(world, rank_fn)


def test_device_memory_without_a_gpu_fails_cleanly(gpu_daemon, group):
    """A client without the simulated opener gets device memory it cannot open: an error
    naming the GPU (this machine has no usable CUDA device), not a crash."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU would try to open the simulated handle")
    c = flatshard.Client(gpu_daemon.address)
    c.join(group, 1, 0)
    with pytest.raises((flatshard.FailedPreconditionError, flatshard.NotFoundError)) as e:
        c.register("", mlp_manifest(), MLP_POLICY)
    assert "GPU" in e.value.message or "SIM-GPU" in e.value.message
    c.close()


def test_cuda_capsule_without_cuda_is_refused_not_crashed():
    """torch without CUDA refuses a CUDA capsule with an exception; the capsule frees its
    share of the mapping when dropped (host memory stands in for the device bytes)."""
    if torch.cuda.is_available():
        pytest.skip("needs a torch without CUDA")
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=1",)) as d:
        c = flatshard.Client(d.address, _simulated_gpus=True)
        c.join("cap", 1, 0)
        c.register("", mlp_manifest(), MLP_POLICY)
        with c.summon("", writeback=False) as s:
            cap = s._s.dlpack(False, True)[0]
            with pytest.raises(Exception):
                torch.utils.dlpack.from_dlpack(cap)
        del cap
        c.close()
