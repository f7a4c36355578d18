"""The PEP 517 build backend of the flatshard Python package (pyproject.toml), stdlib only.

The extension flatshard._C is built by the project's CMake build (target flatshard_python), so
a wheel is that build's extension plus the pure-Python files of client/python/flatshard/, with
PEP 427's WHEEL, METADATA and RECORD. Nothing is downloaded: `pip wheel . --no-index` and
`pip install .` work offline.

The wheel is for the interpreter that runs this backend (pip's), or --python below. Which CMake
build directory is used:
  - config setting ``build-dir`` (``pip wheel . --config-settings build-dir=DIR``) or
    $FLATSHARD_BUILD_DIR: that directory; if it is already configured for another interpreter, an error says so
    (reconfiguring someone's build for another Python would rebuild it behind their back);
  - otherwise ``build/`` of the source tree when it is configured for this interpreter (the
    normal build: Debian's python3), else ``build-python-cpXY/`` beside it (configured here,
    Release; at build/'s depth, so ccache, whose base_dir makes paths relative, reuses
    build/'s objects).
Extra CMake configure arguments: config setting ``cmake-args`` or $FLATSHARD_CMAKE_ARGS
(split on spaces).

The extension links the client library statically (client/python/CMakeLists.txt), so the wheel
carries no libflatshard_client and no $ORIGIN RUNPATH; it needs the system's shared gRPC,
protobuf and abseil (Debian 12: libgrpc++1.51, libprotobuf32, libabsl20220623).

Run as a script (the CMake target flatshard_wheel does) it writes the wheel of an existing,
already built directory:
  python3 flatshard_build.py --build-dir build --out build/dist [--no-build]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
PACKAGE_DIR = SOURCE_DIR / "client" / "python" / "flatshard"

__all__ = ["build_wheel", "build_sdist", "get_requires_for_build_wheel",
           "get_requires_for_build_sdist", "prepare_metadata_for_build_wheel"]


# --- metadata --------------------------------------------------------------------------------


def _project_table() -> dict[str, str]:
    """The string fields of pyproject.toml's [project] table (tomllib where the interpreter
    has it, 3.11+; else the `key = "value"` lines, which is all that table uses)."""
    text = (SOURCE_DIR / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:
        tomllib = None
    if tomllib is not None:
        table = tomllib.loads(text).get("project", {})
        return {k: v for k, v in table.items() if isinstance(v, str)}
    m = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if m is None:
        raise RuntimeError(f"{SOURCE_DIR / 'pyproject.toml'}: no [project] table")
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]*)"\s*$', m.group(1), re.M))


def _version() -> str:
    """The version of project() in the top-level CMakeLists.txt (one version for everything)."""
    cmake = (SOURCE_DIR / "CMakeLists.txt").read_text(encoding="utf-8")
    m = re.search(r"project\(\s*flatshard\s+VERSION\s+([0-9][0-9.]*)", cmake)
    if m is None:
        raise RuntimeError(f"{SOURCE_DIR / 'CMakeLists.txt'}: no project(flatshard VERSION x.y.z)")
    return m.group(1)


def _metadata(version: str) -> str:
    p = _project_table()
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {p['name']}",
        f"Version: {version}",
        f"Summary: {p['description']}",
        f"Requires-Python: {p['requires-python']}",
        # torch is optional: the tensor views and flatshard.torch import it when used.
        "Provides-Extra: torch",
        "Requires-Dist: torch; extra == \"torch\"",
        "Provides-Extra: numpy",
        "Requires-Dist: numpy; extra == \"numpy\"",
    ]
    return "\n".join(lines) + "\n"


def _tag(python: str) -> str:
    """The wheel tag of interpreter `python` (cp311-cp311-linux_x86_64)."""
    code = ("import sys, sysconfig\n"
            "assert sys.implementation.name == 'cpython', sys.implementation.name\n"
            "v = 'cp%d%d' % sys.version_info[:2]\n"
            "plat = sysconfig.get_platform().replace('-', '_').replace('.', '_')\n"
            "print(v + '-' + v + '-' + plat)")
    return subprocess.run([python, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def _ext_suffix(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
        check=True, capture_output=True, text=True).stdout.strip()


# --- the CMake build -------------------------------------------------------------------------


def _cached_python(build_dir: Path) -> str | None:
    """Python_EXECUTABLE of a configured build directory, or None (not configured)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return None
    m = re.search(r"^Python_EXECUTABLE:[A-Z]+=(.*)$", cache.read_text(errors="replace"), re.M)
    return m.group(1).strip() if m else ""


def _base_interpreter(python: str) -> str:
    """The interpreter `python` runs on, symlinks resolved: a venv's python -> the one it was
    made from. CMake is configured with it, so a build outlives the venv that asked for it."""
    base = subprocess.run(
        [python, "-c", "import sys; print(getattr(sys, '_base_executable', '') or sys.executable)"],
        check=True, capture_output=True, text=True).stdout.strip()
    return os.path.realpath(base if os.path.isfile(base) else python)


def _same_python(cached: str, python: str) -> bool:
    """Whether a build configured for `cached` builds the extension for `python` (False when
    `cached` is gone, e.g. a deleted venv's)."""
    if not cached or not os.path.exists(cached):
        return False
    return _base_interpreter(cached) == _base_interpreter(python)


def _choose_build_dir(python: str, settings: dict) -> Path:
    given = settings.get("build-dir") or os.environ.get("FLATSHARD_BUILD_DIR")
    if given:
        build_dir = Path(given).resolve()
        cached = _cached_python(build_dir)
        if cached and os.path.exists(cached) and not _same_python(cached, python):
            raise RuntimeError(
                f"build directory {build_dir} is configured for Python {cached}, not {python}; "
                "name another build-dir (or none: build-python-cpXY is made for it)")
        return build_dir
    default = SOURCE_DIR / "build"
    cached = _cached_python(default)
    if cached and _same_python(cached, python):
        return default
    # A sibling of build/ (same depth): ccache (base_dir) then shares build/'s objects.
    return SOURCE_DIR / f"build-python-{_tag(python).split('-')[0]}"


