"""flatshard.weights: read the weights a training group published (issue 25), zero-copy.

A trainer's ``client.publish(module, name)`` (or ``model.publish(name)`` in flatshard.torch)
makes its committed step version V of ``name``: the full parameters in the unwrapped module's
``state_dict()`` layout. Any process on the node that the publisher granted (its uid in
``reader_uids``, or the ``reader_token``), not a member of the group, reads it here:

    import flatshard.weights
    with flatshard.weights.open("policy") as w:          # "latest", or a version number
        model.load_state_dict(w)                          # or engine.load_weights(w.items())
        print(w.version, w.generation, w.bytes)
    for info in flatshard.weights.watch("policy", after=w.version, timeout=60):
        ...                                               # each newer version as it appears

``open`` returns a read-only Mapping FQN -> tensor over the daemon's shared memory (no copy;
tied parameters under every key). The version stays valid while it is open: the reader
holds a lease on it, which ``close()`` (or leaving the ``with`` block) ends, and which a
crashed reader's daemon connection ends too. torch 1.13 has no read-only tensors: the
tensors are ``flatshard.ReadOnlyTensor``, which refuses torch's writes, over memory mapped
read-only. Without torch, ``memoryviews()`` (and ``numpy()``) read the same bytes.

The daemon is ``address`` (as ``flatshard.Client`` takes it), else ``$FLATSHARD_ADDRESS``,
else ``unix:/run/flatshard/flatshardd.sock`` (flatshardd's default ``--socket``). Names are
scoped by the publisher's uid: ``owner`` (a uid) reads another uid's name (an inference
process under its own uid passes the trainer's); None: the caller's own uid. Errors
are flatshard's (NotFoundError naming the name or version, PermissionDeniedError for a
wrong token or uid, ...).
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

from . import _C
from ._optional import tensors
from .errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["open", "watch", "list", "Reader", "Weights", "PublishedVersion", "default_address",
           "DEFAULT_ADDRESS"]

DEFAULT_ADDRESS = "unix:/run/flatshard/flatshardd.sock"
_OWN_UID = -2  # OpenWeightsOptions::owner_uid: the caller's own uid


def default_address() -> str:
    """``$FLATSHARD_ADDRESS``, else flatshardd's default socket."""
    return os.environ.get("FLATSHARD_ADDRESS") or DEFAULT_ADDRESS


@dataclass(frozen=True)
class PublishedVersion:
    """One published version: ``name`` of publisher uid ``owner_uid``, version number
    ``version`` (1, 2, ... per name), the trainer's committed ``generation`` it holds, its
    size in ``bytes`` and its number of ``tensors`` (state-dict keys)."""

    name: str
    owner_uid: int
    version: int
    generation: int
    bytes: int
    tensors: int
    device: int = -1  # the daemon's GPU holding it (publish(device=...)); -1: host memory

    @classmethod
    def _of(cls, v: Any) -> PublishedVersion:
        return cls(v.name, int(v.owner_uid), int(v.version), int(v.generation), int(v.bytes),
                   int(v.tensors), int(v.device))


def _version_arg(version: Union[str, int, None]) -> Optional[int]:
    if version is None or version == "latest":
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidArgumentError(
            f"weights: version must be \"latest\" or a version number >= 1, got {version!r}")
    return int(version)


def _owner_arg(owner: Optional[int]) -> int:
    if owner is None:
        return _OWN_UID
    if isinstance(owner, bool) or not isinstance(owner, int) or owner < 0:
        raise InvalidArgumentError(f"weights: owner must be a uid (int >= 0) or None, got {owner!r}")
    return int(owner)


