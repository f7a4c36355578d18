#!/usr/bin/python3
"""Checks deploy/systemd against the daemon and against itself.

Usage: check_deploy.py SOURCE_DIR [FLATSHARDD]

- every flag the systemd unit and its env file pass is a flatshardd flag (from
  `FLATSHARDD --helpfull`, or server/main.cc's ABSL_FLAG lines without a binary);
- the unit's socket is the daemon's default, in its RuntimeDirectory;
- --shutdown_grace < TimeoutStopSec; Type=notify, LimitMEMLOCK=infinity, Restart=on-failure,
  nothing that hides /dev/shm or the GPUs.
(deploy/k8s: check_k8s.py; deploy/Dockerfile: check_image.py.)
Exits 0 when all hold; otherwise prints every failure and exits 1.
"""

import configparser
import os
import shlex
import sys

from deploy_util import (check, daemon_flags, duration_seconds, finish, known_flags,
                         parse_flag_args, read)


def main():
    src = sys.argv[1]
    binary = sys.argv[2] if len(sys.argv) > 2 else ""
    deploy = os.path.join(src, "deploy")
    flags = daemon_flags(src, binary)
    known = known_flags(flags)

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
    return finish("deploy/systemd")


if __name__ == "__main__":
    sys.exit(main())