def _cmake_build(build_dir: Path, python: str, settings: dict) -> None:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("building the flatshard wheel needs cmake on PATH (apt install cmake)")
    cached = _cached_python(build_dir)
    if cached is None or not _same_python(cached, python):  # new, or its interpreter is gone
        args = [cmake, "-S", str(SOURCE_DIR), "-B", str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={_base_interpreter(python)}",
                "-DFLATSHARD_WITH_PYTHON=ON", "-DFS_BUILD_TESTS=OFF",
                "-DFS_BUILD_BENCHMARKS=OFF"]
        if shutil.which("ccache"):
            args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        args += shlex.split(settings.get("cmake-args") or os.environ.get("FLATSHARD_CMAKE_ARGS", ""))
        subprocess.run(args, check=True, stdout=sys.stderr)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(min(os.cpu_count() or 1, 4))
    subprocess.run([cmake, "--build", str(build_dir), "--target", "flatshard_python", "-j", jobs],
                   check=True, stdout=sys.stderr)


# --- the wheel -------------------------------------------------------------------------------


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _package_files(build_dir: Path, python: str) -> list[tuple[str, Path]]:
    """(name in the wheel, file) of the package: the sources' .py/.pyi/py.typed files and the
    build's extension for `python`."""
    files = []
    for path in sorted(PACKAGE_DIR.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and \
                (path.suffix in (".py", ".pyi") or path.name == "py.typed"):
            files.append(("flatshard/" + path.relative_to(PACKAGE_DIR).as_posix(), path))
    ext_name = "_C" + _ext_suffix(python)
    ext = build_dir / "python" / "flatshard" / ext_name
    if not ext.is_file():
        built = sorted(p.name for p in (build_dir / "python" / "flatshard").glob("_C*"))
        raise RuntimeError(f"{ext} not found (built: {built or 'none'}): is {build_dir} "
                           f"configured for {python}?")
    files.append((f"flatshard/{ext_name}", ext))
    return files


def _stripped(path: Path) -> bytes:
    """The extension without debug symbols (`strip` where present; else as built)."""
    strip = shutil.which("strip")
    data = path.read_bytes()
    if strip is None:
        return data
    tmp = Path(str(path) + ".wheel-strip")
    tmp.write_bytes(data)
    try:
        subprocess.run([strip, "--strip-unneeded", str(tmp)], check=True)
        return tmp.read_bytes()
    finally:
        tmp.unlink()


def _dist_info_files(version: str, tag: str) -> list[tuple[str, bytes]]:
    dist_info = f"flatshard-{version}.dist-info"
    return [
        (f"{dist_info}/METADATA", _metadata(version).encode()),
        (f"{dist_info}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: flatshard_build\n"
                                f"Root-Is-Purelib: false\nTag: {tag}\n").encode()),
        (f"{dist_info}/top_level.txt", b"flatshard\n"),
    ]


def write_wheel(build_dir: Path, out_dir: Path, python: str) -> str:
    """Writes the wheel of an already built `build_dir` for `python` into `out_dir`; returns
    its file name."""
    version = _version()
    tag = _tag(python)
    name = f"flatshard-{version}-{tag}.whl"
    dist_info = f"flatshard-{version}.dist-info"
    entries = []
    for arcname, path in _package_files(build_dir, python):
        data = _stripped(path) if path.suffix == ".so" else path.read_bytes()
        entries.append((arcname, data))
    entries += _dist_info_files(version, tag)
    record = [_record_line(a, d) for a, d in entries] + [f"{dist_info}/RECORD,,"]
    entries.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (name + ".part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arcname, data in entries:
            info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arcname.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    tmp.replace(out_dir / name)
    return name


# --- PEP 517 hooks ---------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings=None) -> list[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    """The wheel's .dist-info without building (pip asks first; the build happens once)."""
    version = _version()
    for arcname, data in _dist_info_files(version, _tag(sys.executable)):
        path = Path(metadata_directory) / arcname
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return f"flatshard-{version}.dist-info"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    settings = dict(config_settings or {})
    python = sys.executable
    build_dir = _choose_build_dir(python, settings)
    _cmake_build(build_dir, python, settings)
    return write_wheel(build_dir, Path(wheel_directory), python)


def build_sdist(sdist_directory, config_settings=None) -> str:
    """The files git tracks (the whole project: the extension needs the C++ client), plus
    PKG-INFO."""
    version = _version()
    base = f"flatshard-{version}"
    listed = subprocess.run(["git", "-C", str(SOURCE_DIR), "ls-files", "-z"], check=True,
                            capture_output=True).stdout.split(b"\0")
    name = f"{base}.tar.gz"
    Path(sdist_directory).mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(sdist_directory) / name, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        for rel in sorted(r.decode() for r in listed if r):
            path = SOURCE_DIR / rel
            if path.is_file() and not path.is_symlink():
                tf.add(path, arcname=f"{base}/{rel}", recursive=False)
        pkg_info = _metadata(version).encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tf.addfile(info, io.BytesIO(pkg_info))
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="directory the wheel is written to")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter the build's extension is for (default: this one)")
    ap.add_argument("--no-build", action="store_true",
                    help="package what is built (the CMake target flatshard_wheel's case)")
    a = ap.parse_args(argv)
    if not a.no_build:
        _cmake_build(a.build_dir.resolve(), a.python, {})
    print(a.out / write_wheel(a.build_dir.resolve(), a.out, a.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
