#!/usr/bin/python3
"""An inference process of the example GPT that is no member of the training group: it watches
the weights the trainer publishes (flatshard.weights), loads each new version into its own
plain PyTorch GPT (load_state_dict: one copy, out of the daemon's read-only shared memory) and
generates greedily from a few prompts.

Prints one JSON object per line on stdout:
  {"event": "ready", "uid": u}
  {"event": "loaded", "version": v, "generation": g, "open_ms": .., "load_ms": ..,
   "digest": {key: sha256 of the loaded tensor's bytes}, "generations": [[tokens], ...]}
  {"event": "skipped", "version": v, "error": ...}  (dropped before it was opened)
  {"event": "done", "versions": [...]}
Run by examples/python/publish_weights.py (and its test); by hand:
    PYTHONPATH=build/python examples/python/infer_weights.py --address unix:/path/d.sock \\
        --name gpt --owner 0 --versions 4
"""
import argparse
import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import flatshard  # noqa: E402
import flatshard.weights  # noqa: E402

import gpt  # noqa: E402

# Greedy continuations of these prompts are compared with the trainer's (counting sequences:
# a trained model continues them with the prompt's stride).
PROMPTS = [[3, 5], [10, 11], [50, 53], [90, 92, 94]]
NEW_TOKENS = 12


def emit(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def digest(state_dict):
    """key -> sha256 of the tensor's bytes (bit-for-bit comparison without shipping them)."""
    return {k: hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest()
            for k, v in state_dict.items()}


def generations(model):
    return [gpt.generate(model, p, NEW_TOKENS) for p in PROMPTS]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default=None, help="default: flatshard.weights' default")
    ap.add_argument("--name", default="gpt")
    ap.add_argument("--owner", type=int, default=None,
                    help="the publisher's uid (default: this process's own)")
    ap.add_argument("--token", default=None)
    ap.add_argument("--versions", type=int, required=True, help="stop after this version")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="give up when no new version appeared for this long (seconds)")
    args = ap.parse_args()

    model = gpt.build_gpt(seed=12345)  # its own initial values: every version overwrites them
    emit(event="ready", uid=os.getuid())
    reader = flatshard.weights.Reader(args.address)
    loaded = []
    last = 0
    for info in reader.watch(args.name, after=0, timeout=args.timeout, owner=args.owner,
                             token=args.token):
        # watch reports the newest version; open every one since the last (each is a step
        # the trainer published), as long as the daemon still keeps it.
        for v in range(last + 1, info.version + 1):
            t0 = time.perf_counter()
            try:
                w = reader.open(args.name, v, owner=args.owner, token=args.token)
            except flatshard.NotFoundError as e:
                emit(event="skipped", version=v, error=str(e))
                continue
            t1 = time.perf_counter()
            with w:
                model.load_state_dict(w)  # strict: every key of the model, no other
            t2 = time.perf_counter()
            emit(event="loaded", version=w.version, generation=w.generation,
                 open_ms=(t1 - t0) * 1e3, load_ms=(t2 - t1) * 1e3,
                 digest=digest(model.state_dict()), generations=generations(model))
            loaded.append(v)
        last = info.version
        if last >= args.versions:
            break
    emit(event="done", versions=loaded)
    reader.close()
    return 0 if last >= args.versions else 1


if __name__ == "__main__":
    sys.exit(main())
