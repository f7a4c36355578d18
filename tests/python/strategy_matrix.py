"""The training matrix of issue 22 (tests/python/test_torch_strategy_matrix.py): a sharding strategy
x a precision x a recipe x a topology trains a small model through flatshard.torch, and a single
process trains the same model on the same global batches with the same casts and the same
recipe (the reference).

- Strategies: FSDP's five (STRATEGIES). FULL_SHARD is the default of FlatShardModule; the
  others go through ``FlatShardModule(..., sharding_strategy=NAME)`` (skipped, naming what is
  missing, where this build has no such argument or its daemon no runtime for it).
- Precisions (examples/python/gpt.py PRECISIONS, FSDP's MixedPrecision(param_dtype,
  reduce_dtype)): fp32 (none); bf16-reduce = bf16 params (reduce_dtype None takes param_dtype,
  as FSDP: bf16 reductions); bf16 = bf16 params + fp32 reduce; fp16 = fp16 params (and fp16
  reductions). torch 1.13 has no float16 addmm, layer_norm, softmax, relu or tanh on CPU, so
  fp16 trains `AffineTower` (element-wise units, as test_torch_mixed_precision.py) instead of
  the GPT; the other precisions train the example GPT (tiny: 2 blocks, n_embd 32).
- Recipes: clip (``clip_grad_norm_(CLIP_NORM)`` every step; the returned norms are checked
  too), no_sync (MICRO_BATCHES micro-batches per step, the first ones inside ``no_sync()``,
  each loss divided by MICRO_BATCHES), ckpt (activation checkpointing around every wrapped
  unit: torch.utils.checkpoint, non-reentrant for even units, re-entrant for odd ones, so both
  kinds recompute through a re-summon).
- Topologies (TOPOLOGIES): ranks x daemons; ranks are threads of this process, each with its
  own Client (ranks r*per..(r+1)*per-1 on daemon r), several daemons meeting through daemon 0's
  peer address as coordinator.

Bounds: fp32 equals the reference to float32 round-off through AdamW (run_gpt's tolerances);
a mixed precision stays within run_gpt.mixed_precision_bounds (MIXED_PRECISION_NOTE says why
a bound and which). Clip norms: the same relative bound as the losses.
"""
import contextlib
import inspect
import os
import sys
import threading
import types
import uuid
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, MixedPrecision, ModuleWrapPolicy

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import gpt  # noqa: E402
import run_gpt  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
PRECISIONS = ("fp32", "bf16-reduce", "bf16", "fp16")
PRECISION_NAMES = {"fp32": "fp32", "bf16-reduce": "bf16 params",
                   "bf16": "bf16 params + fp32 reduce", "fp16": "fp16 params"}
RECIPES = ("clip", "no_sync", "ckpt")
TOPOLOGIES = ((2, 1), (4, 1), (4, 2))  # (ranks, daemons)

GPT_CFG = dict(n_layer=2, n_embd=32, block_size=16, n_head=4)
BATCH = 16        # global: 4 micro-batches of 1 sample on each of 4 ranks
STEPS = 4
LR = 3e-3
CLIP_NORM = 0.25  # below the gradient norms here (tiny GPT ~0.35, fp16 tower ~0.6): it clips
MICRO_BATCHES = 4
_RNG = threading.Lock()  # ranks are threads: one at a time with torch's global generator


# ------------------------------------------------------------------------------ models
class Affine(nn.Module):
    """Element-wise only (torch 1.13 CPU runs float16 multiplies and adds, no matmul)."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(1.0 + 0.1 * torch.randn(n))
        self.b = nn.Parameter(0.1 * torch.randn(n))

    def forward(self, x):
        return x * self.w + self.b


class AffineTower(nn.Module):
    """fp16's model: three Affine units, a squared error against a fixed target."""
    WIDTH = 37

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Affine(self.WIDTH) for _ in range(3)])
        self.ckpt = False

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = _checkpointed(layer, x, i) if self.ckpt else layer(x)
        d = x - y.to(x.dtype)
        return (d * d).mean()


def _checkpointed(unit, x, i):
    # Re-entrant checkpointing needs an input that requires grad (the first unit's may not).
    reentrant = i % 2 == 1 and x.requires_grad
    return checkpoint(unit, x, use_reentrant=reentrant)


def _ckpt_logits(self, idx):
    """gpt.GPT.logits with every Block run under torch.utils.checkpoint."""
    t = idx.shape[1]
    pos = torch.arange(t, dtype=torch.long).unsqueeze(0)
    x = self.wte(idx) + self.wpe(pos)
    for i, block in enumerate(self.h):
        x = _checkpointed(block, x, i)
    return self.lm_head(self.ln_f(x))


