#!/usr/bin/python3
"""One rank of a flatshard training job: the example GPT (or torchvision's resnet18) wrapped in
``flatshard.torch.FlatShardModule`` and trained with a torch optimizer over the daemon's shards.

Prints one JSON object per line on stdout:
  {"event": "attached", "rank": r, "reattached": bool, "generation": g}
  {"event": "step", "step": i, "rank": r, "loss": <this rank's loss>, "generation": g}
  {"event": "step_failed", ...}, {"event": "left", ...} (--survive: before joining again),
  {"event": "reattached", "step": i, "generation": g}
  {"event": "summon", ...}   (--demo: what summon_full_params read and edited)
  {"event": "published", "version": v, "generation": g, ...}  (--publish-every)
  {"event": "done", "rank": r, "reattached": bool, "seconds": s, "peak_rss_kib": k}
With --out, rank 0 saves the final full state dict (torch.save) there.
Every step ends with ``fs.step(opt)``: the optimizer step, then a collective commit, so the
committed generation equals the number of finished steps and a re-attaching trainer resumes
at step ``fs.generation``.
Run by examples/python/run_gpt.py, the tests and the benchmark; not meant to be run by hand.
"""
import argparse
import json
import os
import resource
import signal
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import flatshard  # noqa: E402
from flatshard.torch import (FlatShardModule, MixedPrecision, ModuleWrapPolicy,  # noqa: E402
                             size_based_auto_wrap_policy, summon_full_params)

import gpt  # noqa: E402


