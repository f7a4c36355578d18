"""Published weights from Python (issue 25): FlatShardModule.publish / Client.publish and
flatshard.weights (open, watch, list), against real daemons; the example (2 ranks publish,
an inference process under another uid loads and generates) end to end.

Parts that run a reader as another uid (setpriv to `nobody`) need root and are skipped
otherwise."""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn

import flatshard
import flatshard.testing
import flatshard.weights
from flatshard.torch import FlatShardModule, summon_full_params

from conftest import SOURCE_DIR

EXAMPLES = SOURCE_DIR / "examples" / "python"


class Tied(nn.Module):
    """An embedding tied to the output layer, a layer norm between: 4 state-dict keys over 3
    parameters (head.weight is emb.weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.ln(self.emb(idx)))


def train_step(fs, opt, step, commit=True):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 11, (4, 5), generator=g)
    loss = fs(idx).logsumexp(-1).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if commit:
        fs.step(opt)
    else:
        opt.step()


@pytest.fixture
def trainer(daemon, group):
    """A one-rank group training Tied (one committed step): (client, wrapper, optimizer)."""
    c = flatshard.Client(daemon.address)
    c.join(group, 1, 0)
    fs = FlatShardModule(Tied(), c)
    opt = torch.optim.SGD(fs.sharded_parameters(), lr=0.5)
    train_step(fs, opt, 0)
    yield c, fs, opt
    c.close()


def mapping_of(ptr):
    """The /proc/self/maps line of the mapping holding address `ptr`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.strip()
    return ""


def bits(t):
    """The tensor's bytes as integers (bit-for-bit comparison, NaN-safe)."""
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_publish_then_open_is_zero_copy_read_only_and_bit_exact(daemon, trainer):
    c, fs, _ = trainer
    sd = fs.full_state_dict()
    info = fs.publish("tied")
    assert (info.name, info.version, info.generation) == ("tied", 1, fs.generation)
    assert info.tensors == len(sd) == 4 and info.owner_uid == os.getuid()
    assert info.bytes >= sum(v.numel() * v.element_size() for v in sd.values()) - 11 * 6 * 4

    with flatshard.weights.open("tied", address=daemon.address) as w:
        assert (w.version, w.generation, w.bytes) == (1, fs.generation, info.bytes)
        assert sorted(w) == sorted(sd) and len(w) == 4 and "emb.weight" in w
        for k, v in w.items():  # the (name, tensor) pairs an engine's load_weights takes
            assert isinstance(v, flatshard.ReadOnlyTensor)
            assert v.dtype == sd[k].dtype and v.shape == sd[k].shape
            assert torch.equal(bits(v), bits(sd[k])), k
        # Zero-copy: the tensors point into the daemon's segment, mapped read-only and
        # shared; tied keys share their bytes.
        line = mapping_of(w["ln.weight"].data_ptr())
        assert "/dev/shm/" in line and line.split()[1].startswith("r--"), line
        assert w["emb.weight"].data_ptr() == w["head.weight"].data_ptr()
        with pytest.raises(flatshard.ReadOnlyViewError):
            w["ln.bias"].add_(1.0)
        with pytest.raises(flatshard.ReadOnlyViewError):
            w["ln.bias"][0] = 3.0
        # Without torch: memoryviews of the same bytes, read-only.
        mv = w.memoryviews()["ln.weight"]
        assert mv.readonly and mv.tolist() == sd["ln.weight"].tolist()
        plain = Tied()
        plain.load_state_dict(w)  # what an inference process does
        for k, v in plain.state_dict().items():
            assert torch.equal(bits(v), bits(sd[k])), k
    assert w.closed
    with pytest.raises(flatshard.FlatshardError):
        w["ln.weight"]


def test_unknown_name_and_version_errors_name_them(daemon, trainer):
    _, fs, _ = trainer
    fs.publish("known")
    with pytest.raises(flatshard.NotFoundError) as e:
        flatshard.weights.open("no-such-weights", address=daemon.address)
    assert "no-such-weights" in e.value.message
    with pytest.raises(flatshard.NotFoundError) as e:
        flatshard.weights.open("known", 7, address=daemon.address)
    assert "known" in e.value.message and "7" in e.value.message
    for bad in (0, -1, "newest", 1.5):
        with pytest.raises(flatshard.InvalidArgumentError) as e:
            flatshard.weights.open("known", bad, address=daemon.address)
        assert "version" in e.value.message
    with pytest.raises(flatshard.InvalidArgumentError) as e:
        fs.publish("known", dtype="float64x")
    assert "dtype" in e.value.message and "float64x" in e.value.message


def test_watch_and_list(daemon, trainer):
    _, fs, opt = trainer
    first = fs.publish("w")
    reader = flatshard.weights.Reader(daemon.address)
    start = time.monotonic()
    assert list(reader.watch("w", after=first.version, timeout=0.5)) == []
    assert time.monotonic() - start >= 0.4
    got = []

    def publish_later():
        time.sleep(0.3)
        train_step(fs, opt, 1)
        got.append(fs.publish("w"))

    import threading
    t = threading.Thread(target=publish_later)
    t.start()
    it = reader.watch("w", after=first.version, timeout=30)
    seen = next(it)
    t.join()
    assert seen == got[0] and seen.version == 2 and seen.generation == fs.generation
    names = [(v.name, v.version) for v in reader.list()]
    assert ("w", 1) in names and ("w", 2) in names
    assert [v.version for v in flatshard.weights.list(daemon.address) if v.name == "w"] == [1, 2]
    reader.close()


