"""Checkpoint save and load throughput of a real flatshardd against plain file I/O of the same
bytes on the same disk in the same run (README "Checkpoints"; issue 24's targets: save >= 0.9x
the write loop, load >= 0.8x the read loop).

A module of --gib GiB of float32 shards (--units Linear units) is registered over --ranks
ranks (threads, one Client each), filled with random values and committed. Then, --reps
times, alternately:
  - baseline write: one `write` loop of the same shard bytes (8 MiB writes from the shards'
    own memory) into one file in --dir, then fsync;
  - save: client.save_checkpoint (the daemon writes one file per rank in parallel, CRC-32C
    on the way, fsync, rename, metadata last);
  - baseline read: one `read` loop of the baseline file into a buffer allocated once and
    reused (touched memory, as the load's destinations are: the committed copies and the
    shards exist before the load); also, for reference only, into a fresh anonymous mapping
    (this VM is a PVM guest: the first write to each fresh page is very expensive);
  - load: client.load_checkpoint of the checkpoint just written (each rank's file read once
    into its committed copies, CRC-32C on the way, then copied into the shards).
The best of the reps is reported (the machine is shared). By default the page cache is left
as it is (both sides read what was just written: warm); --drop-caches (root) drops it before
each read so both read from the disk. /tmp may be tmpfs: --dir defaults to /var/tmp (check
`df`).

    PYTHONPATH=build/python FLATSHARD_DAEMON=build/server/flatshardd \
        /usr/bin/python3 tests/bench/python/checkpoint_benchmark.py --gib 1 --ranks 2
"""
import argparse
import json
import mmap
import os
import shutil
import threading
import time
import uuid

import torch

import flatshard
import flatshard.testing

CHUNK = 8 << 20


def manifest(units, per_unit):
    rows = 4096
    cols = per_unit // rows
    children = [{"name": f"l{i}", "module": {
        "id": i + 1, "type": "Linear", "bases": ["Module"], "children": [],
        "params": [{"name": "weight", "id": i, "shape": [rows, cols], "dtype": "float32",
                    "requires_grad": True}]}} for i in range(units)]
    return json.dumps({"format": "flatshard.manifest/1",
                       "root": {"id": 0, "type": "Net", "bases": ["Module"], "params": [],
                                "children": children}})


POLICY = json.dumps({"format": "flatshard.policy/1",
                     "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def write_loop(path, views):
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for mv in views:
            for off in range(0, len(mv), CHUNK):
                chunk = mv[off:off + CHUNK]
                done = 0
                while done < len(chunk):
                    done += os.write(fd, chunk[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_loop(path, buf):
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        mv = memoryview(buf)
        off = 0
        while off < len(mv):
            n = os.readv(fd, [mv[off:off + CHUNK]])
            if n == 0:
                break
            off += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--drop-caches", action="store_true")
    args = ap.parse_args()

    total = int(args.gib * (1 << 30)) // 4  # float32 elements
    per_unit = total // args.units // 4096 * 4096
    work = os.path.join(args.dir, "flatshard-ckpt-bench-" + uuid.uuid4().hex[:8])
    os.makedirs(work)
    group = "bench-" + uuid.uuid4().hex[:6]
    results = {"save": [], "write": [], "load": [], "read": [], "read_fresh": []}
    try:
        with flatshard.testing.LocalDaemon() as d:
            clients = [flatshard.Client(d.address, call_timeout=600.0, join_timeout=60.0)
                       for _ in range(args.ranks)]
            views = [None] * args.ranks

            def setup(rank):
                c = clients[rank]
                c.join(group, args.ranks, rank)
                c.register("", manifest(args.units, per_unit), POLICY, init="zeros")
                gen = torch.Generator().manual_seed(rank)
                v = c.shard_views("")
                for s in v:
                    s.shard.uniform_(-1, 1, generator=gen)
                c.commit("")
                views[rank] = [s.shard.numpy() for s in c.shard_views("")]

            threads = [threading.Thread(target=setup, args=(r,)) for r in range(args.ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            mvs = [memoryview(a).cast("B") for vs in views if vs for a in vs]
            nbytes = sum(len(m) for m in mvs)
            assert nbytes > 0, "setup failed"
            c = clients[0]
            base = os.path.join(work, "baseline.bin")
            ckpt = os.path.join(work, "ckpt")
            buf = bytearray(nbytes)
            for _ in range(args.reps):
                if os.path.exists(base):
                    os.unlink(base)
                shutil.rmtree(ckpt, ignore_errors=True)
                results["write"].append(write_loop(base, mvs))
                t0 = time.perf_counter()
                c.save_checkpoint("", ckpt)
                results["save"].append(time.perf_counter() - t0)
                if args.drop_caches:
                    drop_caches()
                results["read"].append(read_loop(base, buf))
                if args.drop_caches:
                    drop_caches()
                fresh = mmap.mmap(-1, nbytes)  # untouched pages
                results["read_fresh"].append(read_loop(base, fresh))
                fresh.close()
                if args.drop_caches:
                    drop_caches()
                t0 = time.perf_counter()
                c.load_checkpoint("", ckpt)
                results["load"].append(time.perf_counter() - t0)
            for cl in clients:
                cl.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gib = nbytes / (1 << 30)
    best = {k: min(v) for k, v in results.items()}
    rate = {k: gib / t for k, t in best.items()}
    print(f"checkpoint benchmark: {gib:.2f} GiB of shards, {args.ranks} ranks, {args.units} "
          f"units, dir {args.dir}, page cache {'dropped' if args.drop_caches else 'warm'}, "
          f"best of {args.reps}")
    print(f"  write loop {rate['write']:.2f} GiB/s   save {rate['save']:.2f} GiB/s   "
          f"ratio {rate['save'] / rate['write']:.2f}x")
    print(f"  read loop  {rate['read']:.2f} GiB/s   load {rate['load']:.2f} GiB/s   "
          f"ratio {rate['load'] / rate['read']:.2f}x   (read loop into touched memory; into "
          f"fresh pages {rate['read_fresh']:.2f} GiB/s)")
    print(json.dumps({"gib": gib, "seconds": results, "ratio_save": rate["save"] / rate["write"],
                      "ratio_load": rate["load"] / rate["read"]}))


if __name__ == "__main__":
    main()
