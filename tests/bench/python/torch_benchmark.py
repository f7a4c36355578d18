#!/usr/bin/python3
"""Training step time and peak memory per node: flatshard (FlatShardModule, FULL_SHARD) against
torch DistributedDataParallel (gloo, CPU), torch FullyShardedDataParallel (FULL_SHARD, gloo) and
one process, in the same run, on the same model (the example GPT, examples/python/gpt.py, at
the size given) with the same global batches and rank count.

    PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \\
        /usr/bin/python3 tests/bench/python/torch_benchmark.py --ranks 2 --steps 20

Step time: per rank, the median of the steps after --warmup; the slowest rank counts.
"CPU ms/step": the CPU time the whole job spent per step: every rank's process (all its
threads, median over the steps after --warmup), summed over the ranks, plus for flatshard the
daemon's (its mean over those steps). On a machine with other tenants, wall-clock step times
move with their load; CPU time much less, so "(CPU)", flatshard's over the row's, shows what
each mode costs when the cores are not the ranks' alone.
Peak memory per node: the peak over the run of the summed PSS (proportional set size, from
/proc/PID/smaps_rollup, sampled every 20 ms) of every process of the job on this host: the
ranks and, for flatshard, the daemon. PSS splits shared pages between the processes mapping
them, so the daemon's shared-memory segments are counted once.
Modes: single, ddp, fsdp, flatshard (backward prefetch BACKWARD_PRE and forward prefetch),
flatshard-noprefetch (neither). "summon wait ms/step": the time a rank's wrapper waited for
its units' all-gathers per step (prefetch_stats): the communication prefetch did not hide.

--precisions fp32,bf16,...: every mode once per precision (examples/python/gpt.py PRECISIONS:
FSDP's MixedPrecision(param_dtype, reduce_dtype); fsdp runs torch's own MixedPrecision, single
the same casts by hand). "MiB moved/step" (flatshard): the daemon's
flatshard_collective_bytes_total (every local rank's all-gathers and reduce-scatters, each
counted at its full unit size) over the steps after --warmup, per step, read from its
Prometheus endpoint by rank 0 after its step's optimizer update (its reduce-scatters, which
complete together with every rank's, are done by then).

--commits never,every (flatshard modes): once without commits and once with
``model.commit()`` after every optimizer step (inside the timed step); "commit ms/step": the
median time of that call. When any row commits, every flatshard row's daemon keeps records in a
fresh --state_dir (a commit then pays its intent's fsync, as in production), so both rows run
alike. --optimizer-state daemon: ``keep_optimizer_state`` keeps AdamW's state in the daemon, so
a commit copies it into the committed copy too. "commit cost": the commit row's step time less
the no-commit row's, over the no-commit row's step (same run).
"""
import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))


def pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakSampler:
    """Samples the summed PSS of a set of pids until stopped; keeps the peak."""

    def __init__(self, pids):
        self.pids = list(pids)
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(pss_kib(p) for p in self.pids))
            self._stop.wait(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


# ----------------------------------------------------------------------------- worker
def worker(args):
    import torch
    import gpt
    torch.set_num_threads(1)
    cfg = dict(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    rank, world = args.rank, args.world_size
    model = gpt.build_gpt(0, **cfg)
    client = None
    if args.mode == "single":
        fwd, params = model, model.parameters()
    elif args.mode in ("ddp", "fsdp"):
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=rank, world_size=world)
        if args.mode == "ddp":
            # The attention masks are constant bool buffers, which gloo cannot broadcast.
            DDP = torch.nn.parallel.DistributedDataParallel
            DDP._set_params_and_buffers_to_ignore_for_model(
                model, [n for n, b in model.named_buffers() if b.dtype == torch.bool])
            fwd = DDP(model, broadcast_buffers=False)
        else:
            fwd = make_fsdp(model, args.precision, args.strategy)
        params = fwd.parameters()
    else:
        import flatshard
        from flatshard.torch import FlatShardModule, ModuleWrapPolicy
        client = flatshard.Client(args.address, call_timeout=60.0, join_timeout=120.0)
        client.join(args.group, world, rank)
        from flatshard.torch import BackwardPrefetch
        prefetch = dict(backward_prefetch=None) if args.mode == "flatshard-noprefetch" else dict(
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)
        if args.strategy != "FULL_SHARD":  # FULL_SHARD: the default, in every build
            prefetch["sharding_strategy"] = args.strategy
        fwd = FlatShardModule(model, client, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
                              mixed_precision=mixed_precision(args.precision), **prefetch)
        params = fwd.sharded_parameters()
    if args.mode == "single" and gpt.PRECISIONS[args.precision] is not None:
        fwd = _SameCasts(model, gpt.PRECISIONS[args.precision])
    opt = gpt.make_optimizer(params)
    if args.optimizer_state == "daemon" and client is not None:
        from flatshard.torch import keep_optimizer_state
        keep_optimizer_state(opt, fwd)
    times, cpu, losses, commits = [], [], [], []
    daemon_cpu = None
    profiler = None
    waited = 0.0
    moved = None
    for step in range(args.steps):
        if step == args.warmup and rank == 0 and args.metrics:
            moved = -collective_bytes(args.metrics)
        if step == args.warmup and rank == 0 and args.daemon_pid:
            daemon_cpu = -proc_cpu_s(args.daemon_pid)
        if step == args.warmup and hasattr(fwd, "prefetch_stats"):
            waited = -fwd.prefetch_stats["waited_s"]
        if args.profile and step == args.warmup:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        x, y = gpt.local_batch(step, args.batch, model.cfg, rank, world)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if isinstance(fwd, _SameCasts):
            fwd.grads_to(model)
        opt.step()
        if args.commit == "every" and client is not None:
            t1 = time.perf_counter()
            fwd.commit()
            commits.append(time.perf_counter() - t1)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss))
    if daemon_cpu is not None:
        daemon_cpu = (daemon_cpu + proc_cpu_s(args.daemon_pid)) / max(args.steps - args.warmup, 1)
    if moved is not None:
        moved = (moved + collective_bytes(args.metrics)) / max(args.steps - args.warmup, 1)
    if profiler is not None:
        profiler.disable()
        os.makedirs(args.profile, exist_ok=True)
        profiler.dump_stats(os.path.join(args.profile, f"{args.mode}-rank{rank}.prof"))
    if hasattr(fwd, "prefetch_stats"):
        waited += fwd.prefetch_stats["waited_s"]
    if args.out:  # the final full state dict (collective for fsdp and flatshard), rank 0's
        import torch
        sd = (fwd.full_state_dict() if hasattr(fwd, "full_state_dict")
              else fwd.state_dict() if args.mode == "fsdp" else model.state_dict())
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in sd.items()}, args.out)
    print(json.dumps({"rank": rank, "times": times, "cpu": cpu, "losses": losses,
                      "commits": commits, "daemon_cpu_s": daemon_cpu,
                      "summon_wait_s": waited / max(args.steps - args.warmup, 1),
                      "moved_bytes": moved,
                      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}),
          flush=True)
    if client is not None:
        client.leave()
        client.close()


def proc_cpu_s(pid):
    """CPU seconds (user + system, every thread) process `pid` used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mixed_precision(precision, fsdp=False):
    """FSDP's MixedPrecision for `precision` (gpt.PRECISIONS): flatshard's, or torch's."""
    import gpt
    mp = gpt.PRECISIONS[precision]
    if mp is None:
        return None
    if fsdp:
        from torch.distributed.fsdp import MixedPrecision
    else:
        from flatshard.torch import MixedPrecision
    return MixedPrecision(param_dtype=mp[0], reduce_dtype=mp[1])


