"""Make PyTorch 1.13's FSDP constructible on a CPU-only machine (semantics.md §5).

Import this module *before* anything imports ``torch.distributed.fsdp``.

(a) On Python 3.11 ``dataclasses`` refuses a field whose default value's class is
    unhashable.  ``torch.distributed._shard.sharded_tensor.metadata`` declares
    ``tensor_properties: TensorProperties = TensorProperties()`` where
    ``TensorProperties`` is itself a (non-frozen, hence unhashable) dataclass.
    We wrap ``dataclasses._get_field`` so that such a default's class is given
    ``object.__hash__`` before the check runs.
(b) FSDP 1.13 asks CUDA for its compute device
    (``FullyShardedDataParallel._get_compute_device``); we return CPU.
"""
import dataclasses
import os
import socket
import subprocess

_orig_get_field = dataclasses._get_field


def _patched_get_field(cls, a_name, a_type, *rest):
    default = cls.__dict__.get(a_name, dataclasses.MISSING)
    if isinstance(default, dataclasses.Field):
        default = default.default
    if (
        default is not dataclasses.MISSING
        and dataclasses.is_dataclass(type(default))
        and type(default).__hash__ is None
    ):
        type(default).__hash__ = object.__hash__
    return _orig_get_field(cls, a_name, a_type, *rest)


dataclasses._get_field = _patched_get_field

# Silence c10 "Deallocating Tensor that still has live PyObject references"
# warnings that FSDP 1.13's flattening triggers; they say nothing about plans.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402


def _cpu_compute_device(self, module, ignored_params, device_from_device_id):
    return torch.device("cpu")


FSDP._get_compute_device = _cpu_compute_device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def torch_version() -> str:
    """Upstream version of the installed torch.

    Debian's python3-torch 1.13.1+dfsg reports ``torch.__version__ == "1.13.0a0"``;
    prefer the package's upstream version when dpkg knows it.
    """
    v = torch.__version__
    if torch.__file__.startswith("/usr/lib/python3/dist-packages/"):
        try:
            out = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", "python3-torch"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()
            if out:
                v = out.split("+")[0].split("-")[0]
        except (OSError, subprocess.CalledProcessError):
            pass
    return v