def test_bfloat16_cast_equals_torch(daemon, trainer):
    _, fs, _ = trainer
    sd = fs.full_state_dict()
    fs.publish("bf", dtype=torch.bfloat16)
    with flatshard.weights.open("bf", address=daemon.address) as w:
        for k, v in w.items():
            assert v.dtype == torch.bfloat16 and w.dtype_name(k) == "bfloat16"
            assert torch.equal(bits(v), bits(sd[k].to(torch.bfloat16))), k
    fs.publish("f16", dtype="float16")  # a flatshard dtype name works too
    with flatshard.weights.open("f16", address=daemon.address) as w:
        for k, v in w.items():
            assert torch.equal(bits(v), bits(sd[k].to(torch.float16))), k


def test_publish_refuses_uncommitted_steps_or_commits_them(daemon, trainer):
    _, fs, opt = trainer
    before = fs.generation
    train_step(fs, opt, 1, commit=False)  # FSDP's loop: optimizer.step() alone
    with pytest.raises(flatshard.FailedPreconditionError) as e:
        fs.publish("u")
    assert "uncommitted" in e.value.message and "commit=True" in e.value.message
    with summon_full_params(fs, writeback=False):
        with pytest.raises(AssertionError, match="publish"):
            fs.publish("u", commit=True)  # as commit(): not inside a summon
    info = fs.publish("u", commit=True)
    assert fs.generation == before + 1 == info.generation and info.version == 1
    with flatshard.weights.open("u", address=daemon.address) as w:
        sd = fs.full_state_dict()
        assert all(torch.equal(bits(w[k]), bits(sd[k])) for k in sd)


def _freed(address, name, version, timeout=10.0):
    """Whether `version` of `name` became unopenable (NotFound) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            flatshard.weights.open(name, version, address=address).close()
        except flatshard.NotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_close_and_reader_crash_release_the_version(group):
    with flatshard.testing.LocalDaemon(extra_args=["--weights_keep=1"]) as d:
        c = flatshard.Client(d.address)
        c.join(group, 1, 0)
        fs = FlatShardModule(Tied(), c)
        opt = torch.optim.SGD(fs.sharded_parameters(), lr=0.5)
        fs.publish("r")
        held = flatshard.weights.open("r", 1, address=d.address)
        value = held["ln.weight"].clone()
        # A reader in another process holds it too, then dies without closing.
        code = textwrap.dedent(f"""
            import sys, time, flatshard.weights
            w = flatshard.weights.open("r", 1, address={d.address!r})
            print("open", flush=True)
            time.sleep(120)
        """)
        crasher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                   text=True)
        assert crasher.stdout.readline().strip() == "open"
        for step in (1, 2):  # versions 2 and 3: keep=1 leaves 1 to its readers
            train_step(fs, opt, step)
            fs.publish("r")
        again = flatshard.weights.open("r", 1, address=d.address)  # still there: held
        assert torch.equal(again["ln.weight"], value)
        again.close()
        held.close()
        assert not _freed(d.address, "r", 1, timeout=1.0), "freed while the crasher holds it"
        crasher.send_signal(signal.SIGKILL)
        crasher.wait()
        crasher.stdout.close()
        assert _freed(d.address, "r", 1), "version 1 outlived its last reader"
        assert flatshard.weights.open("r", address=d.address).version == 3
        c.close()


def _nobody():
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("a reader under another uid needs root and setpriv")
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    import grp
    return pw, grp.getgrgid(pw.pw_gid).gr_name


def test_reader_under_another_uid_needs_a_grant(group):
    pw, gname = _nobody()
    with flatshard.testing.LocalDaemon(extra_args=[f"--socket_group={gname}"]) as d:
        os.chmod(os.path.dirname(d.socket), 0o711)  # nobody reaches the socket, no file
        c = flatshard.Client(d.address)
        c.join(group, 1, 0)
        fs = FlatShardModule(Tied(), c)
        sd = fs.full_state_dict()
        fs.publish("by-uid", reader_uids=[pw.pw_uid])
        fs.publish("by-token", reader_token="s3cret")
        fs.publish("private")
        code = textwrap.dedent(f"""
            import json, flatshard, flatshard.weights
            out = {{}}
            def attempt(key, name, **kw):
                try:
                    with flatshard.weights.open(name, owner=0, address={d.address!r}, **kw) as w:
                        out[key] = {{k: v.tolist() for k, v in w.items()}}
                except flatshard.FlatshardError as e:
                    out[key] = [e.code, e.message]
            attempt("uid", "by-uid")
            attempt("token", "by-token", token="s3cret")
            attempt("no_token", "by-token")
            attempt("wrong_token", "by-token", token="guess")
            attempt("private", "private")
            print(json.dumps(out))
        """)
        r = subprocess.run(
            ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
             sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
            env={"PYTHONPATH": os.environ["PYTHONPATH"], "PATH": "/usr/bin:/bin",
                 "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"})
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        want = {k: v.tolist() for k, v in sd.items()}
        assert out["uid"] == want and out["token"] == want
        for key in ("no_token", "wrong_token", "private"):
            assert out[key][0] == "PERMISSION_DENIED", (key, out[key])
        c.close()


def test_example_two_ranks_publish_and_an_inference_process_loads_each_version():
    cmd = [sys.executable, str(EXAMPLES / "publish_weights.py"), "--ranks", "2", "--steps",
           "10", "--publish-every", "5", "--timeout", "240"]
    if os.getuid() == 0 and shutil.which("setpriv"):
        cmd += ["--reader-user", "nobody"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["loaded"] == [1, 2], summary
    assert [g for _, g in summary["published"]] == [5, 10]
    if "--reader-user" in cmd:
        assert summary["reader_uid"] == pwd.getpwnam("nobody").pw_uid
