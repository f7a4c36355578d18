"""flatshard.testing.LocalDaemon: start, serve, stop with exit 0, cleanup, no leaked daemons."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import flatshard
import flatshard.testing


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pid, timeout=20.0):
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_start_serve_stop():
    d = flatshard.testing.LocalDaemon()
    with d:
        assert d.address == "unix:" + d.socket and os.path.exists(d.socket)
        c = flatshard.Client(d.address)
        c.join("t", 1, 0)
        c.close()
        pid = d.proc.pid
        tmp = os.path.dirname(d.socket)
    assert d.proc is None and not _alive(pid)
    assert not os.path.exists(tmp)  # temp dir removed
    assert d.leftover_segments == [] and d.segments() == []  # SIGTERM: the daemon cleaned up


def test_startup_failure_names_the_flag():
    with pytest.raises(RuntimeError) as e:
        flatshard.testing.LocalDaemon(extra_args=("--no_such_flag=1",)).start()
    assert "exited at startup" in str(e.value) and "no_such_flag" in str(e.value)


def test_missing_binary():
    with pytest.raises(FileNotFoundError) as e:
        flatshard.testing.LocalDaemon(binary="/nonexistent/flatshardd")
    assert "/nonexistent/flatshardd" in str(e.value)


def test_nonzero_exit_is_reported_and_segments_removed():
    d = flatshard.testing.LocalDaemon().start()
    c = flatshard.Client(d.address)
    c.join("t", 1, 0)
    c.register("", '{"format": "flatshard.manifest/1", "root": {"id": 0, "type": "L", '
               '"bases": ["Module"], "children": [], "params": [{"name": "w", "id": 0, '
               '"shape": [4], "dtype": "float32", "requires_grad": true}]}}', "")
    assert d.segments()  # the shard lives in /dev/shm
    os.kill(d.proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError) as e:
        d.stop()
    assert "status -9" in str(e.value)
    assert d.leftover_segments and d.segments() == []  # removed for the killed daemon
    c.close()


@pytest.mark.parametrize("how", ["exit", "crash"])
def test_no_daemon_outlives_its_process(how):
    """A script that never stops its LocalDaemon: at normal exit it is terminated; when the
    process is killed, the death signal takes the daemon with it."""
    end = "sys.stdout.flush()\n" + ("os.kill(os.getpid(), 9)\n" if how == "crash" else "")
    script = ("import os, sys, flatshard.testing\n"
              "d = flatshard.testing.LocalDaemon().start()\n"
              "print(d.proc.pid, os.path.dirname(d.socket))\n" + end)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ))
    pid, tmp = out.stdout.split()[:2]
    try:
        assert _wait_gone(int(pid)), f"flatshardd {pid} outlived its {how}ed parent"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed parent leaves its temp dir
