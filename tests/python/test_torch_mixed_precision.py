"""FSDP's MixedPrecision through flatshard.torch: forward and backward run in param_dtype on
views the daemon cast and all-gathered in that dtype, gradients are reduce-scattered in
reduce_dtype, and the optimizer sees float32 shards and float32 gradients (equal, element for
element, to a reference computed here with the same casts: the daemon's float32 average of
two gradients is the same IEEE operation as torch's); keep_low_precision_grads, buffer_dtype,
cast_forward_inputs, units of _module_classes_to_ignore, full precision outside compute.
Ranks are threads, each with its own Client, on one flatshardd per test. The example GPT
trained with bf16 (test_gpt_*) runs as rank processes (examples/python/run_gpt.py).

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \\
    /usr/bin/python3 -m pytest -q tests/python/test_torch_mixed_precision.py
"""
import os
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import (FlatShardModule, MixedPrecision, ModuleWrapPolicy,
                             summon_full_params)
from conftest import run_group, run_ranks

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import run_gpt  # noqa: E402

WORLD = 2
_RNG = threading.Lock()


class Affine(nn.Module):
    """Element-wise only: torch 1.13 has no float16 matmul, relu or tanh on CPU."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.w + self.b


def model_for(dtype):
    with _RNG:  # ranks are threads: take turns with torch's global generator
        torch.manual_seed(0)
        if dtype == torch.float16:
            return nn.Sequential(Affine(37), Affine(37)), {Affine}
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5)), {nn.Linear}


def batch(dtype, rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 37 if dtype == torch.float16 else 8, generator=g)


def loss_of(out):
    return (out * out).sum() / out.numel()  # in the output's (low) dtype


def reference_grads(dtype, reduce_dtype):
    """Every rank's low-precision gradient on its batch, widened to float32 and averaged in
    reduce_dtype as the daemon does (float32 sum and divide, rounded once)."""
    grads = []
    for rank in range(WORLD):
        model, _ = model_for(dtype)
        model.to(dtype)
        loss_of(model(batch(dtype, rank).to(dtype))).backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    return {n: ((grads[0][n] + grads[1][n]) / 2).to(reduce_dtype).float() for n in grads[0]}


@pytest.mark.parametrize("dtype,reduce_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16), (torch.float16, torch.float32)],
    ids=["bf16", "bf16_reduce_bf16", "fp16", "fp16_reduce_fp32"])
def test_low_precision_compute_and_float32_gradients_equal_the_same_casts(daemon, dtype,
                                                                         reduce_dtype):
    def fn(rank, c):
        module, types = model_for(dtype)
        model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy(types),
                                mixed_precision=MixedPrecision(param_dtype=dtype,
                                                               reduce_dtype=reduce_dtype))
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float32: "float32"}
        for u in model.plan["units"]:
            assert u["dtype"] == "float32" and u["compute_dtype"] == name[dtype], u
            assert u.get("reduce_dtype", "float32") == name[reduce_dtype], u
        seen = []
        for m in module.modules():
            if isinstance(m, tuple(types)):
                m.register_forward_pre_hook(
                    lambda m, args: seen.append((next(iter(m._parameters.values())).dtype,
                                                 args[0].dtype)))
        out = model(batch(dtype, rank))  # float32 input: the root casts it (FSDP's root)
        assert out.dtype == dtype
        assert seen and all(p == dtype and x == dtype for p, x in seen), seen
        loss_of(out).backward()
        sharded = model.sharded_parameters()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in sharded)
        with summon_full_params(model, writeback=False, with_grads=True):
            got = {n: (p.detach().clone(), p.grad.clone()) for n, p in module.named_parameters()}
        return got

    got = run_group(daemon.address, WORLD, fn)
    want = reference_grads(dtype, reduce_dtype)
    init, _ = model_for(dtype)
    for rank in range(WORLD):
        for n, p in init.named_parameters():
            full, grad = got[rank][n]
            assert full.dtype == torch.float32 and torch.equal(full, p.detach()), n
            assert grad.dtype == torch.float32
            assert torch.equal(grad, want[n]), f"rank {rank} {n}: max |diff| " \
                f"{(grad - want[n]).abs().max()}"


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 5)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x) * self.scale))


def test_ignored_batchnorm_buffers_low_grads_and_full_precision_outside_compute(daemon):
    def fn(rank, c):
        with _RNG:
            torch.manual_seed(0)
            module = BNNet()
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            buffer_dtype=torch.bfloat16, keep_low_precision_grads=True,
                            cast_forward_inputs=True)
        model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                mixed_precision=mp)
        units = {u["module"]: u for u in model.plan["units"]}
        # The planner wraps the BatchNorm separately (_module_classes_to_ignore) and keeps
        # it in float32; the Linear units compute in bfloat16.
        assert "compute_dtype" not in units["bn"] and "reduce_dtype" not in units["bn"]
        assert units["fc1"]["compute_dtype"] == "bfloat16"
        assert any("mixed precision disabled" in w for w in model.plan["warnings"])
        # buffer_dtype: floating buffers are bfloat16, but not the BatchNorm's (its unit has
        # no mixed precision, as FSDP's for _module_classes_to_ignore).
        assert module.scale.dtype == torch.bfloat16
        assert module.bn.running_mean.dtype == torch.float32
        seen = {}
        for n in ("fc1", "bn", "fc2"):
            getattr(module, n).register_forward_pre_hook(
                lambda m, args, n=n: seen.setdefault(n, (m.weight.dtype, args[0].dtype)) and None)
        opt = torch.optim.SGD(model.sharded_parameters(), lr=0.1)
        out = model(torch.randn(6, 8))
        loss_of(out.float()).backward()
        # cast_forward_inputs: each unit casts its inputs to its own precision.
        assert seen == {"fc1": (torch.bfloat16, torch.bfloat16),
                        "bn": (torch.float32, torch.float32),
                        "fc2": (torch.bfloat16, torch.bfloat16)}, seen
        for u in model._units:
            g = u.flat_param.grad
            # keep_low_precision_grads: bfloat16 copies of the float32 gradient shards for
            # the mixed-precision units; the BatchNorm's stays float32.
            want = torch.float32 if u.path == "bn" else torch.bfloat16
            assert g.dtype == want, (u.path, g.dtype)
            assert torch.equal(g, u.grad_shard.to(want))
            assert u.grad_shard.dtype == torch.float32
        model.step(opt)
        # Full precision outside compute: summon_full_params and the state dict.
        with summon_full_params(model, writeback=False):
            assert module.fc1.weight.dtype == torch.float32
            assert module.scale.dtype == torch.float32
        sd = model.state_dict()
        assert all(v.dtype in (torch.float32, torch.int64) for v in sd.values()), \
            {k: v.dtype for k, v in sd.items()}
        assert sd["scale"].dtype == torch.float32
        assert module.scale.dtype == torch.bfloat16  # back after the summon
        model.load_state_dict(sd)
        assert module.scale.dtype == torch.bfloat16
        with torch.no_grad():
            return float(loss_of(model(torch.randn(6, 8)).float()))

    losses = run_group(daemon.address, WORLD, fn)
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())


STEPS = int(os.environ.get("FS_TORCH_STEPS", "8"))


@pytest.mark.parametrize("precision,ranks,daemons", [
    ("bf16", 2, 1), ("bf16-reduce", 2, 1), ("bf16", 4, 2)],
    ids=["bf16_2ranks", "bf16_reduce_bf16_2ranks", "bf16_2daemons_x_2ranks"])
def test_gpt_mixed_precision_stays_within_its_bound_of_the_same_casts(precision, ranks,
                                                                      daemons):
    """run_gpt.MIXED_PRECISION_NOTE says which bound and why. float16 cannot run the GPT on
    torch 1.13's CPU (no float16 addmm, layer_norm or softmax there): its daemon path is
    tested above and in module_mixed_precision_test."""
    res = run_gpt.run(ranks, daemons, steps=STEPS, batch=12, precision=precision)
    assert not res["problems"], "\n".join(res["problems"])
    print(f"{precision}, {ranks} ranks on {daemons} daemon(s), {STEPS} steps: max |loss diff| "
          f"{res['max_loss_diff']:.2e}, max |param diff| {res['max_param_diff']:.2e}, mean "
          f"{res['mean_param_diff']:.2e}")


@pytest.mark.parametrize("precision", ["bf16", "bf16-reduce"])
def test_gpt_mixed_precision_against_fsdp_on_gloo(precision, tmp_path):
    """torch 1.13's FSDP (FULL_SHARD, gloo, CPU) with the same MixedPrecision, Block units and
    AdamW, next to flatshard: what it took to run FSDP on CPU is torch_benchmark.py's
    (_cpu_cuda_shims: no-op CUDA streams, gloo stand-ins for _all_gather_base and
    _reduce_scatter_base; gloo has no bfloat16, so a bfloat16 all-gather moves the bits as
    float16 and a 16-bit reduction sums in float32 and rounds once, as flatshard's host
    kernels). The same casts, the same reductions (for 2 ranks FSDP's pre-divide by 2 is exact
    and a/2 + b/2 == (a + b)/2 in binary floating point), the same AdamW on float32 flat
    parameters: the losses and final parameters are expected equal."""
    sys.path.insert(0, str(SOURCE_DIR / "tests" / "bench" / "python"))
    import argparse
    import torch_benchmark
    args = argparse.Namespace(ranks=WORLD, steps=4, warmup=1, batch=12, n_layer=2, n_embd=64,
                              block_size=32, profile="", timeout=300)
    got = {m: torch_benchmark.run_mode(m, args, precision, out=str(tmp_path / f"{m}.pt"))
           for m in ("fsdp", "flatshard")}
    for m, r in got.items():
        assert "error" not in r, f"{m}: {r['error']}"
    assert got["flatshard"]["losses"] == got["fsdp"]["losses"], got
    fs, ref = torch.load(tmp_path / "flatshard.pt"), torch.load(tmp_path / "fsdp.pt")
    assert sorted(fs) == sorted(ref)
    worst = max((float((fs[k].double() - ref[k].double()).abs().max()), k) for k in ref
                if torch.is_floating_point(ref[k]))
    print(f"{precision}: flatshard vs FSDP (gloo), 4 steps: losses equal, max |param diff| "
          f"{worst[0]:.3g} ({worst[1]})")
    assert worst[0] == 0.0, worst


def test_simulated_gpu_ranks_cast_on_the_device_path():
    """`flatshardd --simulate_gpus`: shards in "device" memory, the casts before the
    all-gather and after the reduce-scatter through RankDevices' device path (host memory
    standing in). The gradients equal the same casts element for element, as on host ranks."""
    dtype, reduce_dtype = torch.bfloat16, torch.bfloat16
    with flatshard.testing.LocalDaemon(extra_args=("--simulate_gpus=2",)) as d:
        group = "mp-gpu-" + uuid.uuid4().hex[:6]

        def body(rank):
            c = flatshard.Client(d.address, call_timeout=60.0, _simulated_gpus=True)
            try:
                c.join(group, WORLD, rank)
                module, types = model_for(dtype)
                model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy(types),
                                        mixed_precision=MixedPrecision(
                                            param_dtype=dtype, reduce_dtype=reduce_dtype))
                assert all(sh.device >= 0 for sh in c.shard_views(""))
                out = model(batch(dtype, rank))
                assert out.dtype == dtype
                loss_of(out).backward()
                with summon_full_params(model, writeback=False, with_grads=True):
                    return {n: p.grad.clone() for n, p in module.named_parameters()}
            finally:
                c.close()

        got = run_ranks(WORLD, body)
    want = reference_grads(dtype, reduce_dtype)
    for rank in range(WORLD):
        for n, g in got[rank].items():
            assert g.dtype == torch.float32 and torch.equal(g, want[n]), (rank, n)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16],
                         ids=["reduce_fp32", "reduce_bf16"])
def test_no_sync_micro_batches_sum_in_float32_and_reduce_once(reduce_dtype):
    """no_sync() under MixedPrecision(bf16, reduce_dtype): each micro-batch's bfloat16
    gradient is summed locally in float32, the synced backward writes its own into the reduce
    buffer and adds that sum (rounded to reduce_dtype), and one reduce-scatter averages: the
    same operations in torch give the same float32 gradients element for element."""
    dtype = torch.bfloat16

    def micro(rank, k):
        g = torch.Generator().manual_seed(1000 * rank + k)
        return torch.randn(3, 8, generator=g)

    with flatshard.testing.LocalDaemon() as d:
        def fn(rank, c):
            module, types = model_for(dtype)
            model = FlatShardModule(module, c, auto_wrap_policy=ModuleWrapPolicy(types),
                                    mixed_precision=MixedPrecision(param_dtype=dtype,
                                                                   reduce_dtype=reduce_dtype))
            with model.no_sync():
                for k in range(2):
                    loss_of(model(micro(rank, k))).backward()
            loss_of(model(micro(rank, 2))).backward()
            with summon_full_params(model, writeback=False, with_grads=True):
                return {n: p.grad.clone() for n, p in module.named_parameters()}

        got = run_group(d.address, WORLD, fn)
    per_rank = []
    for rank in range(WORLD):
        grads = []
        for k in range(3):
            low, _ = model_for(dtype)
            low.to(dtype)
            loss_of(low(micro(rank, k).to(dtype))).backward()
            grads.append({n: p.grad.float() for n, p in low.named_parameters()})
        per_rank.append({n: (grads[2][n].to(reduce_dtype)
                             + (grads[0][n] + grads[1][n]).to(reduce_dtype)).float()
                         for n in grads[0]})
    for rank in range(WORLD):
        for n, g in got[rank].items():
            want = ((per_rank[0][n] + per_rank[1][n]) / 2).to(reduce_dtype).float()
            assert torch.equal(g, want), (rank, n, float((g - want).abs().max()))
