"""flatshard.torch with ranks as processes on a real daemon: every step ends with a collective
commit (``FlatShardModule.step(opt)``); a trainer killed mid-step, after the optimizer updated
shards in place but before the commit, comes back and re-attaches to the last committed step;
the other rank either restarts too or survives. Every rank's shards are then exactly those of
the last committed step (compared bit for bit with the copies the trainers saved after each
commit), never a mix with the killed step's in-place updates.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_crash.py
"""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import gpt  # noqa: E402
import run_gpt  # noqa: E402

# Plain SGD does not amplify round-off: held to these.
RTOL, ATOL = 1e-4, 1e-5
STEPS, KILL = 6, 3
COMMON = ["--steps", str(STEPS), "--batch", "12", "--optimizer", "sgd", "--lr", "0.1",
          "--call-timeout", "20"]
VICTIM = ["--die-at-step", str(KILL), "--die-in", "commit"]


def _shards(folder, tag, rank):
    return torch.load(os.path.join(folder, f"{tag}.rank{rank}.pt"))


def _assert_same(got, want, what):
    assert list(got) == list(want), what
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs"


def _assert_differs(got, want, what):
    assert any(not torch.equal(got[k], want[k]) for k in want), what


def _dumps(job, name):
    d = os.path.join(job.dir, name)
    os.makedirs(d, exist_ok=True)
    return ["--dump-shards", d], d


