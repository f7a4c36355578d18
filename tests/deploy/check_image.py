#!/usr/bin/python3
"""Checks deploy/Dockerfile without Docker, against the binaries this build installs.

Usage: check_image.py SOURCE_DIR BUILD_DIR

- `cmake --install BUILD_DIR --component daemon --strip` (the builder stage's command) into a
  temporary prefix; `ldd` every installed binary; each library found maps to its Debian
  package (`dpkg -S`). The runtime stage's package list must be exactly those packages, less
  debian:12-slim's own (libc6, libgcc-s1, zlib1g) and less CUDA and NCCL (loaded at run time,
  from the runtime-cuda stage's packages); a library that no package owns, or that ldd cannot
  find, fails. The installed binaries carry no symbol table (--strip).
- the builder stage installs a subset of scripts/setup.sh's PACKAGES (what CI builds with),
  builds with cmake and installs with `cmake --install ... --strip`;
- the runtime stages start from debian:12-slim (or from each other), install no compiler,
  build tool or -dev package, copy nothing from the build context (only `COPY --from=builder`),
  and end as a non-root numeric USER with ENTRYPOINT flatshardd.
Exits 0 when all hold; otherwise prints every failure and exits 1.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from deploy_util import check, finish, read, setup_packages

BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "zlib1g"}  # debian:12-slim (Priority: required)
LOADED_AT_RUN_TIME = re.compile(r"^lib(cudart|cuda|nccl|nvidia-ml)\.so")
TOOLCHAIN = re.compile(r"^(build-essential|gcc.*|g\+\+.*|cpp.*|clang.*|llvm.*|cmake|make|ninja-build"
                       r"|cuda-nvcc.*|cuda-toolkit.*|git|.*-dev)$")


def stages(dockerfile):
    """[(alias, base, body)] in order; `ARG`s before the first FROM are substituted."""
    text = dockerfile.replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", text.split("\nFROM ", 1)[0], re.M))
    out = []
    for m in re.finditer(r"^FROM (\S+)(?: AS (\S+))?\n(.*?)(?=^FROM |\Z)", text, re.M | re.S):
        base = re.sub(r"\$\{(\w+)\}", lambda a: args.get(a.group(1), ""), m.group(1))
        out.append((m.group(2), base, m.group(3)))
    return out


def block_packages(dockerfile, block):
    """The packages of the `apt-get install` between `# BEGIN <block>` and `# END <block>`."""
    m = re.search(rf"# BEGIN {block}\b.*?\n(.*?)# END {block}\b", dockerfile, re.S)
    if not check(m, f"deploy/Dockerfile has no '# BEGIN {block}' ... '# END {block}' block"):
        return []
    body = m.group(1).replace("\\\n", " ")
    words = []
    for install in re.findall(r"apt-get install ([^&]*)", body):
        words += [w.strip('"') for w in install.split() if not w.startswith("-")]
    return words


def installed_packages(src, build):
    """Debian packages (and CUDA/NCCL libraries) the installed daemon component needs."""
    packages, at_run_time = set(), set()
    with tempfile.TemporaryDirectory() as prefix:
        out = subprocess.run(["cmake", "--install", build, "--component", "daemon", "--prefix",
                              prefix, "--strip"], capture_output=True, text=True, timeout=120)
        if not check(out.returncode == 0, f"cmake --install {build} failed: {out.stderr}"):
            return packages, at_run_time
        bins = sorted(os.path.join(prefix, "bin", b) for b in os.listdir(os.path.join(prefix, "bin")))
        check({os.path.basename(b) for b in bins} == {"flatshardd", "flatshardctl"},
              f"the daemon component installs {bins}, not flatshardd and flatshardctl")
        for b in bins:
            sections = subprocess.run(["readelf", "-S", "-W", b], capture_output=True, text=True)
            check(sections.returncode == 0 and ".symtab" not in sections.stdout,
                  f"{b}: not stripped (a .symtab section) after cmake --install --strip")
            ldd = subprocess.run(["ldd", b], capture_output=True, text=True, timeout=60)
            check(ldd.returncode == 0, f"ldd {b}: {ldd.stderr}")
            libs = {}
            for line in ldd.stdout.splitlines():
                m = re.match(r"\s*(\S+) => (\S+)", line)
                if not m:
                    continue
                soname, path = m.groups()
                if LOADED_AT_RUN_TIME.match(soname):
                    at_run_time.add(soname)
                elif check(path != "not", f"{os.path.basename(b)}: {soname} not found"):
                    libs[soname] = path
            owners = owner_packages(libs.values())
            for soname, path in sorted(libs.items()):
                pkg = owners.get(path)
                check(pkg, f"{os.path.basename(b)}: {path} belongs to no Debian package")
                if pkg:
                    packages.add(pkg)
    return packages, at_run_time


def owner_packages(paths):
    """{path: the package owning it}, with one `dpkg -S` (slow: it reads the whole database).
    dpkg knows a file by the path it shipped it under, which with merged /usr may be /lib/...
    or /usr/lib/..., and a library path may be a symlink."""
    aliases = {}
    for path in paths:
        for p in (path, os.path.realpath(path)):
            aliases[p] = path
            aliases[p[len("/usr"):] if p.startswith("/usr/") else "/usr" + p] = path
    out = subprocess.run(["dpkg", "-S"] + sorted(aliases), capture_output=True, text=True,
                         timeout=120)
    owners = {}
    for line in out.stdout.splitlines():
        pkgs, _, p = line.partition(": ")
        if p in aliases:
            owners.setdefault(aliases[p], pkgs.split(",")[0].split(":")[0].strip())
    return owners


def main():
    src, build = sys.argv[1], sys.argv[2]
    missing = [t for t in ("dpkg", "ldd", "readelf", "cmake") if not shutil.which(t)]
    if missing:
        print(f"SKIP: no {', '.join(missing)} (a Debian host with binutils)")
        return 77
    dockerfile = read(os.path.join(src, "deploy", "Dockerfile"))
    st = stages(dockerfile)
    by_alias = {alias: (base, body) for alias, base, body in st}
    for alias in ("builder", "runtime", "runtime-cuda"):
        check(alias in by_alias, f"deploy/Dockerfile has no stage `{alias}`")
    if "builder" not in by_alias or "runtime" not in by_alias:
        return finish("deploy/Dockerfile")

    # Builder: CI's packages, cmake, cmake --install --strip.
    build_pkgs = block_packages(dockerfile, "BUILD PACKAGES")
    extra = set(build_pkgs) - set(setup_packages(src))
    check(not extra, f"the builder installs {sorted(extra)}, not in scripts/setup.sh's PACKAGES")
    builder = by_alias["builder"][1]
    check(re.search(r"cmake --install \S+ --component daemon .*--strip", builder),
          "the builder stage does not `cmake --install ... --component daemon ... --strip`")

    # Runtime stages: slim, no toolchain, nothing from the context, non-root.
    runtime_pkgs = block_packages(dockerfile, "RUNTIME PACKAGES")
    cuda_pkgs = block_packages(dockerfile, "CUDA RUNTIME PACKAGES")
    for p in runtime_pkgs + cuda_pkgs:
        check(not TOOLCHAIN.match(p), f"a runtime stage installs {p} (a toolchain or -dev package)")
    for alias in ("runtime", "runtime-cuda"):
        if alias not in by_alias:
            continue
        base, body = by_alias[alias]
        check(re.fullmatch(r"debian:12-slim", base) or base in by_alias,
              f"stage {alias} starts from {base}, not debian:12-slim")
        for copy in re.findall(r"^COPY .*$", body, re.M):
            check("--from=builder" in copy, f"stage {alias} copies from the build context: {copy}")
        users = re.findall(r"^USER (\S+)$", body, re.M)
        last = users[-1] if users else None
        check(last and re.fullmatch(r"[1-9]\d*(:\d+)?", last),
              f"stage {alias} does not end as a non-root numeric USER (got {last})")
    check(re.search(r'^ENTRYPOINT \["/usr/local/bin/flatshardd"\]', by_alias["runtime"][1], re.M),
          "the runtime stage's ENTRYPOINT is not /usr/local/bin/flatshardd")
    check("libnccl2" in cuda_pkgs and any(p.startswith("cuda-cudart-") for p in cuda_pkgs),
          "runtime-cuda does not install the CUDA runtime and NCCL")

    # The runtime packages are what the installed binaries load.
    needed, at_run_time = installed_packages(src, build)
    needed -= BASE_IMAGE_PACKAGES
    if needed:
        check(needed == set(runtime_pkgs),
              "the runtime stage's packages are not what ldd finds for the installed binaries: "
              f"missing {sorted(needed - set(runtime_pkgs))}, "
              f"not needed {sorted(set(runtime_pkgs) - needed)}")
    check(not at_run_time,
          f"the installed binaries link {sorted(at_run_time)}: CUDA and NCCL must be opened at "
          "run time, or the slim runtime stage cannot start")
    print(f"runtime packages for bin/flatshardd and bin/flatshardctl: {sorted(needed)}")
    return finish("deploy/Dockerfile")


if __name__ == "__main__":
    sys.exit(main())
