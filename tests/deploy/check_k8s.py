#!/usr/bin/python3
"""Checks the kustomize base deploy/k8s against the daemon, against itself and against the
rules of deploy/k8s/README.md.

Usage: check_k8s.py SOURCE_DIR [FLATSHARDD]

Renders, with `kubectl kustomize` (offline), the base, every overlay, the base with each
component and with all of them; without kubectl it checks the base alone, assembled here
(its ConfigMap from the generator's files, its image from `images:`), and says so. For each:
- the kinds (Namespace, generated ConfigMap, headless Service, DaemonSet), one namespace;
- every container: limits.memory; allowPrivilegeEscalation false, readOnlyRootFilesystem,
  capabilities drop ALL and add only what deploy/k8s/README.md names (the init container
  CHOWN; the daemon nothing, or CHOWN and FOWNER as root with components/trainers-any-uid);
  seccomp RuntimeDefault; runAsNonRoot unless it holds those capabilities;
- every image pinned: a tag equal to CMakeLists.txt's project version, never `latest`;
- tolerations (the GPU taint, or every taint);
- every flag flatshardd gets (flag file and args) is a flatshardd flag; no
  --allow_insecure_tcp anywhere; --tls_cert/--tls_key/--tls_ca are files of the mounted
  Secret, whose keys make-tls-secret.sh creates;
- memory: the start script, run with limits.memory from the DaemonSet, passes
  --memory_limit_mib = limits.memory - FLATSHARD_DAEMON_OVERHEAD_MIB (> 0), and nothing else
  sets --memory_limit_mib; requests.memory == limits.memory; a limit at or below the overhead
  stops the script with a message naming limits.memory;
- the socket, the probes (exec flatshardctl on the socket; readiness fails while draining),
  preStop drain, ports, Service, scrape annotation and grace periods agree; the init container
  gives both hostPath directories to the daemon's uid:gid;
- examples/trainer-pod.yaml shares the host IPC namespace, the socket directory and the uid.
No Kubernetes OpenAPI schema check: no validator with an offline schema is packaged for Debian
12 (kubeconform and kubeval are not; `kubectl --validate` needs an API server).
Exits 0 when all hold; otherwise prints every failure and exits 1.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

from deploy_util import (check, daemon_flags, duration_seconds, finish, flagfile_args,
                         known_flags, parse_flag_args, port_of, project_version, read)

DAEMON_EXEC = 'exec /usr/local/bin/flatshardd "$@"'
SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}


def mib(quantity):
    """A Kubernetes memory quantity ('16Gi', '512Mi', '17179869184') in MiB."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    if not m:
        return None
    scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[m.group(2)]
    return int(m.group(1)) * scale // (1 << 20)


