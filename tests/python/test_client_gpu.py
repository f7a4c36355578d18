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


# ---- Ordering through interprocess events, both ways, with kernels that run late ----------------
# torch.cuda._sleep spins the GPU for a number of cycles: work queued behind it runs tens of
# milliseconds after the host returns. The daemon must order its reads after the trainer's
# stream (the `written` event each call sends), so no test below synchronizes before calling
# the daemon; were the ordering broken, the daemon would read the old values.
LATE_CYCLES = 200_000_000  # about 0.1 s on a 1.7-2 GHz GPU


def _gpu_client(d, stream):
    c = flatshard.Client(d.address, cuda_stream=stream.cuda_stream)
    c.join("gpu", 1, 0)
    reg = c.register("", mlp_manifest(), MLP_POLICY)
    return c, reg


def _full_values(c, stream):
    with c.summon("", writeback=False) as s:
        with torch.cuda.stream(stream):
            out = {fqn: t.clone() for fqn, t in s.params.items()}
    stream.synchronize()
    return {fqn: t.cpu() for fqn, t in out.items()}


def test_late_writes_to_views_reach_the_shards_at_end():
    with flatshard.testing.LocalDaemon(extra_args=("--gpus=0",)) as d:
        stream = torch.cuda.Stream(0)
        c, _ = _gpu_client(d, stream)
        s = c.summon("")
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LATE_CYCLES)
            for t in s.params.values():
                t.fill_(7.0)
        s.end()  # no synchronize: End carries the trainer's event
        for fqn, t in _full_values(c, stream).items():
            assert torch.equal(t, torch.full_like(t, 7.0)), fqn
        c.close()


def test_late_optimizer_step_on_shards_is_seen_by_commit_and_summon():
    with flatshard.testing.LocalDaemon(extra_args=("--gpus=0",)) as d:
        stream = torch.cuda.Stream(0)
        c, reg = _gpu_client(d, stream)
        views = c.shard_views("")
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LATE_CYCLES)
            for v in views:
                v.shard.add_(1.5)  # an "optimizer step" that lands late
        assert c.commit("") == reg.generation + 1
        for fqn, t in _full_values(c, stream).items():
            assert torch.equal(t, torch.full_like(t, 1.5)), fqn
        c.close()


def test_late_gradient_reaches_the_reduce_scatter():
    with flatshard.testing.LocalDaemon(extra_args=("--gpus=0",)) as d:
        stream = torch.cuda.Stream(0)
        c, reg = _gpu_client(d, stream)
        fc1 = unit_of(reg.plan, "fc1")
        grad = torch.zeros(fc1["numel"], device="cuda:0")
        stream.wait_stream(torch.cuda.current_stream(0))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LATE_CYCLES)
            grad.fill_(3.0)
        c.reduce_scatter_grads("", fc1["index"], grad, op="sum")
        v = {s.unit: s for s in c.shard_views("")}[fc1["index"]]
        with torch.cuda.stream(stream):
            got = v.grad[:fc1["numel"]].clone()
        stream.synchronize()
        assert torch.equal(got.cpu(), torch.full((fc1["numel"],), 3.0))
        c.close()


def test_torch_computes_on_device_views_in_place_of_parameters():
    # A trainer's forward pass on the daemon's memory: the views are plain CUDA tensors.
    with flatshard.testing.LocalDaemon(extra_args=("--gpus=0",)) as d:
        stream = torch.cuda.current_stream(0)
        c = flatshard.Client(d.address, cuda_stream=stream.cuda_stream)
        c.join("gpu", 1, 0)
        reg = c.register("", mlp_manifest(), MLP_POLICY, init="from_every_rank")
        gen = torch.Generator().manual_seed(0)
        ref = {}
        for fqn, t in reg.init_summon.params.items():
            ref[fqn] = torch.randn(t.shape, generator=gen)
            t.copy_(ref[fqn])
        reg.init_summon.end()
        x = torch.randn(4, 3, generator=gen)
        with c.summon("", writeback=False) as s:
            p = s.params
            y = torch.nn.functional.linear(x.cuda(), p["fc1.weight"], p["fc1.bias"]).cpu()
        want = torch.nn.functional.linear(x, ref["fc1.weight"], ref["fc1.bias"])
        assert torch.allclose(y, want, atol=1e-5)
        c.close()