def build(precision, recipe="", seed=0):
    """(model, wrap policy classes) for a precision; seeded, so equal on every call."""
    with _RNG:
        if precision == "fp16":
            torch.manual_seed(seed)
            model, units = AffineTower(), {Affine}
            model.ckpt = recipe == "ckpt"
        else:
            model, units = gpt.build_gpt(seed, **GPT_CFG), {gpt.Block}
            if recipe == "ckpt":
                model.logits = types.MethodType(_ckpt_logits, model)
    return model, units


def global_batch(precision, step):
    if precision == "fp16":
        g = torch.Generator().manual_seed(7000 + step)
        x = torch.randn(BATCH, AffineTower.WIDTH, generator=g)
        return x, 0.5 * x.flip(1) + 0.25
    cfg = gpt.GPTConfig(**GPT_CFG)
    return gpt.global_batch(step, BATCH, cfg)


def local_batch(precision, step, rank, world):
    x, y = global_batch(precision, step)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


# ------------------------------------------------------------------------------ flatshard
class Missing(Exception):
    """What this build lacks for a cell (the test skips, naming it)."""


def strategy_kwargs(strategy):
    """FlatShardModule's keyword for a strategy; Missing where this build has none."""
    params = inspect.signature(FlatShardModule.__init__).parameters
    if "sharding_strategy" not in params:
        if strategy == "FULL_SHARD":
            return {}  # the only strategy before the argument, and its default
        raise Missing(f"{strategy}: FlatShardModule has no sharding_strategy= argument in "
                      f"this build (issue 22, branch i22-python)")
    return {"sharding_strategy": strategy}


# Daemon answers that mean "this build has no runtime for the strategy" (not a wrong result).
_NOT_BUILT = ("needs an all-reduce", "does not serve", "unknown sharding_strategy",
              "unknown sharding strategy", "not supported", "unimplemented")


def _missing_runtime(strategy, e):
    text = str(e)
    if strategy != "FULL_SHARD" and any(s in text.lower() for s in _NOT_BUILT):
        return Missing(f"{strategy}: the daemon has no runtime for it in this build (issue 22, "
                       f"branch i22-daemon): {text[:200]}")
    return None


def _mixed_precision(precision):
    mp = gpt.PRECISIONS[precision]
    return None if mp is None else MixedPrecision(param_dtype=mp[0], reduce_dtype=mp[1])


def train_rank(client, cell, rank, world):
    """One rank's run: {losses, norms, final (rank 0: the full state dict), units}."""
    strategy, precision, recipe = cell
    model, units = build(precision, recipe)
    fs = FlatShardModule(model, client, auto_wrap_policy=ModuleWrapPolicy(units),
                         mixed_precision=_mixed_precision(precision),
                         **strategy_kwargs(strategy))
    opt = gpt.make_optimizer(fs.sharded_parameters(), LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = local_batch(precision, step, rank, world)
        opt.zero_grad(set_to_none=True)
        if recipe == "no_sync":
            loss = 0.0
            xs, ys = x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)
            for k in range(MICRO_BATCHES):
                last = k == MICRO_BATCHES - 1
                with contextlib.nullcontext() if last else fs.no_sync():
                    part = fs(xs[k], ys[k]) / MICRO_BATCHES
                    part.backward()
                loss += float(part)
        else:
            out = fs(x, y)
            out.backward()
            loss = float(out)
        if recipe == "clip":
            norms.append(float(fs.clip_grad_norm_(CLIP_NORM)))
        fs.step(opt)
        losses.append(loss)
    sd = fs.full_state_dict(rank0_only=True)  # collective
    return {"losses": losses, "norms": norms, "final": sd if rank == 0 else None,
            "shard_world_size": fs.plan.get("shard_world_size"), "generation": fs.generation}