def emit(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def build(args):
    if args.model == "gpt":
        model = gpt.build_gpt(args.seed)
        policies = {"block": ModuleWrapPolicy({gpt.Block}), "none": None,
                    "size": size_based_auto_wrap_policy(min_num_params=20000)}
        return model, policies[args.policy]
    import torchvision
    from torchvision.models.resnet import BasicBlock
    torch.manual_seed(args.seed)
    model = torchvision.models.resnet18(num_classes=10)
    return model, ModuleWrapPolicy({BasicBlock})


def resnet_batch(step, batch, rank, world_size):
    """Generated images whose class is readable from them: class c brightens channel c % 3
    in the c-th horizontal band. Rank r takes its equal slice of the global batch."""
    g = torch.Generator().manual_seed(4321 * 1000 + step)
    y = torch.randint(0, 10, (batch,), generator=g)
    x = torch.randn(batch, 3, 32, 32, generator=g) * 0.5
    for i in range(batch):
        c = int(y[i])
        x[i, c % 3, 3 * c:3 * c + 3, :] += 2.0
    n = batch // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--token", default="")
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--model", choices=["gpt", "resnet18"], default="gpt")
    ap.add_argument("--policy", choices=["block", "size", "none"], default="block")
    ap.add_argument("--use-orig-params", action="store_true")
    ap.add_argument("--sync-module-states", action="store_true")
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--start-step", type=int, default=-1,
                    help="first step; default: the committed generation (0 on a fresh "
                         "module, the last committed step on re-attach)")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=sorted(gpt.PRECISIONS), default="fp32",
                    help="FSDP MixedPrecision (param_dtype, reduce_dtype): bf16 = (bfloat16, "
                         "float32), bf16-reduce = (bfloat16, bfloat16), fp16 = (float16, "
                         "float16); fp32: none")
    ap.add_argument("--strategy", default="FULL_SHARD",
                    choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                             "_HYBRID_SHARD_ZERO2"],
                    help="FSDP's sharding strategy (HYBRID_*: shard within a daemon's ranks, "
                         "replicate across daemons)")
    ap.add_argument("--out", default="")
    ap.add_argument("--demo", action="store_true", help="read and edit weights with "
                    "summon_full_params after training (rank 0 prints)")
    ap.add_argument("--die-at-step", type=int, default=-1,
                    help="testing: SIGKILL this process in that step (see --die-in)")
    ap.add_argument("--die-in", choices=["backward", "commit"], default="backward",
                    help="testing: where --die-at-step kills: inside the backward, or after "
                         "the optimizer updated this rank's shards and before the commit")
    ap.add_argument("--stall-at-step", type=int, default=-1,
                    help="testing: in that step's backward, print a stalled event and sleep "
                         "--stall-s (a window in which a test kills a daemon mid-step)")
    ap.add_argument("--stall-s", type=float, default=5.0)
    ap.add_argument("--survive", action="store_true",
                    help="when a step fails (another rank died), join again, re-attach and "
                         "redo the step instead of exiting")
    ap.add_argument("--dump-shards", default="",
                    help="testing: a folder; this rank saves copies of its parameter shards "
                         "(sharded_state_dict) as <tag>.rank<r>.pt: tag attached (at start), "
                         "gen<g> (after each commit), failed (when a step failed), "
                         "reattached<g> (after reattach)")
    ap.add_argument("--call-timeout", type=float, default=30.0)
    ap.add_argument("--daemon-optimizer-state", action="store_true",
                    help="keep the optimizer's state in the daemon "
                         "(flatshard.torch.keep_optimizer_state): a restarted rank resumes "
                         "with the committed step's optimizer state")
    ap.add_argument("--publish-every", type=int, default=0,
                    help="publish the committed step every N steps (FlatShardModule.publish) "
                         "as the next version of --publish-name")
    ap.add_argument("--publish-name", default="gpt")
    ap.add_argument("--reader-uid", type=int, action="append", default=[],
                    help="a uid granted to read the published versions (repeatable)")
    ap.add_argument("--reader-token", default="", help="a token granted to read them")
    ap.add_argument("--publish-dump", default="",
                    help="testing: a folder; after each publish rank 0 saves the committed "
                         "full state dict there as gen<g>.pt (a collective summon)")
    args = ap.parse_args()

    t0 = time.monotonic()
    client = flatshard.Client(args.address, call_timeout=args.call_timeout, join_timeout=60.0)
    client.join(args.group, args.world_size, args.rank, args.token, args.coordinator)
    model, policy = build(args)
    mp = gpt.PRECISIONS[args.precision]
    # FULL_SHARD is the default (and the only strategy of builds without the argument).
    strategy = {} if args.strategy == "FULL_SHARD" else {"sharding_strategy": args.strategy}
    # A restarted rank of a multi-daemon group may register while the re-formed group is
    # still rolling back: FlatShardModule registers again by itself (register_timeout).
    fs = FlatShardModule(model, client, auto_wrap_policy=policy, **strategy,
                         sync_module_states=args.sync_module_states,
                         use_orig_params=args.use_orig_params,
                         mixed_precision=None if mp is None else MixedPrecision(
                             param_dtype=mp[0], reduce_dtype=mp[1]))
    emit(event="attached", rank=args.rank, reattached=fs.reattached, generation=fs.generation)
    dump(args, fs, "attached")
    if args.rank == 0:
        emit(event="plan", units=[(u["index"], u["module"], u["numel"], u["shard_numel"])
                                  for u in fs.plan["units"]],
             shard_world_size=fs.plan.get("shard_world_size"))
    params = fs.sharded_parameters()
    if args.optimizer == "adamw":
        opt = gpt.make_optimizer(params, args.lr)
    else:
        opt = torch.optim.SGD(params, lr=args.lr)
    if args.daemon_optimizer_state:
        from flatshard.torch import keep_optimizer_state
        kept = keep_optimizer_state(opt, fs)
        emit(event="optimizer_state", rank=args.rank, specs=kept.specs)

    step = fs.generation if args.start_step < 0 else args.start_step
    failures = 0
    while step < args.steps:
        try:
            loss = train_step(args, fs, model, opt, step)
        except (flatshard.FlatshardError, RuntimeError) as e:
            # Errors inside backward reach us as torch's RuntimeError; the flatshard error
            # behind it is fs.backward_error.
            cause = fs.backward_error or e
            emit(event="step_failed", step=step, rank=args.rank, error=type(cause).__name__,
                 message=str(cause)[:300])
            dump(args, fs, "failed")
            failures += 1
            if not args.survive or failures > 3:
                raise
            # Another rank died: join again (waits for its replacement), re-attach, redo it.
            try:
                client.leave()
            except flatshard.FlatshardError:
                pass
            emit(event="left", step=step, rank=args.rank)
            client.join(args.group, args.world_size, args.rank, args.token, args.coordinator)
            # The shards were rolled back to the last committed step: redo from there.
            step = fs.reattach()
            emit(event="reattached", step=step, rank=args.rank, generation=fs.generation)
            dump(args, fs, f"reattached{fs.generation}")
            continue
        emit(event="step", step=step, rank=args.rank, loss=float(loss), generation=fs.generation)
        dump(args, fs, f"gen{fs.generation}")
        if args.publish_every and (step + 1) % args.publish_every == 0:
            publish(args, fs, step)
        step += 1

    sd = fs.full_state_dict(rank0_only=True)  # collective: every rank takes part
    if args.out and args.rank == 0:
        torch.save(sd, args.out)
    if args.demo:
        demo_summon(fs, args.rank)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    emit(event="done", rank=args.rank, reattached=fs.reattached,
         seconds=time.monotonic() - t0, peak_rss_kib=peak)
    client.leave()
    client.close()