class _SameCasts:
    """One process with MixedPrecision's casts: forward/backward on a param_dtype copy,
    gradients rounded to reduce_dtype, float32 parameters and optimizer."""

    def __init__(self, model, mp):
        import copy
        self.model, self.mp, self.low = model, mp, copy.deepcopy(model).to(mp[0])

    def __call__(self, x, y):
        import torch
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.low.parameters()):
                q.copy_(p)
        for q in self.low.parameters():
            q.grad = None
        return self.low(x, y)

    def grads_to(self, model):
        import torch
        for p, q in zip(model.parameters(), self.low.parameters()):
            p.grad = q.grad.to(self.mp[1]).to(torch.float32)


def collective_bytes(url):
    """flatshard_collective_bytes_total summed over its labels, from the daemon's metrics."""
    import urllib.request
    total = 0.0
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("flatshard_collective_bytes_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


class _NoStream:
    """Stands in for a CUDA stream or event on CPU: every wait, record and sync is a no-op
    (CPU ops run in program order on one thread, so there is nothing to order)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a):
        pass

    def wait_event(self, *a):
        pass

    def record(self, *a):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cpu_cuda_shims():
    """torch 1.13's FSDP checks torch.cuda.is_available() at its first forward and orders its
    all-gathers and reduce-scatters with CUDA streams and events; its collectives themselves
    go through torch.distributed (gloo here) and work on CPU tensors. With the stream API
    replaced by no-ops it trains on CPU (only for this benchmark's worker process)."""
    import contextlib
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, *a: None
    # gloo has neither _all_gather_base nor reduce-scatter: all_gather into the chunks of the
    # output, and all_reduce + keep this rank's chunk. The second moves 2x the bytes of a
    # reduce-scatter (ring all-reduce = reduce-scatter + all-gather): FSDP's backward is
    # slower here than with NCCL's reduce-scatter would be.
    import torch.distributed as dist

    # MixedPrecision: torch 1.13's gloo has no bfloat16 ("Invalid scalar type"), so a bfloat16
    # all-gather moves the same bits as float16 (a copy: exact), and a 16-bit reduction sums
    # in float32 and rounds once into the output (what flatshard's host kernels do).
    def all_gather_base(output, input, group=None, async_op=False):
        n = dist.get_world_size(group)
        if input.dtype == torch.bfloat16:
            output, input = output.view(torch.float16), input.view(torch.float16)
        return dist.all_gather(list(output.chunk(n)), input, group=group, async_op=async_op)

    gloo_all_reduce = dist.all_reduce

    def reduce_scatter_base(output, input, group=None, async_op=False, op=dist.ReduceOp.SUM):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        full = input.float() if input.dtype in (torch.bfloat16, torch.float16) else input.clone()
        gloo_all_reduce(full, op=op, group=group)
        output.copy_(full.chunk(n)[r])

    # NO_SHARD all-reduces the gradients themselves (in reduce_dtype): 16-bit ones likewise
    # summed in float32 and rounded once.
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dtype not in (torch.bfloat16, torch.float16):
            return gloo_all_reduce(tensor, op=op, group=group, async_op=async_op)
        wide = tensor.float()
        gloo_all_reduce(wide, op=op, group=group)
        tensor.copy_(wide)

    dist._all_gather_base = all_gather_base
    dist._reduce_scatter_base = reduce_scatter_base
    dist.all_reduce = all_reduce


def make_fsdp(model, precision="fp32", strategy="FULL_SHARD"):
    """torch 1.13's FSDP on CPU (spec/semantics.md §5): hashable dataclass default for the
    import on Python 3.11, CPU as the compute device, and no-op CUDA streams/events
    (_cpu_cuda_shims)."""
    _cpu_cuda_shims()
    sys.path.insert(0, str(SOURCE_DIR / "scripts" / "fsdp_fixtures"))
    import fsdp_env  # noqa: F401 - the two patches of spec/semantics.md §5
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    import functools
    import gpt
    return FSDP(model, sharding_strategy=ShardingStrategy[strategy],
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls={gpt.Block}),
                mixed_precision=mixed_precision(precision, fsdp=True))


# ----------------------------------------------------------------------------- launcher
def torch_version():
    import torch
    return torch.__version__.split("+")[0]


# FSDP's strategies in the installed torch: 1.13 has the first three (HYBRID_SHARD and
# _HYBRID_SHARD_ZERO2 came with 2.0). Not read from torch.distributed.fsdp: importing it here
# needs fsdp_env's patches, which belong in the worker processes.
TORCH_FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") + (
    () if tuple(int(v) for v in torch_version().split(".")[:2]) < (2, 0)
    else ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode, args, precision="fp32", out="", strategy="FULL_SHARD", commit="never"):
    """Runs one configuration; returns a dict with step time, peak PSS, losses, or an error.
    `out`: rank 0 saves the final full state dict there. `strategy`: FSDP's sharding strategy
    (fsdp and flatshard modes; single and ddp have none). `commit`: "every" commits after each
    step (flatshard modes)."""
    what = {"mode": mode, "precision": precision, "strategy": strategy, "commit": commit}
    if mode == "ddp" and precision != "fp32":
        return dict(what, error="DistributedDataParallel has no MixedPrecision (float32 only "
                                "here)")
    if mode == "fsdp" and strategy not in TORCH_FSDP_STRATEGIES:
        return dict(what, error=f"torch {torch_version()}'s FSDP has no {strategy}")
    world = 1 if mode == "single" else args.ranks
    # Callers that build `args` by hand (the package's tests) may leave out the newer options.
    optimizer_state = getattr(args, "optimizer_state", "trainer")
    commits = getattr(args, "commits", "never")
    daemon_extra = getattr(args, "daemon_args", "")
    common = [sys.executable, __file__, "--worker", "--mode", mode, "--steps", str(args.steps),
              "--precision", precision, "--out", out, "--strategy", strategy,
              "--warmup", str(args.warmup), "--profile", args.profile,
              "--commit", commit, "--optimizer-state", optimizer_state,
              "--batch", str(args.batch), "--world-size", str(world), "--n-layer",
              str(args.n_layer), "--n-embd", str(args.n_embd), "--block-size",
              str(args.block_size)]
    daemon = None
    extra_pids = []
    state_dir = None
    if mode.startswith("flatshard"):
        from flatshard.testing import LocalDaemon
        port = free_port()
        daemon_args = [f"--metrics_address=127.0.0.1:{port}"]
        if "every" in commits.split(","):  # durable commits: every row keeps records
            state_dir = tempfile.TemporaryDirectory(prefix="flatshard-bench-state-")
            daemon_args.append(f"--state_dir={state_dir.name}")
        daemon_args += daemon_extra.split()
        daemon = LocalDaemon(extra_args=daemon_args).start()
        extra_pids.append(daemon.proc.pid)
        common += ["--address", daemon.address, "--group", "b-" + uuid.uuid4().hex[:8],
                   "--daemon-pid", str(daemon.proc.pid),
                   "--metrics", f"http://127.0.0.1:{port}/metrics"]
    else:
        common += ["--port", str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for r in range(world):
                out = open(os.path.join(tmp, f"{r}.out"), "w")
                err = open(os.path.join(tmp, f"{r}.err"), "w")
                procs.append(subprocess.Popen(common + ["--rank", str(r)], stdout=out,
                                              stderr=err, env=env))
            with PeakSampler([p.pid for p in procs] + extra_pids) as sampler:
                rcs = [p.wait(timeout=args.timeout) for p in procs]
            results = []
            for r, rc in enumerate(rcs):
                if rc != 0:
                    tail = open(os.path.join(tmp, f"{r}.err")).read().strip().splitlines()
                    return dict(what, error=f"rank {r} exited {rc}: "
                                            f"{tail[-1] if tail else ''}")
                results.append(json.loads(open(os.path.join(tmp, f"{r}.out")).read()
                                          .strip().splitlines()[-1]))
    finally:
        if daemon is not None:
            daemon.stop()
        if state_dir is not None:
            state_dir.cleanup()
    per_rank = [statistics.median(r["times"][args.warmup:]) for r in results]
    cpu_rank = [statistics.median(r["cpu"][args.warmup:]) for r in results]
    losses = [sum(r["losses"][i] for r in results) / world for i in range(args.steps)]
    return {**what, "ranks": world, "step_s": max(per_rank), "cpu_s": sum(cpu_rank),
            "daemon_cpu_s": results[0].get("daemon_cpu_s"),
            "peak_pss_mib": sampler.peak / 1024.0, "final_loss": losses[-1], "losses": losses,
            "summon_wait_s": max(r.get("summon_wait_s", 0.0) for r in results),
            "moved_bytes": results[0].get("moved_bytes"),
            "commit_s": max((statistics.median(r["commits"][args.warmup:]) for r in results
                             if r.get("commits")), default=None)}


def cpu_per_step(row):
    """CPU seconds per step of the whole job: every rank's (median over the steps after
    --warmup, summed over ranks) and, for flatshard, the daemon's (its mean over those steps)."""
    return row["cpu_s"] + (row.get("daemon_cpu_s") or 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", default="flatshard")
    ap.add_argument("--modes", default="single,ddp,fsdp,flatshard-noprefetch,flatshard")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--address", default="")
    ap.add_argument("--metrics", default="", help="(worker) the daemon's /metrics URL")
    ap.add_argument("--daemon-pid", type=int, default=0,
                    help="(worker) rank 0 reads the daemon's CPU time per step")
    ap.add_argument("--out", default="", help="(worker) rank 0 saves the final state dict")
    ap.add_argument("--precision", default="fp32", help="(worker) one of --precisions")
    ap.add_argument("--precisions", default="fp32",
                    help="comma-separated gpt.PRECISIONS: fp32, bf16 (bf16 params, fp32 "
                         "reduce), bf16-reduce, fp16 (no CPU kernels in torch 1.13)")
    ap.add_argument("--strategy", default="FULL_SHARD", help="(worker) one of --strategies")
    ap.add_argument("--strategies", default="FULL_SHARD",
                    help="comma-separated FSDP sharding strategies (FULL_SHARD, SHARD_GRAD_OP, "
                         "NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2): fsdp and flatshard run "
                         "once per strategy (single and ddp once)")
    ap.add_argument("--commit", default="never", help="(worker) never or every")
    ap.add_argument("--commits", default="never",
                    help="comma-separated: never, every (flatshard modes: commit after every "
                         "step; see the module docstring)")
    ap.add_argument("--optimizer-state", default="trainer", choices=("trainer", "daemon"),
                    help="daemon: keep_optimizer_state (flatshard modes)")
    ap.add_argument("--daemon-args", default="",
                    help="extra flatshardd flags for the flatshard modes' daemon, space-separated "
                         "(e.g. --daemon-args=--state_fsync=false)")
    ap.add_argument("--group", default="")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--profile", default="",
                    help="cProfile the steps after --warmup; each rank writes "
                         "DIR/MODE-rankR.prof (read with python3 -m pstats)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    import gpt
    n = sum(p.numel() for p in gpt.build_gpt(0, n_layer=args.n_layer, n_embd=args.n_embd,
                                              block_size=args.block_size).parameters())
    print(f"GPT {n / 1e6:.2f} M params ({args.n_layer} blocks, n_embd {args.n_embd}, block "
          f"{args.block_size}), global batch {args.batch}, {args.ranks} ranks, {args.steps} "
          f"AdamW steps (median after {args.warmup}), 1 intra-op thread per process")
    strategies = args.strategies.split(",")
    rows = []
    for p in args.precisions.split(","):
        for m in args.modes.split(","):
            # single and ddp have no sharding strategy: once, listed under the first.
            for st in (strategies if m.startswith(("fsdp", "flatshard")) else strategies[:1]):
                for c in (args.commits.split(",") if m.startswith("flatshard") else ["never"]):
                    rows.append(run_mode(m, args, p, strategy=st, commit=c))
    ok = [r for r in rows if "error" not in r]
    print(f"{'mode':<20} {'strategy':<19} {'precision':<11} {'ranks':>5} {'step ms':>9} "
          f"{'peak MiB/node':>14} {'final loss':>10}  {'flatshard/this (time)':>22} "
          f"{'(memory)':>9} {'summon wait ms/step':>20} {'MiB moved/step':>15} {'commit':>7} "
          f"{'commit ms/step':>15} {'CPU ms/step':>12} {'(CPU)':>6}")
    for r in rows:
        st = r["strategy"] if r["mode"].startswith(("fsdp", "flatshard")) else "-"
        if "error" in r:
            print(f"{r['mode']:<20} {st:<19} {r['precision']:<11} did not run: {r['error']}")
            continue
        fs = next((x for x in ok if x["mode"] == "flatshard" and x["precision"] == r["precision"]
                   and x["strategy"] == r["strategy"] and x["commit"] == r["commit"]), None)
        ratio_t = f"{fs['step_s'] / r['step_s']:.2f}x" if fs else "-"
        ratio_m = f"{fs['peak_pss_mib'] / r['peak_pss_mib']:.2f}x" if fs else "-"
        ratio_c = f"{cpu_per_step(fs) / cpu_per_step(r):.2f}x" if fs else "-"
        wait = f"{r['summon_wait_s'] * 1e3:.1f}" if r["mode"].startswith("flatshard") else "-"
        moved = f"{r['moved_bytes'] / 2**20:.3f}" if r.get("moved_bytes") else "-"
        commit_ms = f"{r['commit_s'] * 1e3:.2f}" if r.get("commit_s") is not None else "-"
        print(f"{r['mode']:<20} {st:<19} {r['precision']:<11} {r['ranks']:>5} "
              f"{r['step_s'] * 1e3:>9.1f} "
              f"{r['peak_pss_mib']:>14.1f} {r['final_loss']:>10.4f}  {ratio_t:>22} "
              f"{ratio_m:>9} {wait:>20} {moved:>15} {r['commit']:>7} {commit_ms:>15} "
              f"{cpu_per_step(r) * 1e3:>12.1f} {ratio_c:>6}")
    moved = {(r["strategy"], r["precision"]): r["moved_bytes"] for r in ok
             if r["mode"] == "flatshard" and r["commit"] == "never" and r.get("moved_bytes")}
    for (st, p), b in moved.items():
        if p != "fp32" and (st, "fp32") in moved:
            print(f"flatshard bytes moved per step, {st}, {p} / fp32: "
                  f"{b / moved[(st, 'fp32')]:.3f}")
    for r in ok:  # commit cost: the committing row against the same row without commits
        base = next((x for x in ok if x["commit"] == "never" and r["commit"] != "never" and
                     all(x[k] == r[k] for k in ("mode", "precision", "strategy"))), None)
        if base is not None:
            print(f"commit cost, {r['mode']} {r['strategy']} {r['precision']} optimizer state "
                  f"in the {args.optimizer_state}: step {base['step_s'] * 1e3:.1f} -> "
                  f"{r['step_s'] * 1e3:.1f} ms ({(r['step_s'] - base['step_s']) / base['step_s']:+.2%}"
                  f"); the commit call {r['commit_s'] * 1e3:.2f} ms = "
                  f"{r['commit_s'] / base['step_s']:.2%} of the step without commits")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if any(r["mode"] == "flatshard" for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
