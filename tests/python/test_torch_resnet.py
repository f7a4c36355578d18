"""flatshard.torch with ranks as processes on a real daemon: torchvision's resnet18 (BatchNorm)
trains.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_resnet.py
"""
import os
import sys
from pathlib import Path

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import run_gpt  # noqa: E402


def test_resnet18_trains_and_keeps_batchnorm_buffers_per_rank():
    """torchvision resnet18, one unit per BasicBlock; BatchNorm's buffers are not sharded
    (as FSDP: every rank keeps and updates its own running statistics)."""
    steps = 8
    extra = ["--model", "resnet18", "--steps", str(steps), "--batch", "16", "--lr", "0.05",
             "--optimizer", "sgd"]
    with run_gpt.Job(1) as job:
        results = job.collect(job.launch(2, extra), timeout=400)
        final = job.final()
    for r, (rc, _, err) in results.items():
        assert rc == 0, f"rank {r} exited {rc}:\n{err}"
    losses = list(run_gpt.mean_losses(results, 2).values())
    assert len(losses) == steps
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.8 * first, f"loss did not fall: {losses}"
    import torchvision
    plain = torchvision.models.resnet18(num_classes=10)
    assert list(final) == list(plain.state_dict())
    plain.load_state_dict(final)
    assert float(final["bn1.running_mean"].abs().sum()) > 0  # rank 0's statistics moved