def publish(args, fs, step):
    """--publish-every: the committed step becomes the next version of --publish-name (every
    rank calls it: collective); the daemon builds it, this process goes on training."""
    t0 = time.perf_counter()
    info = fs.publish(args.publish_name, reader_uids=args.reader_uid,
                      reader_token=args.reader_token or None)
    emit(event="published", rank=args.rank, step=step, version=info.version,
         generation=info.generation, bytes=info.bytes, tensors=info.tensors,
         ms=(time.perf_counter() - t0) * 1e3)
    if args.publish_dump:
        sd = fs.full_state_dict(rank0_only=True)  # collective: every rank takes part
        if args.rank == 0:
            torch.save(sd, os.path.join(args.publish_dump, f"gen{info.generation}.pt"))


def dump(args, fs, tag):
    """--dump-shards: a copy of this rank's parameter shards (flat, padded) by unit."""
    if args.dump_shards:
        sd = {k: v for k, v in fs.sharded_state_dict().items() if k.endswith("flat_param")}
        torch.save(sd, os.path.join(args.dump_shards, f"{tag}.rank{args.rank}.pt"))


def train_step(args, fs, model, opt, step):
    if args.model == "gpt":
        x, y = gpt.local_batch(step, args.batch, model.cfg, args.rank, args.world_size)
        loss = fs(x, y)
    else:
        x, y = resnet_batch(step, args.batch, args.rank, args.world_size)
        loss = torch.nn.functional.cross_entropy(fs(x), y)
    die = step == args.die_at_step
    if die and args.die_in == "backward":
        loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    if step == args.stall_at_step:
        def stall(g):
            emit(event="stalled", step=step, rank=args.rank)
            time.sleep(args.stall_s)
        loss.register_hook(stall)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if die and args.die_in == "commit":
        opt.step()  # this rank's shards are updated in place, the step is not committed
        os.kill(os.getpid(), signal.SIGKILL)
    fs.step(opt)  # opt.step(), then the collective commit of the step
    return loss


def demo_summon(fs, rank):
    """summon_full_params: read a full weight, then halve ln_f.weight on rank 0 only and write
    it back to every rank's shard (rank0_only + writeback: beyond FSDP)."""
    with summon_full_params(fs, writeback=False):
        w = fs.module.ln_f.weight
        emit(event="summon", rank=rank, what="read", fqn="ln_f.weight", shape=list(w.shape),
             head=[round(float(v), 5) for v in w[:4]])
    with summon_full_params(fs, rank0_only=True, writeback=True):
        if rank == 0:
            with torch.no_grad():
                fs.module.ln_f.weight.mul_(0.5)
    with summon_full_params(fs, writeback=False):
        w = fs.module.ln_f.weight
        emit(event="summon", rank=rank, what="after rank-0 edit", fqn="ln_f.weight",
             head=[round(float(v), 5) for v in w[:4]])


if __name__ == "__main__":
    main()