def _wait_for_event(path, event, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if f'"event": "{event}"' in f.read():
                return
        assert proc.poll() is None, f"the survivor exited {proc.returncode} before {event!r}"
        time.sleep(0.05)
    pytest.fail(f"no {event!r} event in {path} within {timeout} s")


def _assert_reference(losses, final, first_step):
    ref_losses, ref_sd = gpt.train_reference(STEPS, 12, lr=0.1, optimizer="sgd")
    assert sorted(losses) == list(range(first_step, STEPS))
    for s, loss in losses.items():
        assert loss == pytest.approx(ref_losses[s], rel=RTOL, abs=ATOL), s
    for k in ref_sd:
        torch.testing.assert_close(final[k], ref_sd[k], rtol=RTOL, atol=ATOL, msg=k)


def test_trainer_killed_before_commit_both_restart_at_the_committed_step():
    """Rank 1 is SIGKILLed in step 3 after its optimizer updated its shards, before the
    commit; rank 0 updated its shards too and its commit fails fast (UNAVAILABLE naming rank
    1). Both restart without being told where: they re-attach at generation 3 (steps 0-2
    committed), their shards are bit for bit those saved after commit 3 (rank 0's in-place
    update of step 3 rolled back), and they train on from step 3. With plain SGD (no
    optimizer state, which would not survive: it lives in the trainer) the result equals the
    reference."""
    with run_gpt.Job(1) as job:
        dump1, d1 = _dumps(job, "first")
        procs = job.launch(2, COMMON + dump1, tag="first", only={0})
        procs.update(job.launch(2, COMMON + dump1 + VICTIM, tag="first", only={1}))
        first = job.collect(procs, timeout=200, tag="first")
        assert first[1][0] == -9, f"rank 1 should have been killed: {first[1]}"
        assert first[0][0] != 0, "rank 0 should have failed with its peer gone"
        failed = [e for e in first[0][1] if e["event"] == "step_failed"]
        assert failed and failed[0]["step"] == KILL, first[0][1]
        assert failed[0]["error"] == "UnavailableError", failed
        assert "rank 1" in failed[0]["message"], failed
        for r in (0, 1):
            done = [(e["step"], e["generation"]) for e in first[r][1] if e["event"] == "step"]
            assert done == [(s, s + 1) for s in range(KILL)], (r, done)
        # Rank 0's optimizer did update its shards in place in the failed step.
        _assert_differs(_shards(d1, "failed", 0), _shards(d1, f"gen{KILL}", 0),
                        "rank 0's shards after the failed step")

        dump2, d2 = _dumps(job, "second")
        second = job.collect(job.launch(2, COMMON + dump2, tag="second"), timeout=200,
                             tag="second")
        final = job.final("second")
        for r, (rc, events, err) in second.items():
            assert rc == 0, f"restarted rank {r} exited {rc}:\n{err}"
            attached = [e for e in events if e["event"] == "attached"]
            assert attached == [{"event": "attached", "rank": r, "reattached": True,
                                 "generation": KILL}], events
            _assert_same(_shards(d2, "attached", r), _shards(d1, f"gen{KILL}", r),
                         f"rank {r}'s shards at re-attach vs. after commit {KILL}")
            gens = [e["generation"] for e in events if e["event"] == "step"]
            assert gens == list(range(KILL + 1, STEPS + 1)), gens
    _assert_reference(run_gpt.mean_losses(second, 2), final, KILL)


def test_survivor_rejoins_rolls_back_and_continues_with_a_restarted_rank():
    """Rank 1 is SIGKILLed in step 3 after its optimizer step, before the commit. Rank 0
    stays up: it updated its shards in place, its commit fails (UNAVAILABLE: rank 1's session
    ended), it joins again (which waits for the replacement; the group then rolls every
    shard back to commit 3), re-attaches (FlatShardModule.reattach() returns generation 3:
    same parameter objects, its optimizer carries on) and redoes step 3 with the restarted
    rank 1. Both ranks' shards are then exactly those of commit 3; with plain SGD the result
    equals the reference."""
    with run_gpt.Job(1) as job:
        dump1, d1 = _dumps(job, "first")
        survivor = job.launch(2, COMMON + dump1 + ["--survive"], tag="a", only={0})
        victim = job.launch(2, COMMON + dump1 + VICTIM, tag="b", only={1})
        gone = job.collect(victim, timeout=200, tag="b")
        assert gone[1][0] == -9, f"rank 1 should have been killed: {gone[1]}"
        # Restart rank 1 once the survivor has left (its leave would fail the new group).
        _wait_for_event(os.path.join(job.dir, "a.rank0.out"), "left", survivor[0])
        dump2, d2 = _dumps(job, "second")
        back = job.launch(2, COMMON + dump2, tag="c", only={1})
        rest = job.collect(back, timeout=200, tag="c")
        kept = job.collect(survivor, timeout=200, tag="a")
        final = job.final("a")
        rc, events, err = kept[0]
        assert rc == 0, f"the survivor exited {rc}:\n{err}"
        failed = [e for e in events if e["event"] == "step_failed"]
        assert failed and failed[0]["step"] == KILL, events
        assert failed[0]["error"] == "UnavailableError", failed
        assert "rank 1" in failed[0]["message"], failed[0]
        again = [e for e in events if e["event"] == "reattached"]
        assert again and again[0]["step"] == KILL and again[0]["generation"] == KILL, again
        _assert_differs(_shards(d1, "failed", 0), _shards(d1, f"gen{KILL}", 0),
                        "the survivor's shards after the failed step")
        _assert_same(_shards(d1, f"reattached{KILL}", 0), _shards(d1, f"gen{KILL}", 0),
                     f"the survivor's shards after reattach vs. after commit {KILL}")
        assert rest[1][0] == 0, f"the restarted rank exited {rest[1][0]}:\n{rest[1][2]}"
        attached = [e for e in rest[1][1] if e["event"] == "attached"]
        assert attached and attached[0]["reattached"], rest[1][1]
        assert attached[0]["generation"] == KILL, attached
        _assert_same(_shards(d2, "attached", 1), _shards(d1, f"gen{KILL}", 1),
                     f"the restarted rank's shards at re-attach vs. after commit {KILL}")
    _assert_reference(run_gpt.mean_losses({0: kept[0], 1: (0, gone[1][1] + rest[1][1], "")}, 2),
                      final, 0)
