"""Python-side costs of the flatshard package (CTest label `bench`, not in the default run):

    PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
        /usr/bin/python3 tests/python/bench_client.py [--iters N]

Prints, for the example GPT (one rank, host memory): summon+end round trips through Python
(read-only and writeback, with and without building the params dict of tensors), the same
with a numpy view, a reduce_scatter_grads of the largest unit, and the per-op overhead of
ReadOnlyTensor against a plain tensor over the same memory.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flatshard  # noqa: E402
import flatshard.testing  # noqa: E402
from conftest import read_model  # noqa: E402


def timed(label, n, fn):
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    print(f"{label:<58} {us:10.1f} us")
    return us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    n = ap.parse_args().iters
    manifest, policy = read_model("gpt_tied")
    with flatshard.testing.LocalDaemon() as d:
        c = flatshard.Client(d.address)
        c.join("bench", 1, 0)
        reg = c.register("", manifest, policy)
        units = reg.plan["units"]
        big = max(units, key=lambda u: u["padded_numel"])
        nparams = sum(len(u["params"]) + len(u.get("shared", [])) for u in units)
        print(f"model: {len(units)} units, {nparams} param views, largest unit "
              f"{big['padded_numel']} elements")

        def summon_end(writeback, touch):
            def f():
                s = c.summon("", writeback=writeback)
                if touch == "params":
                    s.params
                elif touch == "numpy":
                    s.numpy_params
                s.end()
            return f

        timed("summon+end read-only (no views built)", n, summon_end(False, None))
        timed("summon+end read-only + params dict", n, summon_end(False, "params"))
        timed("summon+end read-only + numpy_params dict", n, summon_end(False, "numpy"))
        timed("summon+end writeback + params dict", n, summon_end(True, "params"))
        g = torch.ones(big["padded_numel"])
        timed(f"reduce_scatter_grads unit {big['index']}", n,
              lambda: c.reduce_scatter_grads("", big["index"], g))
        with c.summon("", writeback=False) as s:
            ro = s.flat(big["index"])
            plain = ro.as_subclass(torch.Tensor)  # same memory, unguarded (reads only)
            timed("ReadOnlyTensor.sum()", n * 10, lambda: ro.sum())
            timed("plain Tensor.sum() (same memory)", n * 10, lambda: plain.sum())
        print(f"segment_map_calls={c.segment_map_calls}")
        c.close()


if __name__ == "__main__":
    main()
