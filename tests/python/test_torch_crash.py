"""flatshard.torch with ranks as processes on a real daemon: a trainer killed mid-step comes
back and re-attaches to the live shards; the other rank either restarts too or survives.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_crash.py
"""
import os
import sys
from pathlib import Path

import pytest
import torch

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import gpt  # noqa: E402
import run_gpt  # noqa: E402

# Plain SGD does not amplify round-off: held to these.
RTOL, ATOL = 1e-4, 1e-5


def test_trainer_killed_mid_step_reattaches_and_continues():
    """Rank 1 is SIGKILLed inside the backward of step 3; rank 0 fails fast (its collective
    needs rank 1). Both restart, join the same group, re-attach to the live shards (nothing of
    step 3 was applied anywhere) and train on from step 3. With plain SGD (no optimizer state,
    which would not survive: it lives in the trainer) the result equals the reference."""
    steps, kill = 6, 3
    common = ["--steps", str(steps), "--batch", "12", "--optimizer", "sgd", "--lr", "0.1",
              "--call-timeout", "20"]
    with run_gpt.Job(1) as job:
        procs = job.launch(2, common, tag="first", only={0})
        procs.update(job.launch(2, common + ["--die-at-step", str(kill)], tag="first", only={1}))
        first = job.collect(procs, timeout=200, tag="first")
        assert first[1][0] == -9, f"rank 1 should have been killed: {first[1]}"
        assert first[0][0] != 0, "rank 0 should have failed with its peer gone"
        assert "UNAVAILABLE" in first[0][2] or "Unavailable" in first[0][2], first[0][2]
        done_steps = {e["step"] for e in first[0][1] if e["event"] == "step"}
        assert done_steps == set(range(kill)), done_steps
        second = job.collect(job.launch(2, common + ["--start-step", str(kill)], tag="second"),
                             timeout=200, tag="second")
        final = job.final("second")
    for r, (rc, events, err) in second.items():
        assert rc == 0, f"restarted rank {r} exited {rc}:\n{err}"
        done = [e for e in events if e["event"] == "done"]
        assert done and done[0]["reattached"], events
    ref_losses, ref_sd = gpt.train_reference(steps, 12, lr=0.1, optimizer="sgd")
    after = run_gpt.mean_losses(second, 2)
    assert sorted(after) == list(range(kill, steps))
    for s, loss in after.items():
        assert loss == pytest.approx(ref_losses[s], rel=RTOL, abs=ATOL), s
    for k in ref_sd:
        torch.testing.assert_close(final[k], ref_sd[k], rtol=RTOL, atol=ATOL, msg=k)


def test_survivor_rejoins_and_continues_with_a_restarted_rank():
    """Rank 1 is SIGKILLed inside the backward of step 3. Rank 0 stays up: its step fails
    (UNAVAILABLE: rank 1's session ended), it joins again, which waits for the replacement,
    re-attaches (FlatShardModule.reattach(): same parameter objects, its optimizer carries on)
    and redoes step 3 with the restarted rank 1. Plain SGD: the result equals the reference."""
    steps, kill = 6, 3
    common = ["--steps", str(steps), "--batch", "12", "--optimizer", "sgd", "--lr", "0.1",
              "--call-timeout", "20"]
    with run_gpt.Job(1) as job:
        survivor = job.launch(2, common + ["--survive"], tag="a", only={0})
        victim = job.launch(2, common + ["--die-at-step", str(kill)], tag="b", only={1})
        gone = job.collect(victim, timeout=200, tag="b")
        assert gone[1][0] == -9, f"rank 1 should have been killed: {gone[1]}"
        back = job.launch(2, common + ["--start-step", str(kill)], tag="c", only={1})
        rest = job.collect(back, timeout=200, tag="c")
        kept = job.collect(survivor, timeout=200, tag="a")
        final = job.final("a")
    rc, events, err = kept[0]
    assert rc == 0, f"the survivor exited {rc}:\n{err}"
    failed = [e for e in events if e["event"] == "step_failed"]
    assert failed and failed[0]["step"] == kill and failed[0]["error"] == "UnavailableError", failed
    assert "rank 1" in failed[0]["message"], failed[0]
    assert any(e["event"] == "reattached" for e in events)
    assert rest[1][0] == 0, f"the restarted rank exited {rest[1][0]}:\n{rest[1][2]}"
    ref_losses, ref_sd = gpt.train_reference(steps, 12, lr=0.1, optimizer="sgd")
    losses = run_gpt.mean_losses({0: kept[0], 1: (0, gone[1][1] + rest[1][1], "")}, 2)
    assert sorted(losses) == list(range(steps))
    for s, loss in losses.items():
        assert loss == pytest.approx(ref_losses[s], rel=RTOL, abs=ATOL), s
    for k in ref_sd:
        torch.testing.assert_close(final[k], ref_sd[k], rtol=RTOL, atol=ATOL, msg=k)
