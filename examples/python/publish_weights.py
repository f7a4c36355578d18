#!/usr/bin/python3
"""Weights from a training group to an inference process on the same node (issue 25):

    /usr/bin/python3 examples/python/publish_weights.py --ranks 2 --steps 20 --publish-every 5 \\
        [--reader-user nobody] [--grant uid|token]

The example GPT is trained by --ranks rank processes (train_rank.py, as run_gpt.py does), which
publish the committed step every --publish-every steps (``model.publish("gpt")``: the daemon
builds the version from its committed copies; nothing is gathered in the trainer). A separate
inference process (infer_weights.py: a plain PyTorch GPT, no member of the group; with
--reader-user under that user's uid, granted by uid or by token) watches the name, loads each
version with ``load_state_dict`` and generates greedily.

The check, for every version: the inference model's weights equal, bit for bit, the trainer's
committed full state dict of that generation (rank 0 saves it after publishing, through a
summon), and its greedy generations equal those of a reference GPT loaded with that state dict.
Also reported: whether they equal the generations of the single-process reference trainer
(gpt.train_reference) at that step, which agrees with the ranks' training only within float32
round-off (run_gpt.py's docstring), so a near tie between two tokens may differ.

Needs PYTHONPATH=<build>/python and the daemon binary (FLATSHARD_DAEMON or
<build>/server/flatshardd). Exits 0 when every check held; prints one JSON summary line.
"""
import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import gpt  # noqa: E402
import infer_weights  # noqa: E402
from run_gpt import Job, read_events  # noqa: E402


def as_user(user):
    """(command prefix, uid, group name) running a command as `user` (setpriv; root only)."""
    pw = pwd.getpwnam(user)
    import grp
    group = grp.getgrgid(pw.pw_gid).gr_name
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("--reader-user needs setpriv (util-linux)")
    return ([setpriv, f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"],
            pw.pw_uid, group)


def reference_generations(state_dict):
    model = gpt.build_gpt(seed=0)
    model.load_state_dict(state_dict)
    return infer_weights.generations(model)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--publish-every", type=int, default=5)
    ap.add_argument("--reader-user", default="",
                    help="run the inference process as this user (needs root)")
    ap.add_argument("--grant", choices=["uid", "token"], default="uid",
                    help="how the trainer grants the reader: its uid, or a token")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    versions = args.steps // args.publish_every
    if versions < 1:
        ap.error("--steps must be at least --publish-every")

    prefix, reader_uid, daemon_args = [], os.getuid(), ["--weights_keep=8"]
    if args.reader_user:
        prefix, reader_uid, group = as_user(args.reader_user)
        # The reader's uid must reach the socket: mode 0660, group `group`.
        daemon_args.append(f"--socket_group={group}")
    token = "example-" + os.urandom(8).hex() if args.grant == "token" else ""
    problems, summary = [], {}
    with Job(daemons=1, daemon_args=daemon_args) as job:
        daemon = job.daemons[0]
        os.chmod(job.dir, 0o711)  # the reader reaches the socket, not the files
        os.chmod(os.path.dirname(daemon.socket), 0o711)
        dumps = os.path.join(job.dir, "published")
        os.mkdir(dumps)
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": "/usr/bin:/bin",
               "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent"}
        cmd = [*prefix, sys.executable, os.path.join(HERE, "infer_weights.py"),
               "--address", daemon.address, "--name", "gpt", "--owner", str(os.getuid()),
               "--versions", str(versions), "--timeout", str(args.timeout)]
        if token:
            cmd += ["--token", token]
        out_path, err_path = (os.path.join(job.dir, f"infer.{x}") for x in ("out", "err"))
        with open(out_path, "w") as out, open(err_path, "w") as err:
            reader = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        extra = ["--steps", str(args.steps), "--publish-every", str(args.publish_every),
                 "--publish-name", "gpt", "--publish-dump", dumps]
        extra += ["--reader-token", token] if token else ["--reader-uid", str(reader_uid)]
        t0 = time.monotonic()
        results = job.collect(job.launch(args.ranks, extra), timeout=args.timeout)
        try:
            reader_rc = reader.wait(timeout=max(10.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            reader.kill()
            reader_rc = reader.wait()
        for r, (rc, _events, err) in results.items():
            if rc != 0:
                problems.append(f"rank {r} exited {rc}: {err[-1500:]}")
        events = read_events(out_path)
        if reader_rc != 0:
            problems.append(f"inference process exited {reader_rc}: "
                            f"{open(err_path).read()[-1500:]}")
        ready = [e for e in events if e["event"] == "ready"]
        if ready and ready[0]["uid"] != reader_uid:
            problems.append(f"inference ran as uid {ready[0]['uid']}, not {reader_uid}")
        published = sorted({(e["version"], e["generation"]) for _, evs, _ in results.values()
                            for e in evs if e["event"] == "published"})
        loaded = [e for e in events if e["event"] == "loaded"]
        if [v for v, _ in published] != list(range(1, versions + 1)):
            problems.append(f"published versions {published}, want 1..{versions}")
        if [e["version"] for e in loaded] != [v for v, _ in published]:
            problems.append(f"the inference process loaded {[e['version'] for e in loaded]}, "
                            f"published were {[v for v, _ in published]}")
        ref_agree = []
        for e in loaded:
            g = e["generation"]
            path = os.path.join(dumps, f"gen{g}.pt")
            if not os.path.exists(path):
                problems.append(f"version {e['version']}: no trainer state dict of generation {g}")
                continue
            sd = torch.load(path)
            if e["digest"] != infer_weights.digest(sd):
                bad = [k for k, d in infer_weights.digest(sd).items() if e["digest"].get(k) != d]
                problems.append(f"version {e['version']} (generation {g}): weights differ from "
                                f"the trainer's committed state dict at {bad[:5]}")
            if e["generations"] != reference_generations(sd):
                problems.append(f"version {e['version']}: generations {e['generations']} != "
                                f"the reference model's {reference_generations(sd)}")
            _, ref_sd = gpt.train_reference(g, 12)  # train_rank.py's default batch
            ref_agree.append(e["generations"] == reference_generations(ref_sd))
        summary = {"event": "summary", "ok": not problems, "ranks": args.ranks,
                   "steps": args.steps, "published": published,
                   "loaded": [e["version"] for e in loaded],
                   "reader_uid": reader_uid, "grant": args.grant,
                   "open_ms": [round(e["open_ms"], 2) for e in loaded],
                   "load_ms": [round(e["load_ms"], 2) for e in loaded],
                   "publish_ms": [round(e["ms"], 2) for _, evs, _ in results.values()
                                  for e in evs if e["event"] == "published" and e["rank"] == 0],
                   "single_process_reference_agrees": ref_agree,
                   "generations": {e["version"]: e["generations"] for e in loaded}}
    problems += job.stop_problems
    summary["problems"] = problems
    summary["ok"] = not problems
    print(json.dumps(summary))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