def kustomize(k8s, resources, components):
    """Renders a kustomization of `resources` and `components` (dirs under deploy/k8s) made in
    a temporary directory (kustomize wants relative paths)."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = os.path.relpath(k8s, tmp)
        doc = {"resources": [f"{rel}/{r}" for r in resources],
               "components": [f"{rel}/{c}" for c in components]}
        with open(os.path.join(tmp, "kustomization.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f)
        out = subprocess.run(["kubectl", "kustomize", tmp], capture_output=True, text=True,
                             timeout=60)
    if not check(out.returncode == 0, f"kubectl kustomize {resources}+{components}: {out.stderr}"):
        return None
    return list(yaml.safe_load_all(out.stdout))


def assemble_base(k8s):
    """The base without kustomize: its resources, the generated ConfigMap, the pinned image."""
    base = os.path.join(k8s, "base")
    kust = yaml.safe_load(read(os.path.join(base, "kustomization.yaml")))
    docs = []
    for r in kust["resources"]:
        docs += list(yaml.safe_load_all(read(os.path.join(base, r))))
    for gen in kust.get("configMapGenerator", []):
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
                     "data": {f: read(os.path.join(base, f)) for f in gen["files"]}})
    images = {i["name"]: i for i in kust.get("images", [])}
    for d in docs:
        d.setdefault("metadata", {})["namespace"] = kust["namespace"]
        if d["kind"] == "DaemonSet":
            spec = d["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                i = images.get(c["image"])
                if i:
                    c["image"] = f"{i.get('newName', c['image'])}:{i['newTag']}"
    return docs


def run_start_script(script, limit_mib, overhead_mib):
    """Runs the start script as the container would, with flatshardd replaced by printing its
    arguments. Returns (exit code, argv lines, stderr)."""
    check(script.count(DAEMON_EXEC) == 1, f"the start script does not end in `{DAEMON_EXEC} ...`")
    shimmed = script.replace(DAEMON_EXEC, "exec printf '%s\\n' \"$@\"")
    env = {"PATH": "/usr/bin:/bin", "FLATSHARD_CONTAINER_MEMORY_MIB": str(limit_mib),
           "FLATSHARD_DAEMON_OVERHEAD_MIB": str(overhead_mib)}
    out = subprocess.run(["/bin/sh", "-c", shimmed, "flatshardd-start.sh", "--from-args"],
                         capture_output=True, text=True, env=env, timeout=30)
    return out.returncode, out.stdout.splitlines(), out.stderr


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def check_security(where, c, pod_sc, allowed_add):
    sc = c.get("securityContext", {})
    check(sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation is not false")
    check(sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem is not true")
    caps = sc.get("capabilities", {})
    check(caps.get("drop") == ["ALL"], f"{where}: capabilities do not drop ALL: {caps}")
    added = set(caps.get("add", []))
    check(added <= allowed_add, f"{where}: adds capabilities {sorted(added - allowed_add)}")
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
    check(seccomp.get("type") == "RuntimeDefault", f"{where}: seccomp is not RuntimeDefault")
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if added:
        # Capabilities take effect only for root: then exactly the ones asked for.
        check(uid == 0, f"{where}: capabilities {sorted(added)} without runAsUser: 0 do nothing")
    else:
        check(non_root is True and uid not in (None, 0),
              f"{where}: runs as root (runAsNonRoot {non_root}, runAsUser {uid}) with no capability")
    res = c.get("resources", {})
    check(mib(res.get("limits", {}).get("memory", "")) is not None, f"{where}: no limits.memory")


def check_render(name, docs, flags, version, trainer_uid_free):
    """All checks of one rendered variant; `trainer_uid_free`: components/trainers-any-uid."""
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    for kind in ("Namespace", "ConfigMap", "Service", "DaemonSet"):
        if not check(len(kinds.get(kind, [])) == 1, f"{name}: want one {kind}, got {len(kinds.get(kind, []))}"):
            return
    ns = kinds["Namespace"][0]["metadata"]["name"]
    psa = kinds["Namespace"][0]["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
    check(psa == "privileged", f"{name}: namespace {ns} does not admit host namespaces (Pod Security {psa})")
    for d in docs:
        if d["kind"] != "Namespace":
            check(d["metadata"].get("namespace") == ns, f"{name}: {d['kind']} not in namespace {ns}")
    check("allow_insecure_tcp" not in yaml.safe_dump_all(docs),
          f"{name}: --allow_insecure_tcp appears in the manifests")
    ds, cm, svc = kinds["DaemonSet"][0], kinds["ConfigMap"][0], kinds["Service"][0]
    tmpl = ds["spec"]["template"]
    pod, labels = tmpl["spec"], tmpl["metadata"]["labels"]
    pod_sc = pod.get("securityContext", {})
    check(svc["spec"].get("clusterIP") == "None", f"{name}: the Service is not headless")
    check(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()),
          f"{name}: the Service's selector does not match the DaemonSet's pod labels")
    check(ds["spec"]["selector"]["matchLabels"].items() <= labels.items(),
          f"{name}: the DaemonSet's selector does not match its pod labels")
    check(pod.get("hostIPC") is True, f"{name}: the DaemonSet needs hostIPC: true (POSIX shm)")
    check(not pod.get("hostNetwork") or pod.get("dnsPolicy") == "ClusterFirstWithHostNet",
          f"{name}: hostNetwork pods need dnsPolicy: ClusterFirstWithHostNet")
    check(pod.get("automountServiceAccountToken") is False,
          f"{name}: the daemon needs no API token (automountServiceAccountToken: false)")

    tolerations = pod.get("tolerations", [])
    check(any(t.get("key") == "nvidia.com/gpu" or (t.get("operator") == "Exists" and not t.get("key"))
              for t in tolerations), f"{name}: no toleration of the GPU taint: {tolerations}")

    containers = [c for c in pod["containers"] if c["name"] == "flatshardd"]
    if not check(len(containers) == 1, f"{name}: no container named flatshardd"):
        return
    c = containers[0]
    inits = pod.get("initContainers", [])
    for x in inits + pod["containers"]:
        image = x["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else None
        check(tag not in (None, "latest"), f"{name}: {x['name']} image {image} is not pinned")
        check(tag == version, f"{name}: {x['name']} image tag {tag} != project version {version}")
        check(image.rsplit(":", 1)[0].rsplit("/", 1)[-1] in ("flatshard", "flatshard-cuda"),
              f"{name}: {x['name']} image {image} is not deploy/Dockerfile's")
        daemon_caps = {"CHOWN", "FOWNER", "IPC_LOCK"} if trainer_uid_free else set()
        check_security(f"{name}: container {x['name']}", x, pod_sc,
                       daemon_caps if x is c else {"CHOWN"})

    # Volumes and mounts.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"].rstrip("/"): m for m in c["volumeMounts"]}
    for path, m in mounts.items():
        v = volumes.get(m["name"], {})
        if "configMap" in v or "secret" in v:
            check(not any(p.startswith(path + "/") for p in mounts),
                  f"{name}: a mount inside the read-only {m['name']} volume at {path}")

    def mount_of(path):
        """(mount, volume) of the deepest mount holding `path`."""
        best = None
        for mp, m in mounts.items():
            if (path + "/").startswith(mp + "/") and (best is None or len(mp) > len(best)):
                best = mp
        return (mounts[best], volumes.get(mounts[best]["name"], {})) if best else (None, {})

    # The daemon's command line: the start script (from the ConfigMap) with the args.
    cmd = c.get("command", [])
    script_path = cmd[1] if len(cmd) == 2 and cmd[0] == "/bin/sh" else None
    if not check(script_path, f"{name}: the command is not `/bin/sh START_SCRIPT`: {cmd}"):
        return
    m, v = mount_of(script_path)
    check(v.get("configMap", {}).get("name") == cm["metadata"]["name"],
          f"{name}: {script_path} is not in the mounted ConfigMap")
    script = cm["data"].get(os.path.basename(script_path), "")
    check(script, f"{name}: the ConfigMap has no {os.path.basename(script_path)}")
    args = list(c.get("args", []))
    arg_flags = parse_flag_args(args)
    flagfile = arg_flags.get("flagfile", "")
    m, v = mount_of(flagfile)
    check(flagfile and v.get("configMap", {}).get("name") == cm["metadata"]["name"]
          and os.path.basename(flagfile) in cm["data"],
          f"{name}: --flagfile={flagfile} is not a key of the mounted ConfigMap")
    file_args = flagfile_args(cm["data"].get(os.path.basename(flagfile), ""))
    file_flags = parse_flag_args(file_args)
    k8s_flags = dict(file_flags)
    k8s_flags.update(arg_flags)
    known = known_flags(flags)
    for flag in k8s_flags:
        check(flag in known, f"{name}: --{flag} is not a flatshardd flag")
    check("memory_limit_mib" not in k8s_flags,
          f"{name}: --memory_limit_mib is set by hand; the start script derives it from limits.memory")

    # Memory: limits.memory sizes --memory_limit_mib through the start script.
    env = env_of(c)
    res = c.get("resources", {})
    limit = mib(res.get("limits", {}).get("memory", ""))
    check(mib(res.get("requests", {}).get("memory", "")) == limit,
          f"{name}: requests.memory != limits.memory")
    ref = env.get("FLATSHARD_CONTAINER_MEMORY_MIB", {}).get("valueFrom", {}).get("resourceFieldRef", {})
    check(ref.get("resource") == "limits.memory" and ref.get("divisor") == "1Mi"
          and ref.get("containerName", c["name"]) == c["name"],
          f"{name}: FLATSHARD_CONTAINER_MEMORY_MIB is not this container's limits.memory in Mi: {ref}")
    overhead = int(env.get("FLATSHARD_DAEMON_OVERHEAD_MIB", {}).get("value", "0"))
    check(overhead >= 1024, f"{name}: FLATSHARD_DAEMON_OVERHEAD_MIB {overhead} < 1024")
    if limit is not None and script:
        rc, argv, err = run_start_script(script, limit, overhead)
        run_flags = parse_flag_args(argv)
        check(rc == 0 and argv[:1] == ["--from-args"], f"{name}: the start script failed: {err}")
        got = int(run_flags.get("memory_limit_mib", "0") or 0)
        check(got > 0 and got + overhead <= limit,
              f"{name}: --memory_limit_mib {got} + overhead {overhead} > limits.memory {limit} MiB")
        rc, _, err = run_start_script(script, overhead, overhead)
        check(rc != 0 and "limits.memory" in err,
              f"{name}: the start script does not refuse a limit at the overhead: rc {rc}, {err!r}")

    # TLS: off the Unix socket only mutual TLS, with files of the mounted Secret.
    for addr in ("tcp_address", "peer_address"):
        check(addr in k8s_flags, f"{name}: --{addr} is not set")
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        path = k8s_flags.get(flag, "")
        m, v = mount_of(path) if path else (None, {})
        check(path and "secret" in v and os.path.basename(path) in SECRET_KEYS,
              f"{name}: --{flag}={path} is not a file ({sorted(SECRET_KEYS)}) of a mounted Secret")

    # Socket, probes, preStop.
    socket = k8s_flags.get("socket", flags.get("socket"))
    check(socket == flags.get("socket"), f"{name}: socket {socket} != the daemon's default")
    host_paths = {n: v["hostPath"]["path"].rstrip("/") for n, v in volumes.items() if "hostPath" in v}
    owned = []
    for path in (os.path.dirname(socket), k8s_flags.get("state_dir", "")):
        m, v = mount_of(path)
        check(m and m["mountPath"].rstrip("/") == path and host_paths.get(m["name"]) == path,
              f"{name}: {path} is not a hostPath mounted at the same path")
        owned.append(path)
    uid, gid = pod_sc.get("runAsUser"), pod_sc.get("runAsGroup")
    chown = [i for i in inits if i.get("command", [""])[0].endswith("chown")]
    if uid != 0:
        check(chown and chown[0]["command"][1] == f"{uid}:{gid}"
              and set(owned) <= set(chown[0]["command"][2:]),
              f"{name}: no init container chowns {owned} to {uid}:{gid}")

    def ctl_on_socket(command, what):
        text = " ".join(command)
        check("flatshardctl" in text and f"--socket={socket}" in text,
              f"{name}: {what} does not run flatshardctl on {socket}: {command}")
        return text

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c.get(probe, {}).get("exec", {}).get("command", [])
        text = ctl_on_socket(command, probe)
        check(" status" in text, f"{name}: {probe} does not ask `flatshardctl status`")
    check("\"draining\": false" in " ".join(c["readinessProbe"]["exec"]["command"]),
          f"{name}: readinessProbe does not fail while draining")
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    ctl_on_socket(pre_stop, "preStop")
    check("drain" in pre_stop, f"{name}: preStop does not drain: {pre_stop}")
    drain = int(parse_flag_args(pre_stop).get("timeout-ms", "0")) / 1000.0
    grace = duration_seconds(k8s_flags.get("shutdown_grace", flags.get("shutdown_grace", "5s")))
    tgps = pod.get("terminationGracePeriodSeconds", 30)
    check(drain + grace < tgps,
          f"{name}: drain ({drain}s) + --shutdown_grace ({grace}s) >= terminationGracePeriodSeconds ({tgps})")

    # Ports: flags, container ports, the Service, the scrape annotation.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for port_name, flag in (("grpc", "tcp_address"), ("peer", "peer_address"),
                            ("metrics", "metrics_address")):
        want = port_of(k8s_flags.get(flag, ":0"))
        check(ports.get(port_name) == want, f"{name}: container port {port_name} != --{flag}'s {want}")
        sp = svc_ports.get(port_name)
        check(sp is None or (sp["port"] == want and sp.get("targetPort") in (port_name, want)),
              f"{name}: Service port {port_name} {sp} != {want}")
    annotations = tmpl["metadata"].get("annotations", {})
    check(str(annotations.get("prometheus.io/port")) == str(ports.get("metrics")),
          f"{name}: prometheus.io/port != the metrics port")

    # GPUs: the NVIDIA runtime shows the daemon every GPU; the CUDA image.
    if "gpus" in k8s_flags:
        check("NVIDIA_VISIBLE_DEVICES" in env or "nvidia.com/gpu" in res.get("limits", {}),
              f"{name}: --gpus without NVIDIA_VISIBLE_DEVICES or an nvidia.com/gpu limit")
        check(c["image"].rsplit(":", 1)[0].endswith("flatshard-cuda"),
              f"{name}: --gpus with image {c['image']}, not flatshard-cuda")
        check(overhead >= 4096, f"{name}: --gpus with FLATSHARD_DAEMON_OVERHEAD_MIB {overhead} < 4096")
    return socket, uid, gid


def check_trainer_example(k8s, socket, uid):
    pod = yaml.safe_load(read(os.path.join(k8s, "examples", "trainer-pod.yaml")))
    spec = pod["spec"]
    check(spec.get("hostIPC") is True, "trainer-pod.yaml: no hostIPC: true")
    c = spec["containers"][0]
    dirs = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    check(any(m["mountPath"] == os.path.dirname(socket) and dirs.get(m["name"]) == os.path.dirname(socket)
              for m in c["volumeMounts"]),
          f"trainer-pod.yaml: does not mount the hostPath {os.path.dirname(socket)}")
    check(env_of(c).get("FLATSHARD_ADDRESS", {}).get("value") == "unix:" + socket,
          "trainer-pod.yaml: FLATSHARD_ADDRESS is not the daemon's socket")
    check(spec.get("securityContext", {}).get("runAsUser") == uid,
          f"trainer-pod.yaml: trainers must run as the daemon's uid {uid}")


def main():
    src = sys.argv[1]
    binary = sys.argv[2] if len(sys.argv) > 2 else ""
    k8s = os.path.join(src, "deploy", "k8s")
    flags = daemon_flags(src, binary)
    version = project_version(src)
    check(version, "CMakeLists.txt: no project(flatshard VERSION ...)")

    secret_script = read(os.path.join(k8s, "make-tls-secret.sh"))
    for key in SECRET_KEYS:
        check(f"--from-file={key}=" in secret_script,
              f"make-tls-secret.sh does not put {key} into the Secret")

    variants = []
    if shutil.which("kubectl"):
        components = sorted(os.listdir(os.path.join(k8s, "components")))
        variants.append(("base", ["base"], []))
        for comp in components:
            variants.append((f"base+{comp}", ["base"], [f"components/{comp}"]))
        variants.append(("base+all components", ["base"], [f"components/{x}" for x in components]))
        for overlay in sorted(os.listdir(os.path.join(k8s, "overlays"))):
            variants.append((f"overlays/{overlay}", [f"overlays/{overlay}"], []))
        rendered = [(n, kustomize(k8s, r, c), c) for n, r, c in variants]
    else:
        print("SKIP: no kubectl, so no kustomize: checking the base alone, assembled here")
        rendered = [("base", assemble_base(k8s), [])]
    found = None
    for name, docs, comps in rendered:
        if docs is not None:
            r = check_render(name, docs, flags, version,
                             "components/trainers-any-uid" in comps)
            if name == "base":
                found = r
    if found:
        check_trainer_example(k8s, found[0], found[1])
    print(f"rendered and checked: {', '.join(n for n, _, _ in rendered)}")
    print("no Kubernetes OpenAPI schema check: no offline validator is packaged for Debian 12")
    return finish("deploy/k8s")


if __name__ == "__main__":
    sys.exit(main())
