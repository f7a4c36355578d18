#!/usr/bin/python3
"""Cost of optimizer state in the daemon (Client.register_state): one rank on a fresh
flatshardd, a model of two Linear(N, N) units; times Commit without state and with Adam's
state (exp_avg, exp_avg_sq: twice the shard bytes, plus the scalar step), and the
register_state call that allocates it. Commit copies every durable buffer into its committed
copy, so its time should grow with the bytes (about 3x with Adam's state).

    PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \\
        /usr/bin/python3 tests/bench/python/optstate_benchmark.py --n 2048 --iters 10
"""
import argparse
import json
import time
import uuid

import torch.nn as nn

import flatshard
import flatshard.testing
from flatshard.torch import manifest_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048, help="Linear(n, n) x 2: 8 n^2 bytes")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    model = nn.Sequential(nn.Linear(args.n, args.n), nn.Linear(args.n, args.n))
    man = manifest_json(model)
    with flatshard.testing.LocalDaemon() as d:
        c = flatshard.Client(d.address)
        c.join("bench-" + uuid.uuid4().hex[:8], 1, 0)
        reg = c.register("", man, "")
        shard_bytes = sum(s.shard_numel for s in reg.shards) * 4

        def commit_seconds():
            c.commit("")  # warm
            t = time.perf_counter()
            for _ in range(args.iters):
                c.commit("")
            return (time.perf_counter() - t) / args.iters

        plain = commit_seconds()
        t = time.perf_counter()
        c.register_state("", [("exp_avg", "float32", "shard"),
                              ("exp_avg_sq", "float32", "shard"),
                              ("step", "float32", "scalar")])
        register = time.perf_counter() - t
        with_state = commit_seconds()
        c.close()
    print(json.dumps({
        "shard_mib": shard_bytes / 2**20,
        "commit_ms": plain * 1e3,
        "commit_gib_s": shard_bytes / plain / 2**30,
        "commit_with_adam_state_ms": with_state * 1e3,
        "commit_with_adam_state_gib_s": 3 * shard_bytes / with_state / 2**30,
        "register_state_ms": register * 1e3,
    }))


if __name__ == "__main__":
    main()
