"""Device views on a real GPU (CTest labels `python;gpu`; skipped without a CUDA torch and a
visible GPU, i.e. always on the CPU-only CI machine, where test_client_device.py covers the
same paths against --simulate_gpus). A daemon with --gpus=0 keeps shards and unsharded
buffers in device memory; the client opens them through CUDA IPC; views come out as CUDA
tensors through DLPack."""

import pytest
import torch

import flatshard
import flatshard.testing
from conftest import MLP_POLICY, mlp_manifest, unit_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA build of torch and a visible GPU")


def test_cuda_views_round_trip():
    with flatshard.testing.LocalDaemon(extra_args=("--gpus=0",)) as d:
        stream = torch.cuda.current_stream(0)
        c = flatshard.Client(d.address, cuda_stream=stream.cuda_stream)
        c.join("gpu", 1, 0)
        reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_every_rank")
        for t in reg.init_summon.params.values():
            assert t.is_cuda and t.device.index == 0
            t.fill_(2.0)
        reg.init_summon.end()
        assert all(v.device == 0 and v.shard.is_cuda for v in reg.shards)
        with c.summon("") as s:
            w = s.params["fc1.weight"]
            assert w.is_cuda and w.shape == (5, 3) and torch.equal(w, torch.full_like(w, 2.0))
            w.mul_(3.0)
        with c.summon("", writeback=False) as s:
            assert isinstance(s.params["fc1.weight"], flatshard.ReadOnlyTensor)
            assert torch.equal(s.params["fc1.weight"].cpu(), torch.full((5, 3), 6.0))
        fc1 = unit_of(reg.plan, "fc1")
        c.reduce_scatter_grads("", fc1["index"], torch.ones(fc1["numel"], device="cuda:0"))
        v = {s.unit: s for s in c.shard_views("")}[fc1["index"]]
        torch.cuda.synchronize()
        assert v.grad.is_cuda and torch.equal(v.grad[:20].cpu(), torch.ones(20))
        opens = c.ipc_open_calls
        assert opens > 0
        for _ in range(3):
            with c.summon("", writeback=False):
                pass
        assert c.ipc_open_calls == opens
        c.close()
