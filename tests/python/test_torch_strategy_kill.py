"""Issue 22's kill tests: HYBRID_SHARD with bf16 params (+ fp32 reduce), 2 daemons x 2 rank
processes (ranks per node 2: each daemon's ranks shard a unit, the daemons replicate it), AdamW
with its state in the daemon (--daemon-optimizer-state), daemons with a --state_dir each.

- A trainer SIGKILLed mid-step (after its optimizer updated its shards and state in place,
  before the commit): every rank restarts, re-attaches at the last committed step and finishes.
- A daemon SIGKILLed mid-step (while the ranks are inside a backward): it restarts on its state
  directory, every rank restarts, re-attaches at the last committed step and finishes.

In both, the losses of the steps after the re-attach and the final parameters equal, bit for
bit, those of an uninterrupted run of the same job (run once per module).

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \\
    /usr/bin/python3 -m pytest -q -rs tests/python/test_torch_strategy_kill.py
"""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import run_gpt  # noqa: E402
import strategy_matrix as mx  # noqa: E402

STRATEGY = os.environ.get("FS_KILL_STRATEGY", "HYBRID_SHARD")  # by hand: any strategy
RANKS, DAEMONS = 4, 2
STEPS, KILL = 5, 2
COMMON = ["--steps", str(STEPS), "--batch", "12", "--optimizer", "adamw",
          "--daemon-optimizer-state", "--precision", "bf16", "--strategy", STRATEGY,
          "--call-timeout", "20"]
# A clean stop frees the kept shards and records (the restart is SIGKILL's, not SIGTERM's).
DAEMON_ARGS = ("--keep_shards=false",)


@pytest.fixture(autouse=True)
def _needs_the_strategy():
    try:
        mx.strategy_kwargs(STRATEGY)
    except mx.Missing as e:
        pytest.skip(str(e))


def _steps(events):
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def _check_ok(results, what):
    bad = [f"rank {r} exited {rc}:\n{err[-1500:]}" for r, (rc, _, err) in sorted(results.items())
           if rc != 0]
    assert not bad, f"{what}: " + "\n".join(bad)


@pytest.fixture(scope="module")
def uninterrupted():
    """The same job without a kill: {rank: {step: loss}}, final full state dict."""
    try:
        mx.strategy_kwargs(STRATEGY)
    except mx.Missing as e:
        pytest.skip(str(e))
    with run_gpt.Job(DAEMONS, DAEMON_ARGS, state=True) as job:
        res = job.collect(job.launch(RANKS, COMMON), timeout=300)
        _check_ok(res, "the uninterrupted run")
        final = job.final()
    assert not job.stop_problems, job.stop_problems
    plan = next(e for e in res[0][1] if e["event"] == "plan")
    try:
        mx.check_sharding(STRATEGY, RANKS, DAEMONS, plan.get("shard_world_size"))
    except mx.Missing as e:
        pytest.skip(str(e))
    return {r: _steps(ev) for r, (_, ev, _) in res.items()}, final


def _assert_resumed_bit_exact(second, final, want):
    want_losses, want_final = want
    for r, (rc, events, err) in sorted(second.items()):
        attached = [e for e in events if e["event"] == "attached"]
        assert attached and attached[0]["reattached"], (r, events[:3])
        assert attached[0]["generation"] == KILL, (r, attached)
        got = _steps(events)
        assert sorted(got) == list(range(KILL, STEPS)), (r, sorted(got))
        for s, loss in got.items():
            assert loss == want_losses[r][s], \
                f"rank {r} step {s}: loss {loss!r}, uninterrupted {want_losses[r][s]!r}"
    assert sorted(final) == sorted(want_final)
    for k in want_final:
        assert torch.equal(final[k], want_final[k]), \
            f"{k}: max |diff| {(final[k] - want_final[k]).abs().max()} against the " \
            f"uninterrupted run"


def test_trainer_killed_mid_step_resumes_bit_exact(uninterrupted):
    """Rank 3 (on daemon 1) is SIGKILLed in step KILL after its AdamW step updated its shards
    and state in place, before the commit; the others' commits fail. All restart."""
    victim = ["--die-at-step", str(KILL), "--die-in", "commit"]
    with run_gpt.Job(DAEMONS, DAEMON_ARGS, state=True) as job:
        procs = job.launch(RANKS, COMMON, tag="first", only={0, 1, 2})
        procs.update(job.launch(RANKS, COMMON + victim, tag="first", only={3}))
        first = job.collect(procs, timeout=300, tag="first")
        assert first[3][0] == -9, f"rank 3 should have been killed: {first[3]}"
        for r in (0, 1, 2):
            assert first[r][0] != 0, f"rank {r} should have failed with rank 3 gone"
            done = sorted(_steps(first[r][1]))
            assert done == list(range(KILL)), (r, done)
        second = job.collect(job.launch(RANKS, COMMON, tag="second"), timeout=300,
                             tag="second")
        _check_ok(second, "the restarted job")
        final = job.final("second")
    assert not job.stop_problems, job.stop_problems
    _assert_resumed_bit_exact(second, final, uninterrupted)


def _wait_stalled(job, procs, tag, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in procs:
            with open(os.path.join(job.dir, f"{tag}.rank{r}.out")) as f:
                if '"event": "stalled"' in f.read():
                    return
        dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
        assert not dead, f"ranks exited before the stall: {dead}"
        time.sleep(0.02)
    pytest.fail(f"no rank reached the stall of step {KILL} within {timeout} s")


def test_daemon_killed_mid_step_restarts_and_resumes_bit_exact(uninterrupted):
    """Every rank stalls (5 s) inside step KILL's backward; daemon 1 is SIGKILLed there and
    restarted on its state directory. The trainers fail (those on daemon 1 lost it, the others
    their peers) and restart; the group re-forms at the committed generation KILL."""
    stall = ["--stall-at-step", str(KILL), "--stall-s", "5"]
    with run_gpt.Job(DAEMONS, DAEMON_ARGS, state=True) as job:
        procs = job.launch(RANKS, COMMON + stall, tag="first")
        _wait_stalled(job, procs, "first")
        job.daemons[1].restart()  # SIGKILL, then the same flags and state directory
        first = job.collect(procs, timeout=300, tag="first")
        for r, (rc, events, err) in sorted(first.items()):
            assert rc != 0, f"rank {r} finished although its group lost a daemon mid-step"
            assert sorted(_steps(events)) == list(range(KILL)), (r, events)
        second = job.collect(job.launch(RANKS, COMMON, tag="second"), timeout=300,
                             tag="second")
        _check_ok(second, "the restarted job")
        final = job.final("second")
    assert not job.stop_problems, job.stop_problems
    _assert_resumed_bit_exact(second, final, uninterrupted)
