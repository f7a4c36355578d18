"""Issue 22 with real daemons: a restarted trainer of a group over two daemons registers while
the re-formed group is still rolling its module back, and FlatShardModule registers again by
itself (UNAVAILABLE "... register again") instead of failing.

The window is held open deterministically: daemon 1 runs with
--testing_pause_before_commit_intent=1:<PAUSE>, so rank 1's commit of generation 1 stays in
flight on it (the module busy: its rollback waits behind the copy) while rank 1's trainer, a
subprocess, is SIGKILLed, rank 0 joins again and a new rank 1 joins and registers.

By hand: PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
    /usr/bin/python3 -m pytest -q tests/python/test_torch_reregister.py
"""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import flatshard
import flatshard.testing
from flatshard.torch import FlatShardModule, ModuleWrapPolicy
from conftest import run_ranks
from small_torch_models import Block, Net

PAUSE_S = 20
PAUSED = "paused between its agreement and its intent"

# Rank 1's first trainer: registers, then commits generation 1, which daemon 1 holds.
RANK1 = """
import sys
import flatshard
from flatshard.torch import FlatShardModule, ModuleWrapPolicy
from small_torch_models import Block, Net
c = flatshard.Client(sys.argv[1], call_timeout=120.0, join_timeout=60.0)
c.join(sys.argv[2], 2, 1, coordinator=sys.argv[3])
m = FlatShardModule(Net(), c, auto_wrap_policy=ModuleWrapPolicy({Block}))
m.commit()
"""


class Counting:
    """A flatshard.Client that counts the registers the daemon refused with "register again"."""

    def __init__(self, client):
        self._c = client
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._c, name)

    def register(self, *args, **kwargs):
        try:
            return self._c.register(*args, **kwargs)
        except flatshard.UnavailableError as e:
            if "register again" in str(e):
                self.refused += 1
            raise


def wait_for_log(daemon, text, timeout=60.0):
    deadline = time.monotonic() + timeout
    while text not in Path(daemon.log).read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{daemon.log_tail()}"
        time.sleep(0.02)


def test_a_restarted_rank_registers_again_while_its_daemon_rolls_back():
    group = "rr-" + uuid.uuid4().hex[:8]
    here = str(Path(__file__).resolve().parent)
    with flatshard.testing.LocalDaemon(peer=True, node_name="node0") as d0, \
            flatshard.testing.LocalDaemon(peer=True, node_name="node1", extra_args=(
                f"--testing_pause_before_commit_intent=1:{PAUSE_S}s",)) as d1:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [here] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        first = subprocess.Popen([sys.executable, "-c", RANK1, d1.address, group,
                                  d0.peer_address], env=env, cwd=here)
        c0 = flatshard.Client(d0.address, call_timeout=120.0, join_timeout=120.0)
        try:
            c0.join(group, 2, 0, coordinator=d0.peer_address)
            m0 = FlatShardModule(Net(), c0, auto_wrap_policy=ModuleWrapPolicy({Block}))
            assert m0.commit() == 1  # daemon 0 commits and answers; daemon 1 holds rank 1's
            wait_for_log(d1, PAUSED)
            first.kill()
            assert first.wait(60) == -9

            c0.leave()  # before the replacement joins (README "Restarts")

            def rank(r):
                if r == 0:
                    c0.join(group, 2, 0, coordinator=d0.peer_address)
                    return m0.reattach(), True
                c1 = flatshard.Client(d1.address, call_timeout=120.0, join_timeout=120.0)
                try:
                    c1.join(group, 2, 1, coordinator=d0.peer_address)
                    counting = Counting(c1)
                    m1 = FlatShardModule(Net(), counting,
                                         auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         register_timeout=120.0)
                    return m1.generation, m1.reattached, counting.refused
                finally:
                    c1.close()

            (g0, _), (g1, reattached, refused) = run_ranks(2, rank, timeout=240.0)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(60)
            c0.close()
    assert reattached and g0 == g1 == 1  # daemon 1 finished the commit, then rolled back
    if refused == 0:
        pytest.skip(f"the re-form took longer than the {PAUSE_S}s pause: no register came "
                    f"while daemon 1 rolled back (a very loaded machine)")
    assert refused >= 1
