#!/usr/bin/python3
"""Runs the rendered DaemonSet's container as the kubelet would, on this host, with the real
binaries, and uses it as the kubelet, an operator and an outsider would.

Usage: k8s_pod_test.py SOURCE_DIR FLATSHARDD FLATSHARDCTL

The base is rendered (check_k8s.py's way); the ConfigMap's files are written to a temporary
directory, the TLS Secret's files are made by deploy/k8s/make-tls-secret.sh for 127.0.0.1, and
the pod's paths (/run/flatshard, /var/lib/flatshard/state, /etc/flatshard/..., /usr/local/bin)
and ports are mapped to temporary ones; $(POD_IP) is 127.0.0.1 and the downward API's
limits.memory is the DaemonSet's. Then:
- the container's command (the start script) starts flatshardd, and its startup probe passes;
- the daemon's memory limit is limits.memory - FLATSHARD_DAEMON_OVERHEAD_MIB;
- the readiness and liveness probes pass; metrics answer over HTTP;
- over TCP, flatshardctl with the operator's client certificate reaches the admin API;
  without a certificate (or with the CA only) status and drain are refused;
- preStop (drain) makes the readiness probe fail while liveness still passes;
- SIGTERM stops it within --shutdown_grace.
Exits 0 when all hold, 77 when a tool it needs (openssl) is missing.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from check_k8s import assemble_base, kustomize, mib
from deploy_util import (FAILURES, check, duration_seconds, finish, flagfile_args,
                         parse_flag_args, read)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    src, flatshardd, flatshardctl = sys.argv[1:4]
    if not shutil.which("openssl"):
        print("SKIP: no openssl for make-tls-secret.sh")
        return 77
    k8s = os.path.join(src, "deploy", "k8s")
    docs = kustomize(k8s, ["base"], []) if shutil.which("kubectl") else assemble_base(k8s)
    if docs is None:
        return finish("k8s pod")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    c = next(x for x in ds["spec"]["template"]["spec"]["containers"] if x["name"] == "flatshardd")

    with tempfile.TemporaryDirectory(prefix="fs-k8s-pod-") as tmp:
        ports = {p["containerPort"]: free_port() for p in c["ports"]}
        paths = {"/run/flatshard": f"{tmp}/run", "/var/lib/flatshard/state": f"{tmp}/state",
                 "/etc/flatshard/config": f"{tmp}/config", "/etc/flatshard/tls": f"{tmp}/tls",
                 "/usr/local/bin/flatshardd": flatshardd,
                 "/usr/local/bin/flatshardctl": flatshardctl}

        pod_paths = re.compile(r"(?<![\w.-])(" + "|".join(
            re.escape(p) for p in sorted(paths, key=len, reverse=True)) + ")")

        def local(text):
            """A pod's paths and ports -> this test's (one pass: a local path is left alone)."""
            text = pod_paths.sub(lambda m: paths[m.group(1)], text)
            for pod_port, port in ports.items():
                text = re.sub(rf":{pod_port}\b", f":{port}", text)
            return text

        for d in ("run", "state", "config"):
            os.mkdir(os.path.join(tmp, d))
        for name, content in cm["data"].items():
            with open(os.path.join(tmp, "config", name), "w", encoding="utf-8") as f:
                f.write(local(content))
        for d in ("tls", "other"):
            made = subprocess.run(["bash", os.path.join(k8s, "make-tls-secret.sh"), f"{tmp}/{d}",
                                   "127.0.0.1"], capture_output=True, text=True, timeout=60)
            if not check(made.returncode == 0, f"make-tls-secret.sh failed: {made.stderr}"):
                return finish("k8s pod")

        limit_mib = mib(c["resources"]["limits"]["memory"])
        env = {"PATH": "/usr/bin:/bin", "POD_IP": "127.0.0.1", "NODE_NAME": "test-node"}
        for e in c["env"]:
            if "value" in e:
                env[e["name"]] = e["value"]
        env["FLATSHARD_CONTAINER_MEMORY_MIB"] = str(limit_mib)
        # The kubelet expands $(VAR) in command and args.
        expand = lambda s: re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), s)
        argv = [local(expand(a)) for a in c["command"] + c["args"]]
        # At start flatshardd removes unreferenced segments of its prefix from /dev/shm: keep
        # away from other daemons on this host.
        argv.append(f"--segment_prefix=fsk8spod{os.getpid()}")
        flags = parse_flag_args(flagfile_args(read(parse_flag_args(argv)["flagfile"])))
        flags.update(parse_flag_args(argv))
        tcp = flags["tcp_address"]
        log = open(os.path.join(tmp, "flatshardd.log"), "w", encoding="utf-8")
        daemon = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

        def probe(command, timeout=15):
            out = subprocess.run([local(a) for a in command], capture_output=True, text=True,
                                 env=env, timeout=timeout)
            return out.returncode, out.stdout + out.stderr

        def ctl(*args):
            out = subprocess.run([flatshardctl] + list(args), capture_output=True, text=True,
                                 timeout=30)
            return out.returncode, out.stdout + out.stderr

        try:
            deadline = time.monotonic() + 30
            while True:
                rc, out = probe(c["startupProbe"]["exec"]["command"])
                if rc == 0 or daemon.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if not check(rc == 0, f"the startup probe never passed: {out}\n"
                                  f"{open(log.name, encoding='utf-8').read()}"):
                return finish("k8s pod")

            rc, out = ctl("status", "--json", f"--socket={flags['socket']}")
            check(rc == 0, f"flatshardctl status on the socket: {out}")
            status = json.loads(out) if rc == 0 else {}
            overhead = int(env["FLATSHARD_DAEMON_OVERHEAD_MIB"])
            check(status.get("memory", {}).get("limit_bytes") == (limit_mib - overhead) << 20,
                  f"memory limit {status.get('memory')} != limits.memory {limit_mib} MiB - {overhead}")
            for name in ("readinessProbe", "livenessProbe"):
                rc, out = probe(c[name]["exec"]["command"])
                check(rc == 0, f"{name} fails on a fresh daemon: {out}")
            metrics = urllib.request.urlopen(f"http://{flags['metrics_address']}/metrics", timeout=10)
            check(b"flatshard_memory_limit_bytes" in metrics.read(), "no metrics over HTTP")

            tls = [f"--tls-ca={tmp}/tls/ca.crt", f"--tls-cert={tmp}/tls/client.crt",
                   f"--tls-key={tmp}/tls/client.key"]
            rc, out = ctl("status", f"--address={tcp}", *tls)
            check(rc == 0, f"flatshardctl with the client certificate over TCP: {out}")
            # Another CA's client certificate (a second make-tls-secret.sh run), and none.
            other = [f"--tls-ca={tmp}/tls/ca.crt", f"--tls-cert={tmp}/other/client.crt",
                     f"--tls-key={tmp}/other/client.key"]
            for name, creds in (("another CA's certificate", other), ("no TLS", [])):
                for command in ("status", "drain"):
                    rc, out = ctl(command, f"--address={tcp}", "--timeout-ms=3000", *creds)
                    check(rc == 1, f"flatshardctl {command} over TCP with {name}: rc {rc} "
                                   f"(want 1, refused): {out}")
            rc, out = probe(c["readinessProbe"]["exec"]["command"])
            check(rc == 0, f"an outsider's drain took effect: readiness fails: {out}")

            rc, out = probe(c["lifecycle"]["preStop"]["exec"]["command"], timeout=90)
            check(rc == 0, f"preStop drain failed: {out}")
            rc, out = probe(c["readinessProbe"]["exec"]["command"])
            check(rc != 0, "the readiness probe passes while draining")
            rc, out = probe(c["livenessProbe"]["exec"]["command"])
            check(rc == 0, f"the liveness probe fails while draining: {out}")

            grace = duration_seconds(flags.get("shutdown_grace", "5s"))
            start = time.monotonic()
            daemon.send_signal(signal.SIGTERM)
            try:
                code = daemon.wait(timeout=grace + 10)
                check(code == 0, f"flatshardd exited {code} on SIGTERM")
                print(f"SIGTERM to exit: {time.monotonic() - start:.2f}s")
            except subprocess.TimeoutExpired:
                check(False, f"flatshardd still runs {grace + 10}s after SIGTERM")
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            log.close()
            if FAILURES:
                print(open(log.name, encoding="utf-8").read()[-4000:])
    return finish("k8s pod")


if __name__ == "__main__":
    sys.exit(main())
