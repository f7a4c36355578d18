"""Testing helpers: a local flatshardd for a test or a notebook.

    with flatshard.testing.LocalDaemon() as d:
        c = flatshard.Client(d.address)
"""

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path

__all__ = ["LocalDaemon", "find_daemon"]


def find_daemon(binary=None):
    """The flatshardd to run: `binary`, else $FLATSHARD_DAEMON, else the build's
    server/flatshardd next to this package (<build>/python/flatshard -> <build>), else
    flatshardd on PATH."""
    candidates = []
    if binary:
        candidates.append(Path(binary))
    elif os.environ.get("FLATSHARD_DAEMON"):
        candidates.append(Path(os.environ["FLATSHARD_DAEMON"]))
    else:
        here = Path(__file__).resolve().parent
        candidates.append(here.parent.parent / "server" / "flatshardd")
        on_path = shutil.which("flatshardd")  # installed next to an installed package
        if on_path:
            candidates.append(Path(on_path))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError(
        f"flatshardd not found (tried {', '.join(map(str, candidates))}); set FLATSHARD_DAEMON "
        "or pass binary=")


def _catches_sigterm(pid):
    """Whether process `pid` has a SIGTERM handler (SigCgt in /proc/<pid>/status); True where
    that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except (OSError, ValueError):
        pass
    return True


def _terminate(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class LocalDaemon:
    """Starts flatshardd on a Unix socket in a fresh temp directory (its own segment prefix),
    waits until it serves, and stops it with SIGTERM on exit, checking that it exited 0.

    ``address`` is "unix:<socket>"; ``log`` the path of its stderr. ``extra_args`` are
    appended to the command line (e.g. ``("--simulate_gpus=2",)``). ``peer=True`` gives it a
    peer port on loopback (``peer_address``, what ranks name as ``coordinator``) so that
    several LocalDaemons host one group; ``node_name`` names it in the peer table.

    flatshardd keeps its groups' records in a state directory by default; a LocalDaemon is a
    throwaway one and passes ``--ephemeral`` unless ``extra_args`` name a ``--state_dir``
    (restart tests) or ``--ephemeral`` themselves."""

    def __init__(self, binary=None, extra_args=(), start_timeout=30.0, stop_timeout=30.0, *,
                 peer=False, node_name=None):
        self.binary = find_daemon(binary)
        self.extra_args = tuple(extra_args)
        self.peer = peer
        self.node_name = node_name
        self.peer_address = None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.proc = None
        self._dir = None
        self.socket = None
        self.address = None
        self.log = None
        self.segment_prefix = None
        self._finalizer = None
        self.leftover_segments = []

    def start(self):
        restarting = self._dir is not None  # restart(): same directory, socket and prefix
        if not restarting:
            self._dir = tempfile.TemporaryDirectory(prefix="flatshard-py-")
            d = Path(self._dir.name)
            self.socket = str(d / "flatshardd.sock")
            self.address = "unix:" + self.socket
            self.log = str(d / "flatshardd.log")
            self.segment_prefix = "fspy" + uuid.uuid4().hex[:10]
        d = Path(self._dir.name)
        for stale in (self.socket, str(d / "peer_address")):
            if restarting and os.path.exists(stale):
                os.unlink(stale)
        args = [self.binary, f"--socket={self.socket}", f"--segment_prefix={self.segment_prefix}"]
        ready = self.socket
        if self.peer:  # may host ranks of multi-daemon groups; serves once the file exists
            ready = str(d / "peer_address")
            args += ["--peer_address=127.0.0.1:0", f"--peer_address_file={ready}"]
        if self.node_name:
            args.append(f"--node_name={self.node_name}")
        if not any(a.startswith(("--state_dir", "--ephemeral")) for a in self.extra_args):
            args.append("--ephemeral")
        args += self.extra_args
        # If this process dies without stopping it (a crash), the daemon gets SIGKILL. The
        # death signal follows the thread that started it, so only from the main thread.
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            args = [setpriv, "--pdeathsig", "KILL", *args]
        with open(self.log, "ab" if restarting else "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        # Never stopped (no stop(), no with-block)? Terminated at garbage collection or exit.
        self._finalizer = weakref.finalize(self, _terminate, self.proc)
        deadline = time.monotonic() + self.start_timeout
        try:
            while not os.path.exists(ready):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"flatshardd exited at startup with status "
                                       f"{self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flatshardd did not create {ready} within "
                                       f"{self.start_timeout}s:\n{self.log_tail()}")
                time.sleep(0.01)
            # flatshardd listens before it installs its SIGTERM handler; a SIGTERM in between
            # would kill it (status -15) instead of stopping it. Wait for the handler too.
            while not _catches_sigterm(self.proc.pid):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"flatshardd exited at startup with status "
                                       f"{self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flatshardd installed no SIGTERM handler within "
                                       f"{self.start_timeout}s:\n{self.log_tail()}")
                time.sleep(0.005)
            if self.peer:
                while True:  # written in one go, but read it until it is complete
                    with open(ready) as f:
                        text = f.read().strip()
                    if text:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{ready} stayed empty")
                    time.sleep(0.01)
                self.peer_address = text
        except BaseException:
            self.kill()
            self._cleanup()
            raise
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
        temp directory and, after kill(), the segments the daemon could not remove
        (``leftover_segments``: empty after a clean stop)."""
        proc, self.proc = self.proc, None
        self._detach()
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
            self._cleanup()

    def _cleanup(self):
        """Removes the temp directory and what a killed daemon left in /dev/shm (its segment
        prefix is this object's alone); `leftover_segments` records those."""
        self.leftover_segments = self.segments()
        for name in self.leftover_segments:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def restart(self, *, sigterm=False):
        """Stops the daemon (SIGKILL, a crash; or SIGTERM with ``sigterm=True``, checking it
        exited 0) without cleaning up, and starts it again with the same socket, segment
        prefix and flags: a daemon restart (with ``--state_dir`` it re-adopts its shards)."""
        proc = self.proc
        if sigterm and proc is not None and proc.poll() is None:
            self._detach()
            self.proc = None
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=self.stop_timeout)
            if code != 0:
                raise RuntimeError(f"flatshardd exited with status {code}:\n{self.log_tail()}")
        else:
            self.kill()
        return self.start()

    def kill(self):
        """SIGKILL (a crashed daemon); stop() then only cleans up."""
        proc, self.proc = self.proc, None
        self._detach()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def _detach(self):
        f = getattr(self, "_finalizer", None)
        if f is not None:
            f.detach()
            self._finalizer = None

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
