"""Helpers shared by the checks of deploy/ (check_deploy.py, check_k8s.py, check_image.py)."""

import os
import re
import subprocess

FAILURES = []


def check(cond, msg):
    if not cond:
        FAILURES.append(msg)
    return cond


def finish(what):
    for f in FAILURES:
        print("FAIL:", f)
    if not FAILURES:
        print(f"{what}: all checks passed")
    return 1 if FAILURES else 0


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def daemon_flags(src, binary):
    """Flag name -> default (a string) of flatshardd: from `BINARY --helpfull`, or server/main.cc's
    ABSL_FLAG lines when the binary is not built."""
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


def known_flags(flags):
    return set(flags) | {"flagfile", "helpfull", "help", "version"}


def parse_flag_args(args):
    """['--a=b', '--c'] -> {'a': 'b', 'c': ''} (later wins)."""
    out = {}
    for a in args:
        if not a.startswith("--"):
            continue
        name, _, value = a[2:].partition("=")
        out[name] = value
    return out


def flagfile_args(text):
    """The flags of an absl flag file: one a line; '#' lines and blank lines are skipped."""
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


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
    """scripts/setup.sh's PACKAGES."""
    text = read(os.path.join(src, "scripts", "setup.sh"))
    m = re.search(r"PACKAGES=\((.*?)\n\)", text, re.S)
    words = []
    for line in m.group(1).splitlines():
        words += line.split("#", 1)[0].split()
    return words


def project_version(src):
    """The VERSION of CMakeLists.txt's project()."""
    m = re.search(r"project\(\s*flatshard\s+VERSION\s+([0-9.]+)",
                  read(os.path.join(src, "CMakeLists.txt")))
    return m.group(1) if m else None
