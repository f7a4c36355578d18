"""flatshard.weights.watch on a daemon with --weights_sources (issue 25, README "Readers on
other nodes"): the reader's daemon follows the name at the source, so each publish reaches
the watching reader already copied there, bit for bit, without an open asking for it."""

import threading

import torch

import flatshard
import flatshard.testing
import flatshard.weights
from flatshard.torch import FlatShardModule

from test_weights import Tied, bits, train_step


def test_watch_on_a_reader_daemon_gets_each_publish_copied_from_the_source(group):
    with flatshard.testing.LocalDaemon(peer=True) as source, flatshard.testing.LocalDaemon(
            extra_args=(f"--weights_sources={source.peer_address}",)) as local:
        c = flatshard.Client(source.address)
        c.join(group, 1, 0)
        fs = FlatShardModule(Tied(), c)
        opt = torch.optim.SGD(fs.sharded_parameters(), lr=0.5)
        reader = flatshard.weights.Reader(local.address)
        it = reader.watch("w", timeout=90)
        for step in range(3):
            seen = []
            # The watch waits on the reader's daemon, which copies nothing until it hears.
            waiting = threading.Thread(target=lambda: seen.append(next(it)))
            waiting.start()
            train_step(fs, opt, step)
            info = fs.publish("w")
            waiting.join(120)
            assert not waiting.is_alive()
            assert len(seen) == 1 and seen[0].version == info.version == step + 1
            assert seen[0].generation == info.generation == fs.generation
            sd = fs.full_state_dict()
            with reader.open("w", version=info.version) as w:  # already here: no copy
                assert sorted(w) == sorted(sd)
                for k, v in w.items():
                    assert torch.equal(bits(v), bits(sd[k])), k
        assert [v.version for v in reader.list() if v.name == "w"] == [2, 3]  # --weights_keep
        reader.close()
        c.close()