class Weights(Mapping):
    """An open published version: a read-only Mapping FQN -> zero-copy tensor, in the
    daemon's order (units, each unit's parameters in flat order, then tied aliases). ``items()`` is the ``(name, tensor)`` iterator
    an engine's ``load_weights`` takes; ``model.load_state_dict(w)`` copies it into a model.
    Holds the version (a lease) until ``close()``, the end of a ``with`` block, or garbage
    collection (a SIGTERM of the daemon ends the lease's stream at once; the tensors stay
    mapped). Tensors handed out stay mapped after ``close()`` (no crash), but the daemon
    may then free the version or copy a newer version of the name into its memory: copy what
    must outlive it (load_state_dict does). A version in the daemon's GPU memory
    (``info.device >= 0``) gives CUDA tensors on this process's ordinal of that GPU (CUDA IPC;
    never write them: device memory cannot be mapped read-only)."""

    def __init__(self, v: Any, simulated_gpus: bool = False) -> None:
        self._v = v
        self._simulated = simulated_gpus
        self._info = PublishedVersion._of(v.info)
        self._desc = builtins.list(v.describe())  # (name, dtype name, shape, device)
        self._index = {d[0]: i for i, d in enumerate(self._desc)}
        self._lock = threading.Lock()
        self._tensors: Optional[dict[str, torch.Tensor]] = None

    # --- the version ---------------------------------------------------------------------
    @property
    def info(self) -> PublishedVersion:
        return self._info

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def version(self) -> int:
        return self._info.version

    @property
    def generation(self) -> int:
        """The trainer's committed generation this version holds."""
        return self._info.generation

    @property
    def bytes(self) -> int:
        return self._info.bytes

    @property
    def closed(self) -> bool:
        return bool(self._v.released)

    def close(self) -> None:
        """Ends this reader's lease on the version (idempotent)."""
        with self._lock:
            self._tensors = None
        self._v.release()

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the tensors ---------------------------------------------------------------------
    def _all(self) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._tensors is None:
                if self._v.released:
                    raise FailedPreconditionError(
                        f"weights {self.name!r} version {self.version}: closed")
                t = tensors("flatshard.weights")
                if self._info.device >= 0 and not self._simulated:
                    import torch
                    if not torch.cuda.is_available():
                        raise FailedPreconditionError(
                            f"weights {self.name!r} version {self.version} is in GPU memory "
                            f"(the daemon's GPU {self._info.device}) and this torch has no "
                            "CUDA: open it from a process with CUDA, or publish it to host "
                            "memory (device=None)")
                caps = self._v.dlpack()
                self._tensors = {d[0]: t.from_capsule(c, d[1], writable=False)
                                 for d, c in zip(self._desc, caps)}
            return self._tensors

    def __getitem__(self, fqn: str) -> torch.Tensor:
        if fqn not in self._index:
            raise KeyError(fqn)
        return self._all()[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(d[0] for d in self._desc)

    def __len__(self) -> int:
        return len(self._desc)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._index

    def dtype_name(self, fqn: str) -> str:
        """The flatshard dtype name of ``fqn`` ("float32", "bfloat16", ...); no torch needed."""
        return self._desc[self._index[fqn]][1]

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._desc[self._index[fqn]][2])

    @property
    def device(self) -> int:
        """The daemon's GPU holding this version (-1: host shared memory)."""
        return self._info.device

    def _host_only(self, what: str) -> None:
        if self._info.device >= 0 and not self._simulated:
            raise FailedPreconditionError(
                f"weights {self.name!r} version {self.version}: {what}() reads host memory and "
                f"this version is in GPU memory (the daemon's GPU {self._info.device}): use "
                "the tensors (w[name], CUDA)")

    def memoryviews(self) -> dict[str, memoryview]:
        """FQN -> read-only memoryview over the same bytes (format of the dtype, bfloat16 as
        "H"; host memory); needs neither torch nor numpy."""
        self._host_only("memoryviews")
        return dict(zip((d[0] for d in self._desc), self._v.memoryviews()))

    def numpy(self) -> dict[str, np.ndarray]:
        """FQN -> read-only numpy array over the same bytes (bfloat16 as uint16)."""
        self._host_only("numpy")
        return dict(zip((d[0] for d in self._desc), self._v.numpy()))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"flatshard.weights.Weights({self.name!r}, version={self.version}, "
                f"generation={self.generation}, tensors={len(self)}, bytes={self.bytes}, "
                f"{state})")


