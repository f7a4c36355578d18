"""Testing helpers: a local flatshardd for a test or a notebook.

    with flatshard.testing.LocalDaemon() as d:
        c = flatshard.Client(d.address)
"""

import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

__all__ = ["LocalDaemon", "find_daemon"]


def find_daemon(binary=None):
    """The flatshardd to run: `binary`, else $FLATSHARD_DAEMON, else the build's
    server/flatshardd next to this package (<build>/python/flatshard -> <build>)."""
    candidates = []
    if binary:
        candidates.append(Path(binary))
    elif os.environ.get("FLATSHARD_DAEMON"):
        candidates.append(Path(os.environ["FLATSHARD_DAEMON"]))
    else:
        here = Path(__file__).resolve().parent
        candidates.append(here.parent.parent / "server" / "flatshardd")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError(
        f"flatshardd not found (tried {', '.join(map(str, candidates))}); set FLATSHARD_DAEMON "
        "or pass binary=")


class LocalDaemon:
    """Starts flatshardd on a Unix socket in a fresh temp directory (its own segment prefix),
    waits until it serves, and stops it with SIGTERM on exit, checking that it exited 0.

    ``address`` is "unix:<socket>"; ``log`` the path of its stderr. ``extra_args`` are
    appended to the command line (e.g. ``("--simulate_gpus=2",)``)."""

    def __init__(self, binary=None, extra_args=(), start_timeout=30.0, stop_timeout=30.0):
        self.binary = find_daemon(binary)
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.proc = None
        self._dir = None
        self.socket = None
        self.address = None
        self.log = None
        self.segment_prefix = None

    def start(self):
        self._dir = tempfile.TemporaryDirectory(prefix="flatshard-py-")
        d = Path(self._dir.name)
        self.socket = str(d / "flatshardd.sock")
        self.address = "unix:" + self.socket
        self.log = str(d / "flatshardd.log")
        self.segment_prefix = "fspy" + uuid.uuid4().hex[:10]
        args = [self.binary, f"--socket={self.socket}", f"--segment_prefix={self.segment_prefix}",
                *self.extra_args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"flatshardd exited at startup with status "
                                   f"{self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self._kill()
                raise TimeoutError(f"flatshardd did not create {self.socket} within "
                                   f"{self.start_timeout}s:\n{self.log_tail()}")
            time.sleep(0.01)
        return self

    def log_tail(self, lines=40):
        try:
            with open(self.log, "r", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def segments(self):
        """The daemon's shared-memory segments still in /dev/shm."""
        try:
            return sorted(n for n in os.listdir("/dev/shm") if self.segment_prefix in n)
        except OSError:
            return []

    def stop(self):
        """SIGTERM, then wait; raises if it does not exit 0 within stop_timeout. Removes the
        temp directory (also after kill())."""
        proc, self.proc = self.proc, None
        try:
            if proc is None:
                return
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                raise TimeoutError(f"flatshardd did not exit within {self.stop_timeout}s of "
                                   f"SIGTERM:\n{self.log_tail()}") from None
            if code != 0:
                raise RuntimeError(f"flatshardd exited with status {code}:\n{self.log_tail()}")
        finally:
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None

    def kill(self):
        """SIGKILL (a crashed daemon); stop() then only cleans up."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def _kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            try:
                self.stop()
            except Exception:
                pass  # the body's exception is the one to see
            return False
        self.stop()
        return False
