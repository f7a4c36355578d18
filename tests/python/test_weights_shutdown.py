"""SIGTERM with readers watching or holding versions open (issue 25 follow-up, README
"Publishing weights"): the daemon ends every open watch and every open version's lease stream
at once with UNAVAILABLE "flatshardd is shutting down" and exits, instead of waiting its
--shutdown_grace for the streams. The grace here is 60 s and LocalDaemon's stop deadline 20 s:
a daemon that waited for a stream would fail the stop."""

import threading
import time
import urllib.request

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
import flatshard.weights
from flatshard.torch import FlatShardModule

GRACE = "--shutdown_grace=60s"


def _wait_for_metric(addr_file, line, timeout=60.0):
    """Polls the daemon's metrics until `line` appears (a state, not a time: no sleep is a
    synchronization here beyond the poll's pause)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        addr = addr_file.read_text().strip() if addr_file.exists() else ""
        if addr:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
                text = r.read().decode()
            if f"\n{line}\n" in text:
                return
        time.sleep(0.02)
    raise AssertionError(f"{line!r} not in the metrics within {timeout}s:\n{text}")


def test_sigterm_ends_open_watches_with_a_named_error(tmp_path):
    addr_file = tmp_path / "metrics.addr"
    with flatshard.testing.LocalDaemon(peer=True, extra_args=(GRACE,),
                                       stop_timeout=20) as source:
        local = flatshard.testing.LocalDaemon(stop_timeout=20, extra_args=(
            GRACE, f"--weights_sources={source.peer_address}", "--metrics_address=127.0.0.1:0",
            f"--metrics_address_file={addr_file}"))
        with local:
            reader = flatshard.weights.Reader(local.address)
            outcome = []

            def watch():
                try:
                    outcome.append(next(reader.watch("w", timeout=None)))
                except flatshard.FlatshardError as e:
                    outcome.append(e)

            watcher = threading.Thread(target=watch)
            watcher.start()
            # The local daemon registers the watch, then follows "w" at the source; the
            # gauge counts the source's WatchVersions stream once the source registered it.
            _wait_for_metric(addr_file, "flatshard_weights_follow_streams 1")
            # The source stops with another daemon's WatchVersions stream open (raises if it
            # takes past stop_timeout or exits non-zero).
            source.stop()
            assert watcher.is_alive()  # the local watch does not end with its source
            local.stop()
            watcher.join(20)
            assert not watcher.is_alive()
            reader.close()
    assert len(outcome) == 1 and isinstance(outcome[0], flatshard.UnavailableError), outcome
    assert "flatshardd is shutting down" in str(outcome[0])
    assert "watch" in str(outcome[0])


def test_watch_of_a_plain_daemon_ends_on_sigterm(tmp_path):
    """No sources: the watch waits on the publisher alone. SIGTERM once the watch is
    registered (the gauge says so): the reader gets UNAVAILABLE and the daemon stops."""
    addr_file = tmp_path / "metrics.addr"
    with flatshard.testing.LocalDaemon(extra_args=(
            GRACE, "--metrics_address=127.0.0.1:0", f"--metrics_address_file={addr_file}"),
            stop_timeout=20) as d:
        reader = flatshard.weights.Reader(d.address)
        outcome = []

        def watch():
            try:
                outcome.append(next(reader.watch("w", timeout=None)))
            except flatshard.FlatshardError as e:
                outcome.append(e)

        watcher = threading.Thread(target=watch)
        watcher.start()
        _wait_for_metric(addr_file, "flatshard_weights_watches 1")
        d.stop()
        watcher.join(20)
        assert not watcher.is_alive()
        reader.close()
    assert len(outcome) == 1 and isinstance(outcome[0], flatshard.UnavailableError), outcome
    assert "the watch ended" in str(outcome[0])


def test_sigterm_ends_open_leases_and_the_mapping_stays(tmp_path):
    """A reader holds a version open (its lease stream) across the daemon's SIGTERM: the
    daemon exits at once (not after its 60 s grace), the reader's tensors still hold the
    bytes, and the daemon restarted with its state directory serves the same version."""
    d = flatshard.testing.LocalDaemon(
        extra_args=(GRACE, f"--state_dir={tmp_path / 'state'}"), stop_timeout=20)
    with d:
        c = flatshard.Client(d.address)
        c.join("lease", 1, 0)
        torch.manual_seed(5)
        fs = FlatShardModule(nn.Linear(4, 3), c)
        opt = torch.optim.SGD(fs.sharded_parameters(), lr=0.5)
        fs(torch.ones(2, 4)).sum().backward()
        fs.step(opt)
        info = fs.publish("w")
        reader = flatshard.weights.Reader(d.address)
        held = reader.open("w")
        before = {k: held[k].clone() for k in held}
        assert before and held.version == info.version
        c.close()
        # Raises if the daemon does not exit 0 within 20 s of SIGTERM (the lease is open).
        d.restart(sigterm=True)
        for k, t in before.items():
            assert torch.equal(held[k], t), k  # the mapping is still the reader's
        again = reader.open("w")
        assert again.version == info.version
        for k, t in before.items():
            assert torch.equal(again[k], t), k
        again.close()
        held.close()
        reader.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
