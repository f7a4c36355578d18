"""flatshard.torch with ranks as processes on real daemons: the example GPT trained with 1, 2,
3 and 4 ranks on one daemon and 2 daemons x 2 ranks equals the single-process reference
(test_torch_resnet.py: resnet18; test_torch_crash.py: a trainer killed mid-step).

Steps per GPT run: FS_TORCH_STEPS (default 8 here; tests/bench/python's soak entry runs 50).
By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_train.py
"""
import os
import sys
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("FS_SOURCE_DIR", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import run_gpt  # noqa: E402

STEPS = int(os.environ.get("FS_TORCH_STEPS", "8"))
# Held to run_gpt.compare's tolerances (run_gpt.py's docstring says which and why).


@pytest.mark.parametrize("ranks,daemons", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)],
                         ids=["1rank", "2ranks", "3ranks", "4ranks", "2daemons_x_2ranks"])
def test_gpt_equals_single_process_reference(ranks, daemons):
    res = run_gpt.run(ranks, daemons, steps=STEPS, batch=12)
    assert not res["problems"], "\n".join(res["problems"])
    assert len(res["losses"]) == STEPS
    assert res["losses"][-1] < res["losses"][0]  # it learns
    print(f"{ranks} ranks on {daemons} daemon(s), {STEPS} steps: max |loss diff| "
          f"{res['max_loss_diff']:.2e}, max |param diff| {res['max_param_diff']:.2e}, mean "
          f"{res['mean_param_diff']:.2e}, {res['seconds']:.1f} s")
    if ranks == 1:  # one rank sums in the reference's order: bit-exact
        assert res["max_loss_diff"] == 0.0 and res["max_param_diff"] == 0.0


def test_use_orig_params_and_size_policy_equal_reference():
    res = run_gpt.run(3, 1, steps=4, batch=12, extra=["--use-orig-params", "--policy", "size"])
    assert not res["problems"], "\n".join(res["problems"])