class Reader:
    """A connection to a daemon for reading published weights, for several calls (the
    module's functions connect per call). ``address`` and timeouts as ``flatshard.Client``'s;
    ``close()`` (or a ``with`` block) drops the connection, versions it opened stay open."""

    def __init__(self, address: Optional[str] = None, call_timeout: float = 30.0,
                 max_attempts: int = 5, *, tls_ca_file: str = "", tls_cert_file: str = "",
                 tls_key_file: str = "", _simulated_gpus: bool = False) -> None:
        self.address = default_address() if address is None else address
        if not isinstance(self.address, str):
            raise InvalidArgumentError(
                f"weights: address must be a str, got {type(self.address).__name__}")
        # _simulated_gpus (tests only): open device versions of a `flatshardd --simulate_gpus`
        # daemon (host shared memory) and present them as CPU tensors.
        self._simulated = bool(_simulated_gpus)
        self._r = _C.WeightsReader(self.address, float(call_timeout), int(max_attempts),
                                   tls_ca_file, tls_cert_file, tls_key_file, self._simulated)

    def open(self, name: str, version: Union[str, int] = "latest", *,
             owner: Optional[int] = None, token: Optional[str] = None) -> Weights:
        """Version ``version`` ("latest" or a number) of ``name``, held until closed."""
        return Weights(self._r.open(name, _version_arg(version), _owner_arg(owner), token or ""),
                       self._simulated)

    def wait_for_version(self, name: str, after: int = 0, timeout: float = 60.0, *,
                         owner: Optional[int] = None,
                         token: Optional[str] = None) -> PublishedVersion:
        """The first version of ``name`` newer than ``after``, as soon as it appears
        (DeadlineExceededError after ``timeout`` seconds; UnavailableError at once when the
        daemon stops: SIGTERM ends the wait, wait again once it is back)."""
        return PublishedVersion._of(
            self._r.wait_for_version(name, int(after), float(timeout), _owner_arg(owner),
                                     token or ""))

    def watch(self, name: str, after: int = 0, timeout: Optional[float] = None, *,
              owner: Optional[int] = None,
              token: Optional[str] = None) -> Iterator[PublishedVersion]:
        """Yields each version of ``name`` newer than ``after`` as it appears. Ends (returns)
        when none appeared for ``timeout`` seconds; None waits forever. A version published
        and dropped between two waits is skipped: each yield is the newest one. Raises
        UnavailableError when the daemon stops (SIGTERM), as wait_for_version."""
        last = int(after)
        while True:
            try:
                info = self.wait_for_version(name, last, 3600.0 if timeout is None else timeout,
                                             owner=owner, token=token)
            except DeadlineExceededError:
                if timeout is None:
                    continue
                return
            last = info.version
            yield info

    def list(self) -> builtins.list[PublishedVersion]:
        """Every version this caller may read, on this daemon."""
        return [PublishedVersion._of(v) for v in self._r.list()]

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"flatshard.weights.Reader({self.address!r})"


def open(name: str, version: Union[str, int] = "latest", *, owner: Optional[int] = None,
         token: Optional[str] = None, address: Optional[str] = None) -> Weights:
    """Opens version ``version`` ("latest" or a number) of the published weights ``name``:
    a read-only Mapping FQN -> zero-copy tensor (see the module docstring). Connects for
    this call (the version holds its own lease); a ``Reader`` keeps one connection."""
    with Reader(address) as r:
        return r.open(name, version, owner=owner, token=token)


def watch(name: str, after: int = 0, timeout: Optional[float] = None, *,
          owner: Optional[int] = None, token: Optional[str] = None,
          address: Optional[str] = None) -> Iterator[PublishedVersion]:
    """Yields the info of each version of ``name`` newer than ``after`` as it appears (the
    newest one at each wake-up); returns when none appeared for ``timeout`` seconds. The
    generator holds its own connection until it is closed or garbage-collected."""
    with Reader(address) as r:
        yield from r.watch(name, after, timeout, owner=owner, token=token)


def list(address: Optional[str] = None) -> builtins.list[PublishedVersion]:  # noqa: A001
    """Every published version this caller may read on the daemon."""
    with Reader(address) as r:
        return r.list()
