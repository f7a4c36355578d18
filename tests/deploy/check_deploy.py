#!/usr/bin/python3
"""Checks deploy/ against the daemon and against itself.

Usage: check_deploy.py SOURCE_DIR [FLATSHARDD]

- every YAML file under deploy/ parses;
- every flag the manifests, the systemd unit and its env file pass is a flatshardd flag (from
  `FLATSHARDD --helpfull`, or server/main.cc's ABSL_FLAG lines without a binary);
- the socket path (daemon default, unit, ConfigMap, hostPath mount, preStop drain) agrees;
- the gRPC probe port == --tcp_address's port == the `grpc` container port; the peer port ==
  --peer_address's port == the `peer` container port == the headless Service's peer port; the
  metrics port == --metrics_address's port == the `metrics` port == the scrape annotation;
- grace periods nest (drain + --shutdown_grace < terminationGracePeriodSeconds;
  --shutdown_grace < TimeoutStopSec);
- deploy/Dockerfile installs exactly scripts/setup.sh's PACKAGES.
Exits 0 when all hold; otherwise prints every failure and exits 1.
"""

import configparser
import os
import re
import shlex
import subprocess
import sys

import yaml

FAILURES = []


def check(cond, msg):
    if not cond:
        FAILURES.append(msg)
    return cond


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def daemon_flags(src, binary):
    """Flag name -> default (a string) of flatshardd."""
    flags = {}
    if binary and os.access(binary, os.X_OK):
        out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
        # absl: `    --name (help...); default: "value";` (help may span lines).
        for m in re.finditer(r"--([A-Za-z0-9_]+) \(.*?\);\s+default: (\"(?:[^\"\\]|\\.)*\"|[^;]*);",
                             text, re.S):
            flags[m.group(1)] = m.group(2).strip('"')
        check("socket" in flags, f"{binary} --helpfull lists no --socket flag:\n{text[:2000]}")
    else:
        main = read(os.path.join(src, "server", "main.cc"))
        for m in re.finditer(r"ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,\s*(\"[^\"]*\"|[^,]+),", main):
            flags[m.group(1)] = m.group(2).strip().strip('"')
    return flags