def run_cell(cell, ranks, daemons, timeout=240.0):
    """Trains one cell with `ranks` thread ranks on `daemons` LocalDaemons. Returns
    {losses (mean over ranks per step), norms (rank 0's; every rank's must agree), final}.
    Raises Missing where the build lacks the strategy."""
    from conftest import run_ranks
    strategy = cell[0]
    strategy_kwargs(strategy)  # Missing before any daemon starts
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        ds = [stack.enter_context(flatshard.testing.LocalDaemon(peer=daemons > 1,
                                                                node_name=f"node{i}"))
              for i in range(daemons)]
        coordinator = ds[0].peer_address if daemons > 1 else ""
        group = "mx-" + uuid.uuid4().hex[:8]
        per = ranks // daemons
        # Nobody leaves before rank 0 has its full state dict: a rank0_only summon lets the
        # others return first, and a leave then fails rank 0's next unit ("rank 2's session
        # left the group", seen once in 20 cells).
        done = threading.Barrier(ranks)

        def body(rank):
            c = flatshard.Client(ds[rank // per].address, call_timeout=60.0, join_timeout=60.0)
            try:
                c.join(group, ranks, rank, "", coordinator)
                try:
                    out = train_rank(c, cell, rank, ranks)
                except BaseException:
                    done.abort()  # the others stop waiting for this rank
                    raise
                done.wait(timeout)
                c.leave()
                return out
            finally:
                c.close()

        try:
            got = run_ranks(ranks, body, timeout=timeout)
        except (flatshard.FlatshardError, RuntimeError) as e:
            missing = _missing_runtime(strategy, e)
            if missing:
                raise missing from e
            raise
    check_sharding(strategy, ranks, daemons, got[0]["shard_world_size"])
    losses = [sum(g["losses"][s] for g in got) / ranks for s in range(STEPS)]
    for r, g in enumerate(got):
        if g["norms"] != got[0]["norms"]:
            raise AssertionError(f"rank {r}'s clip norms {g['norms']} != rank 0's "
                                 f"{got[0]['norms']}: every rank must return the same norm")
        if g["generation"] != STEPS:
            raise AssertionError(f"rank {r} ended at generation {g['generation']}, want {STEPS}")
    return {"losses": losses, "norms": got[0]["norms"], "final": got[0]["final"]}


def check_sharding(strategy, ranks, daemons, shard_world_size):
    """The plan shards a unit over the ranks the strategy says: all (FULL_SHARD,
    SHARD_GRAD_OP), one (NO_SHARD), a daemon's (HYBRID_*: one daemon = one node)."""
    want = {"NO_SHARD": 1, "HYBRID_SHARD": ranks // daemons,
            "_HYBRID_SHARD_ZERO2": ranks // daemons}.get(strategy, ranks)
    if shard_world_size == want:
        return
    if strategy.startswith(("HYBRID", "_HYBRID")) and shard_world_size == ranks:
        raise Missing(f"{strategy}: the plan shards over all {ranks} ranks, not a daemon's "
                      f"{want}: this build does not plan ranks per node from the group's "
                      f"daemons (issue 22, branch i22-daemon)")
    raise AssertionError(f"{strategy}, {ranks} ranks on {daemons} daemon(s): the plan shards "
                         f"over {shard_world_size} ranks, want {want}")


# ------------------------------------------------------------------------------ reference
def reference(precision, recipe):
    """One process, the global batches, the same casts (float32 master weights and AdamW;
    forward/backward on a param_dtype copy, gradients rounded to reduce_dtype then widened),
    clip_grad_norm_ on the float32 gradients for "clip". no_sync and ckpt do not change the
    mathematics: one backward over the global batch, no checkpointing."""
    model, _ = build(precision)
    opt = gpt.make_optimizer(model.parameters(), LR)
    mp = gpt.PRECISIONS[precision]
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(precision, step)
        opt.zero_grad(set_to_none=True)
        if mp is None:
            loss = model(x, y)
            loss.backward()
        else:
            low, _ = build(precision)
            low.load_state_dict(model.state_dict())
            low.to(mp[0])
            if x.is_floating_point():  # FSDP's root casts floating inputs to param_dtype
                x, y = x.to(mp[0]), y.to(mp[0])
            loss = low(x, y)
            loss.backward()
            for p, q in zip(model.parameters(), low.parameters()):
                p.grad = q.grad.to(mp[1]).to(torch.float32)
        if recipe == "clip":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)))
        opt.step()
        losses.append(float(loss))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def bounds(precision):
    """run_gpt.compare's keyword bounds for a precision (fp32: its defaults)."""
    if precision == "fp32":
        return {}
    return run_gpt.mixed_precision_bounds(STEPS, LR)


def check(cell, got):
    """The problems of a run against its reference (empty: within the bounds), and a line
    of figures."""
    _, precision, recipe = cell
    ref_losses, ref_norms, ref_sd = reference(precision, recipe)
    b = bounds(precision)
    ml, mp, mean, problems = run_gpt.compare(got["losses"], got["final"], ref_losses, ref_sd,
                                             **b)
    rtol = b.get("loss_rtol", run_gpt.LOSS_RTOL)
    atol = b.get("loss_atol", run_gpt.LOSS_ATOL)
    if recipe == "clip":
        if len(got["norms"]) != len(ref_norms):
            problems.append(f"{len(got['norms'])} clip norms, reference has {len(ref_norms)}")
        for s, (a, w) in enumerate(zip(got["norms"], ref_norms)):
            if abs(a - w) > atol + rtol * abs(w):
                problems.append(f"step {s}: clip_grad_norm_ returned {a!r}, reference {w!r}")
                break
        if not any(w > CLIP_NORM for w in ref_norms):
            problems.append(f"the reference never clipped (norms {ref_norms}): the recipe "
                            f"tests nothing; lower CLIP_NORM")
    line = (f"loss max |diff| {ml:.2e}, param max |diff| {mp:.2e}, mean {mean:.2e}"
            + (f", clip norms {['%.4g' % n for n in got['norms']]}" if recipe == "clip" else ""))
    return problems, line