def parse_flag_args(args):
    """['--a=b', '--c'] -> {'a': 'b', 'c': ''} (later wins)."""
    out = {}
    for a in args:
        if not a.startswith("--"):
            continue
        name, _, value = a[2:].partition("=")
        out[name] = value
    return out


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def duration_seconds(text):
    """absl/systemd durations: '10s', '1m30s', '500ms', '90' (seconds)."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(ms|sec|min|s|m|h)", text):
        total += float(num) * units[unit]
    return total


def setup_packages(src):
    text = read(os.path.join(src, "scripts", "setup.sh"))
    m = re.search(r"PACKAGES=\((.*?)\n\)", text, re.S)
    words = []
    for line in m.group(1).splitlines():
        words += line.split("#", 1)[0].split()
    return words


def docker_packages(src):
    text = read(os.path.join(src, "deploy", "Dockerfile"))
    m = re.search(r"# BEGIN PACKAGES.*?\n(.*?)# END PACKAGES", text, re.S)
    if not check(m, "deploy/Dockerfile has no '# BEGIN PACKAGES' ... '# END PACKAGES' block"):
        return []
    body = m.group(1).replace("\\\n", " ")
    install = re.search(r"apt-get install ([^&]*)", body)
    return [w for w in install.group(1).split() if not w.startswith("-")]


def main():
    src = sys.argv[1]
    binary = sys.argv[2] if len(sys.argv) > 2 else ""
    deploy = os.path.join(src, "deploy")
    flags = daemon_flags(src, binary)
    known = set(flags) | {"flagfile", "helpfull", "help", "version"}

    # Every YAML parses.
    docs = {}
    for root, _, files in os.walk(deploy):
        for f in sorted(files):
            if f.endswith((".yaml", ".yml")):
                path = os.path.join(root, f)
                try:
                    docs[os.path.relpath(path, deploy)] = list(yaml.safe_load_all(read(path)))
                except yaml.YAMLError as e:
                    check(False, f"{path}: {e}")
    for name in ("k8s/daemonset.yaml", "k8s/service.yaml", "k8s/configmap.yaml"):
        check(name in docs, f"deploy/{name} is missing")
    if FAILURES:
        return finish()

    ds = docs["k8s/daemonset.yaml"][0]
    svc = docs["k8s/service.yaml"][0]
    cm = docs["k8s/configmap.yaml"][0]
    check(ds["kind"] == "DaemonSet", "daemonset.yaml is not a DaemonSet")
    check(svc["kind"] == "Service" and svc["spec"].get("clusterIP") == "None",
          "service.yaml is not a headless Service (clusterIP: None)")
    check(cm["kind"] == "ConfigMap", "configmap.yaml is not a ConfigMap")
    namespaces = {d["metadata"].get("namespace") for d in (ds, svc, cm)}
    check(len(namespaces) == 1, f"DaemonSet, Service and ConfigMap in different namespaces: {namespaces}")

    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    check(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()),
          "the Service's selector does not match the DaemonSet's pod labels")
    check(ds["spec"]["selector"]["matchLabels"].items() <= labels.items(),
          "the DaemonSet's selector does not match its pod labels")
    check(pod.get("hostIPC") is True, "the DaemonSet needs hostIPC: true (POSIX shm with trainers)")
    containers = [c for c in pod["containers"] if c["name"] == "flatshardd"]
    if not check(len(containers) == 1, "no container named flatshardd"):
        return finish()
    c = containers[0]

    # The daemon's flags: ConfigMap flag file, then args.
    cm_volume = [v for v in pod["volumes"] if "configMap" in v]
    check(cm_volume and cm_volume[0]["configMap"]["name"] == cm["metadata"]["name"],
          "the DaemonSet does not mount the ConfigMap")
    flagfile_lines = []
    for key, value in cm["data"].items():
        flagfile_lines += [l.strip() for l in value.splitlines() if l.strip() and not l.startswith("#")]
    args = list(c.get("command", [])[1:]) + list(c.get("args", []))
    flagfile_arg = parse_flag_args(args).get("flagfile", "")
    check(flagfile_arg, "the container's args do not pass --flagfile")
    cm_mount = [m for m in c["volumeMounts"] if cm_volume and m["name"] == cm_volume[0]["name"]]
    check(cm_mount and os.path.dirname(flagfile_arg) == cm_mount[0]["mountPath"].rstrip("/")
          and os.path.basename(flagfile_arg) in cm["data"],
          f"--flagfile={flagfile_arg} is not a key of the ConfigMap at its mount path")
    k8s_flags = parse_flag_args(flagfile_lines)
    k8s_flags.update(parse_flag_args(args))
    for name in k8s_flags:
        check(name in known, f"k8s: --{name} is not a flatshardd flag")

    # Socket: the daemon's default, the ConfigMap, the hostPath mount, the preStop drain.
    socket = k8s_flags.get("socket", flags.get("socket"))
    check(socket == flags.get("socket"),
          f"k8s socket {socket} differs from the daemon's default {flags.get('socket')}")
    socket_dir = os.path.dirname(socket)
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = [m for m in c["volumeMounts"] if m["name"] in host_paths]
    check(any(m["mountPath"].rstrip("/") == socket_dir and host_paths[m["name"]].rstrip("/") == socket_dir
              for m in mounts),
          f"no hostPath {socket_dir} mounted at {socket_dir} (the socket's directory)")
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    check(os.path.basename(pre_stop[0]) == "flatshardctl" and "drain" in pre_stop,
          f"preStop is not `flatshardctl drain`: {pre_stop}")
    drain_flags = parse_flag_args(pre_stop)
    check(drain_flags.get("socket") == socket,
          f"preStop drains --socket={drain_flags.get('socket')}, the daemon listens on {socket}")

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # gRPC probes: the kubelet connects to the pod IP, so --tcp_address must be set and listen
    # on the probe's port.
    check("tcp_address" in k8s_flags, "k8s: --tcp_address is not set (gRPC probes need TCP)")
    tcp_port = port_of(k8s_flags.get("tcp_address", ":0"))
    for probe_name in ("livenessProbe", "readinessProbe"):
        probe = c.get(probe_name, {})
        check("grpc" in probe, f"{probe_name} is not a grpc probe")
        port = probe.get("grpc", {}).get("port")
        port = ports.get(port, port)
        check(port == tcp_port, f"{probe_name} port {port} != --tcp_address port {tcp_port}")
    check(ports.get("grpc") == tcp_port, f"container port grpc {ports.get('grpc')} != {tcp_port}")
    # Liveness asks the health service name that stays SERVING while draining (server/daemon.h);
    # readiness asks the overall status, which a drain turns NOT_SERVING.
    daemon_h = read(os.path.join(src, "server", "daemon.h"))
    liveness = re.search(r'kLivenessHealthService\[\] = "([^"]+)"', daemon_h)
    check(liveness is not None, "server/daemon.h: kLivenessHealthService not found")
    if liveness:
        service = c.get("livenessProbe", {}).get("grpc", {}).get("service")
        check(service == liveness.group(1),
              f"livenessProbe service {service!r} != {liveness.group(1)!r} (server/daemon.h)")
    check(not c.get("readinessProbe", {}).get("grpc", {}).get("service"),
          "readinessProbe must ask the overall health (no service), which a drain turns off")

    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    check("peer_address" in k8s_flags, "k8s: --peer_address is not set")
    peer_port = port_of(k8s_flags.get("peer_address", ":0"))
    check(ports.get("peer") == peer_port, f"container port peer {ports.get('peer')} != {peer_port}")
    sp = svc_ports.get("peer", {})
    check(sp.get("port") == peer_port and sp.get("targetPort") in ("peer", peer_port),
          f"headless Service peer port {sp} != --peer_address port {peer_port}")

    check("metrics_address" in k8s_flags, "k8s: --metrics_address is not set")
    metrics_port = port_of(k8s_flags.get("metrics_address", ":0"))
    check(ports.get("metrics") == metrics_port,
          f"container port metrics {ports.get('metrics')} != --metrics_address port {metrics_port}")
    annotations = ds["spec"]["template"]["metadata"].get("annotations", {})
    check(str(annotations.get("prometheus.io/port")) == str(metrics_port),
          f"prometheus.io/port {annotations.get('prometheus.io/port')} != {metrics_port}")
    sm = svc_ports.get("metrics")
    check(sm is None or sm.get("port") == metrics_port, f"Service metrics port {sm} != {metrics_port}")
    check(not pod.get("hostNetwork") or pod.get("dnsPolicy") == "ClusterFirstWithHostNet",
          "hostNetwork pods need dnsPolicy: ClusterFirstWithHostNet to resolve Services")

    # Grace periods.
    grace = duration_seconds(k8s_flags.get("shutdown_grace", flags.get("shutdown_grace", "5s")))
    drain = int(drain_flags.get("timeout-ms", "0")) / 1000.0
    tgps = pod.get("terminationGracePeriodSeconds", 30)
    check(drain + grace < tgps,
          f"preStop drain ({drain}s) + --shutdown_grace ({grace}s) >= terminationGracePeriodSeconds ({tgps})")

    # systemd unit and env file.
    unit_path = os.path.join(deploy, "systemd", "flatshardd.service")
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str
    unit.read_string(read(unit_path))
    service = unit["Service"]
    check(service.get("Type") == "notify", "the unit is not Type=notify")
    check(service.get("LimitMEMLOCK") == "infinity", "the unit lacks LimitMEMLOCK=infinity")
    check(service.get("Restart") == "on-failure", "the unit lacks Restart=on-failure")
    for key in ("PrivateDevices", "PrivateIPC", "MemoryDenyWriteExecute"):
        check(service.get(key, "no") in ("no", "false", "0"),
              f"{key}= breaks shared memory or GPU access")
    exec_start = shlex.split(service["ExecStart"])
    unit_flags = parse_flag_args(exec_start[1:])
    unit_socket = unit_flags.get("socket", flags.get("socket"))
    check(unit_socket == flags.get("socket"),
          f"the unit's socket {unit_socket} differs from the daemon's default")
    check(os.path.dirname(unit_socket) == "/run/" + service.get("RuntimeDirectory", ""),
          f"RuntimeDirectory={service.get('RuntimeDirectory')} is not the socket's directory")
    env_text = read(os.path.join(deploy, "systemd", "flatshardd.env"))
    env_args = []
    for line in env_text.splitlines():
        if line.startswith("FLATSHARDD_ARGS="):
            env_args = line.split("=", 1)[1].split()
            env_flags = parse_flag_args(env_args)
            for name in env_flags:
                check(name in known, f"flatshardd.env: --{name} is not a flatshardd flag")
    check(env_args, "flatshardd.env sets no FLATSHARDD_ARGS")
    for name in unit_flags:
        check(name in known, f"the unit's ExecStart: --{name} is not a flatshardd flag")
    env_flags = parse_flag_args(env_args)
    unit_grace = duration_seconds(env_flags.get("shutdown_grace", flags.get("shutdown_grace", "5s")))
    check(unit_grace < duration_seconds(service.get("TimeoutStopSec", "90s")),
          "TimeoutStopSec is not longer than --shutdown_grace")
    check("/etc/flatshard/flatshardd.env" in service.get("EnvironmentFile", ""),
          "the unit does not read /etc/flatshard/flatshardd.env")

    # The Dockerfile installs what setup.sh installs.
    want = setup_packages(src)
    got = docker_packages(src)
    check(sorted(want) == sorted(got),
          "deploy/Dockerfile's packages differ from scripts/setup.sh's: "
          f"only in setup.sh {sorted(set(want) - set(got))}, only in Dockerfile {sorted(set(got) - set(want))}")
    return finish()


def finish():
    for f in FAILURES:
        print("FAIL:", f)
    if not FAILURES:
        print("deploy/: all checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
