"""flatshard.Client and the objects it hands out (see the package docstring).

torch is imported on first use of a tensor view (flatshard._optional): without it the Client,
its summons and shards work, with memoryview (and numpy) views.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import threading
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Literal, Optional,
                    Sequence, Union)

from . import _C
from ._optional import tensors
from .errors import FlatshardError, InvalidArgumentError, NotFoundError, _from_status

if TYPE_CHECKING:
    import numpy
    import torch

JsonLike = Union[str, dict, list]
# A checkpoint call's progress callback: progress(bytes_done, bytes_total).
ProgressCallback = Optional[Callable[[int, int], object]]

__all__ = ["Client", "Registered", "Summoned", "PendingReduceScatter", "ShardViews",
           "UnitShard"]

_NO_AUTO_WRAP = '{"format": "flatshard.policy/1"}'


def _from_capsule(feature: str, capsule: Any, dtype: str, writable: bool = True) -> torch.Tensor:
    return tensors(feature).from_capsule(capsule, dtype, writable)


class UnitShard:
    """One unit's shard on this rank (the optimizer's view). ``shard`` and ``grad`` are
    writable zero-copy 1-D tensors of ``shard_numel`` elements (``grad`` is None until the
    unit has a gradient); ``device`` is the CUDA ordinal, -1 for host memory.
    ``state(name)``: the unit's optimizer state buffer ``name`` (``Client.register_state``)
    as a writable zero-copy 1-D tensor (``shard_numel`` elements for "shard" states, one
    for "scalar" ones); ``states``: name -> tensor of every state (empty when none)."""

    __slots__ = ("_s", "_shard", "_grad", "_states", "_lock")

    def __init__(self, s: _C.UnitShard) -> None:
        self._s = s
        self._shard: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._states: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def state_names(self) -> list[str]:
        return list(self._s.state_names)

    def state(self, name: str) -> torch.Tensor:
        """The optimizer state buffer ``name`` of this unit (NotFoundError if none)."""
        with self._lock:
            t = self._states.get(name)
            if t is None:
                t = _from_capsule("UnitShard.state", self._s.state_dlpack(name),
                                  self._s.state_dtype_name(name))
                self._states[name] = t
            return t

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return {name: self.state(name) for name in self.state_names}

    def numpy_state(self, name: str) -> numpy.ndarray:
        """The state buffer ``name`` as a writable numpy array (host memory)."""
        return self._s.state_numpy(name)

    @property
    def unit(self) -> int:
        return self._s.unit

    @property
    def shard_numel(self) -> int:
        return self._s.shard_numel

    @property
    def shard_offset(self) -> int:
        return self._s.shard_offset

    @property
    def device(self) -> int:
        return self._s.device

    @property
    def dtype_name(self) -> str:
        """The flatshard dtype name ("float32", "bfloat16", ...); no torch needed."""
        return self._s.dtype_name

    @property
    def dtype(self) -> torch.dtype:
        return tensors("UnitShard.dtype").torch_dtype(self._s.dtype_name)

    @property
    def shard(self) -> torch.Tensor:
        with self._lock:
            if self._shard is None:
                self._shard = _from_capsule("UnitShard.shard", self._s.shard_dlpack(),
                                            self._s.dtype_name)
            return self._shard

    @property
    def grad(self) -> torch.Tensor | None:
        with self._lock:
            if self._grad is None and self._s.has_grad:
                self._grad = _from_capsule("UnitShard.grad", self._s.grad_dlpack(),
                                           self._s.dtype_name)
            return self._grad

    @property
    def memoryview_shard(self) -> memoryview:
        """The shard as a writable 1-D memoryview (host memory; format of the dtype,
        bfloat16 as "H"); needs neither torch nor numpy."""
        return self._s.shard_memoryview()

    @property
    def numpy_shard(self) -> numpy.ndarray:
        """The shard as a writable numpy array (host memory; bfloat16 as uint16)."""
        return self._s.shard_numpy()

    @property
    def numpy_grad(self) -> numpy.ndarray | None:
        return self._s.grad_numpy()

    @property
    def memoryview_grad(self) -> memoryview | None:
        """The gradient shard as a writable 1-D memoryview, as ``memoryview_shard`` (None
        when the module keeps no gradients)."""
        return self._s.grad_memoryview()

    def __repr__(self) -> str:
        return (f"UnitShard(unit={self.unit}, dtype={self._s.dtype_name}, "
                f"shard_numel={self.shard_numel}, shard_offset={self.shard_offset}, "
                f"device={self.device}, grad={'yes' if self._s.has_grad else 'no'}"
                f"{', states=' + ','.join(self.state_names) if self.state_names else ''})")


def _raw_summoned(s: Summoned | Iterable[Summoned] | None) -> list[_C.Summoned]:
    """The binding's summons behind `s` (a Summoned, an iterable of them, or None) for
    end_first; their cached tensors are dropped, as end() drops them."""
    if s is None:
        return []
    summons = [s] if isinstance(s, Summoned) else list(s)
    for x in summons:
        if not isinstance(x, Summoned):
            raise InvalidArgumentError(
                f"end_first must be a Summoned, a list of them or None, got {type(x).__name__}")
    out = []
    for x in summons:
        with x._lock:
            x._params = x._grads = x._numpy = None
        out.append(x._s)
    return out


class Summoned:
    """A summon in progress: the full parameters of the summoned units (and their gradients
    under with_grads) as zero-copy tensors. Ends once: ``end()``, leaving a ``with`` block
    (also on an exception), or when garbage-collected. Read-only summons
    (``writeback=False``) hand out tensors and arrays whose writes raise."""

    def __init__(self, s: _C.Summoned, plan: dict | None = None) -> None:
        self._s = s
        self._plan = plan
        self._lock = threading.Lock()
        self._params: dict[str, torch.Tensor] | None = None
        self._grads: dict[str, torch.Tensor] | None = None
        self._numpy: dict[str, numpy.ndarray] | None = None

    # --- views -----------------------------------------------------------------------------

    def _tensors(self, grads: bool) -> dict[str, torch.Tensor]:
        feature = "Summoned.grads" if grads else "Summoned.params"
        out = {}
        for (fqn, _unit, dtype, _shape, _dev, writable), cap in zip(
                self._s.describe(grads), self._s.dlpack(grads)):
            if fqn not in out:  # tied FQNs are separate views of the same memory anyway
                out[fqn] = _from_capsule(feature, cap, dtype, writable)
        return out

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """FQN -> zero-copy tensor (shape and dtype of the parameter); tied FQNs alias the
        same memory. Empty on ranks without views and after end()."""
        with self._lock:
            if self._s.ended:
                return {}
            if self._params is None:
                self._params = self._tensors(False)
            return self._params

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        """FQN -> gradient tensor (with_grads; only units that have a gradient)."""
        with self._lock:
            if self._s.ended:
                return {}
            if self._grads is None:
                self._grads = self._tensors(True)
            return self._grads

    @property
    def numpy_params(self) -> dict[str, numpy.ndarray]:
        """FQN -> numpy array over the same memory (read-only for writeback=False;
        bfloat16 parameters as uint16)."""
        with self._lock:
            if self._s.ended:
                return {}
            if self._numpy is None:
                self._numpy = {d[0]: a for d, a in zip(self._s.describe(False), self._s.numpy(False))}
            return self._numpy

    @property
    def memoryview_params(self) -> dict[str, memoryview]:
        """FQN -> memoryview over the same memory, shaped as the parameter (format of its
        dtype, bfloat16 as "H"; read-only for writeback=False); needs neither torch nor numpy.
        Fresh views on every read; empty after end()."""
        if self._s.ended:
            return {}
        out: dict[str, memoryview] = {}
        for d, m in zip(self._s.describe(False), self._s.memoryviews(False)):
            out.setdefault(d[0], m)
        return out

    def flat(self, unit: int) -> torch.Tensor:
        """1-D tensor over unit `unit`'s whole padded flat buffer."""
        cap, dtype, _device, writable = self._s.flat(int(unit), False)
        return _from_capsule("Summoned.flat", cap, dtype, writable)

    def flat_grad(self, unit: int) -> torch.Tensor:
        """1-D tensor over unit `unit`'s whole padded flat gradient (with_grads)."""
        cap, dtype, _device, writable = self._s.flat(int(unit), True)
        return _from_capsule("Summoned.flat_grad", cap, dtype, writable)

    @property
    def units(self) -> list[int]:
        return list(self._s.units)

    @property
    def note(self) -> str:
        return self._s.note

    @property
    def has_views(self) -> bool:
        return self._s.has_views

    @property
    def id(self) -> int:
        return self._s.id

    @property
    def module(self) -> str:
        return self._s.module

    @property
    def ended(self) -> bool:
        return self._s.ended

    def end(self) -> None:
        """Ends the summon (collective: every rank ends it): writes back if asked, reshards.
        Idempotent: a second call re-raises the first call's error, or returns. Tensors
        handed out stay mapped (no crash), but their bytes are the daemon's again: what they
        read is unspecified, writes are lost, and once a later summon of the same unit (or
        of a unit of the same size) reuses the buffer (the daemon keeps unsharded segments
        across summons) they alias that summon's views. ``.clone()`` what must outlive the summon."""
        try:
            self._s.end()
        finally:
            with self._lock:
                self._params = self._grads = self._numpy = None

    @property
    def generation(self) -> int | None:
        """After ``end()`` succeeded: the committed generation this rank's shards hold (a
        writeback end commits: the new one); None before, or after a failed end."""
        return self._s.generation

    def __enter__(self) -> Summoned:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None:
            self.end()
        else:
            try:
                self.end()
            except Exception as e:  # the body's exception wins; End's error rides along
                if exc is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"while handling it, ending summon {self.id} failed: {e!r}")
        return False

    def __repr__(self) -> str:
        return (f"Summoned(id={self.id}, module={self.module!r}, units={self.units}, "
                f"has_views={self.has_views}, ended={self.ended})")


class PendingSummon:
    """A summon started by ``Client.summon_async``: its all-gather runs while this process
    computes. ``wait()`` returns the ``Summoned`` (or raises the summon's error, as
    ``summon`` would); ``ready`` is true once ``wait()`` would not block. Dropped without
    ``wait()``, the summon is ended."""

    def __init__(self, p: _C.PendingSummon, plan: dict | None = None) -> None:
        self._p = p
        self._plan = plan

    @property
    def ready(self) -> bool:
        return self._p.ready

    def wait(self) -> Summoned:
        return Summoned(self._p.wait(), self._plan)

    def __repr__(self) -> str:
        return f"PendingSummon(ready={self.ready})"


class PendingReduceScatter:
    """Phase one of a gradient reduce-scatter: write the unit's full gradient into ``flat``
    (or the per-parameter ``grads``), then ``finish()`` (collective), or ``finish_async()``:
    phase two runs while this process goes on, and the returned ``FinishingReduceScatter``'s
    ``wait()`` gives its result (the gradient shard is updated once it returned)."""

    def __init__(self, p: _C.PendingReduceScatter, client: _C.Client | None = None) -> None:
        self._p = p
        self._client = client
        self._flat: torch.Tensor | None = None
        self._grads: dict[str, torch.Tensor] | None = None

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            cap, dtype, _dev = self._p.flat()
            self._flat = _from_capsule("PendingReduceScatter.flat", cap, dtype)
        return self._flat

    @property
    def memoryview_flat(self) -> memoryview:
        """``flat`` as a writable 1-D memoryview (host memory; format of the dtype, bfloat16
        as "H"): the unit's full padded gradient, written without torch or numpy."""
        return self._p.flat_memoryview()

    @property
    def unit(self) -> int:
        return self._p.unit

    @property
    def numel(self) -> int:
        return self._p.numel

    @property
    def finished(self) -> bool:
        return self._p.finished

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        if self._grads is None:
            out: dict[str, torch.Tensor] = {}
            for (fqn, _u, dtype, _s, _d, _w), cap in zip(self._p.describe(), self._p.dlpack()):
                out.setdefault(fqn, _from_capsule("PendingReduceScatter.grads", cap, dtype))
            self._grads = out
        return self._grads

    def finish(self) -> None:
        """Reduce-scatters what was written (collective). A second call re-raises or returns."""
        self._p.finish()

    def finish_async(self) -> _C.FinishingReduceScatter:
        """Starts ``finish()`` and returns a ``FinishingReduceScatter`` at once. Ordered with
        the client's other group calls as ``Client.summon_async`` (a later
        ``begin_reduce_scatter`` waits for it only if it is of the same unit)."""
        if self._client is None:
            raise InvalidArgumentError("finish_async: this PendingReduceScatter has no client")
        return self._client.finish_async(self._p)

    def __enter__(self) -> PendingReduceScatter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None:
            self.finish()
        return False


class ShardViews(list):
    """``Client.shard_views``' answer: a list of this rank's UnitShards, sorted by unit, and
    ``generation``, the committed generation the shards held when the daemon answered (0:
    the initial values; see ``Client.commit``), and ``state_specs``: the module's optimizer
    state spec as [(name, dtype name, "shard" | "scalar")], empty when none."""

    def __init__(self, shards: Iterable[UnitShard], generation: int,
                 state_specs: Iterable[Sequence[str]] = ()) -> None:
        super().__init__(shards)
        self.generation = int(generation)
        self.state_specs = [tuple(s) for s in state_specs]

    def __repr__(self) -> str:
        return f"ShardViews(generation={self.generation}, {list.__repr__(self)})"


class Registered:
    """A registered module: its plan (dict, spec/formats.md), this rank's shards, the init
    summon of from_every_rank / from_rank0 registrations, and ``generation``: the committed
    generation the shards hold (0: the initial values; a re-attaching trainer resumes from
    this step, see ``Client.commit``)."""

    def __init__(self, r: _C.Registered) -> None:
        self._r = r
        self.module: str = r.module
        self.generation = int(r.generation)
        self.plan: dict[str, Any] = json.loads(r.plan_json)
        self.shards = [UnitShard(s) for s in r.shards]
        self.state_specs = [tuple(s) for s in r.state_specs]  # see Client.register_state
        self.init_summon: Summoned | None = (
            None if r.init_summon is None else Summoned(r.init_summon, self.plan))

    def __repr__(self) -> str:
        return (f"Registered(module={self.module!r}, units={len(self.plan.get('units', []))}, "
                f"generation={self.generation})")


class Client:
    """A connection to the node's flatshardd (the C++ flatshard::client::Client).

    ``flatshard.Client("unix:/run/flatshard/flatshardd.sock")`` connects (raising
    UnavailableError when the daemon cannot be reached within call_timeout); a path with a '/'
    ("/run/flatshard/flatshardd.sock", "./d.sock") means "unix:<path>", "host:port" a TCP
    daemon, and anything else raises InvalidArgumentError at once. Timeouts are in
    seconds. Thread-safe: every blocking call releases the GIL, so several Clients (ranks) in
    threads of one process work. ``cuda_stream`` (a torch.cuda.Stream or its
    ``.cuda_stream`` int; None: the default stream) is the stream device views are ordered on:
    the trainer's work on device views must run on it (see client.h "GPU memory").
    TLS files for TCP addresses as in ClientOptions. ``_simulated_gpus`` (tests only): open
    the device memory of a ``flatshardd --simulate_gpus`` daemon and present it as CPU
    tensors."""

    def __init__(self, address: str, call_timeout: float = 30.0, join_timeout: float = 60.0,
                 max_attempts: int = 5, *, initial_backoff: float = 0.05,
                 max_backoff: float = 1.0, tls_ca_file: str = "", tls_cert_file: str = "",
                 tls_key_file: str = "", cuda_stream: Any = None,
                 _simulated_gpus: bool = False) -> None:
        if not isinstance(address, str):
            raise InvalidArgumentError(f"Client: address must be a str, got {type(address).__name__}")
        self._plans: dict[str, dict[str, Any]] = {}
        self._rank: int | None = None
        self._cuda_stream = int(getattr(cuda_stream, "cuda_stream", cuda_stream) or 0)
        self._c = _C.Client(address, float(call_timeout), float(join_timeout), int(max_attempts),
                            float(initial_backoff), float(max_backoff), tls_ca_file,
                            tls_cert_file, tls_key_file, self._cuda_stream,
                            bool(_simulated_gpus))

    def _on_cuda_stream(self, tensor: torch.Tensor) -> ContextManager[Any]:
        """A context in which torch work on `tensor` runs on this client's cuda_stream (a
        no-op for CPU tensors): copies the package makes into device views are then ordered
        like the trainer's own work, before the event the next call sends to the daemon."""
        if not tensor.is_cuda:
            return contextlib.nullcontext()
        import torch  # a CUDA tensor: torch is imported already
        if self._cuda_stream == 0:
            return torch.cuda.stream(torch.cuda.default_stream(tensor.device))
        return torch.cuda.stream(torch.cuda.ExternalStream(self._cuda_stream, device=tensor.device))

    # --- session -----------------------------------------------------------------------------

    def join(self, group: str, world_size: int, rank: int, token: str = "",
             coordinator: str = "") -> None:
        """Joins rank `rank` of `group`; waits (join_timeout) until every rank joined."""
        self._c.join(group, int(world_size), int(rank), token, coordinator)
        self._rank = int(rank)

    def save_checkpoint(self, module: str, directory: str | os.PathLike,
                        progress: ProgressCallback = None) -> dict[str, Any]:
        """Asks this client's daemon to write the committed step of `module` (every rank at
        one generation) to `directory` (made absolute here; a path on the daemon's host):
        flatshard.checkpoint/1, one file per rank and metadata.json, written last. Not
        collective: one rank asks; the others may keep training (a commit that lands while the
        files are written waits for them). Returns a dict (generation, bytes, files, ranks,
        path).

        `progress`: None, or a callable ``progress(bytes_done, bytes_total)`` called on this
        thread each time the daemon reports (when it starts, about every 200 ms and at each
        phase change while it runs, and last with ``bytes_done == bytes_total``). The daemon
        does not cut a checkpoint short: if `progress` raises, it is not called again, the
        operation runs to its end, and then its exception is raised, carrying the finished
        operation's dict as ``flatshard_checkpoint`` (and a note saying so); a failed
        operation raises its own error instead."""
        return self._checkpoint("save", module, directory, progress)

    def load_checkpoint(self, module: str, directory: str | os.PathLike,
                        progress: ProgressCallback = None) -> dict[str, Any]:
        """Loads a checkpoint directory into `module` (any world size or wrap policy: resharded
        by parameter FQN and element range). Everything is checked before any shard changes
        (metadata, checksums, FQNs, shapes, dtypes); then every rank's shards and committed
        copies are written and the module's generation becomes the checkpoint's. Not
        collective: one rank asks, with no summon of the module open; every rank must then
        read its views again (``shard_views``/``register``) before it commits. Returns a dict
        as ``save_checkpoint``; `progress` as there (under another plan the bytes verified,
        then the bytes loaded; under the saved plan the bytes read, each file once, verified as
        they are read)."""
        return self._checkpoint("load", module, directory, progress)

    def import_safetensors(self, module: str, path: str | os.PathLike,
                           progress: ProgressCallback = None) -> dict[str, Any]:
        """As ``load_checkpoint`` from a safetensors file of the full model (keys: the unwrapped
        module's state_dict FQNs; extra keys such as buffers are skipped and counted in
        ``unused_tensors``); the module's generation goes up by one."""
        return self._checkpoint("import", module, path, progress)

    def _checkpoint(self, kind: str, module: str, path: str | os.PathLike,
                    progress: ProgressCallback) -> dict[str, Any]:
        if progress is not None and not callable(progress):
            raise TypeError(f"{kind} checkpoint: progress must be callable or None, "
                            f"not {type(progress).__name__}")
        info = dict(self._c.checkpoint(kind, module, os.path.abspath(path), progress))
        error = info.pop("progress_error")
        if error is not None:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"flatshard: the progress callback of the checkpoint {kind} of "
                               f"{path!r} raised; the daemon finished the {kind} anyway "
                               f"(generation {info['generation']})")
            error.flatshard_checkpoint = info
            raise error
        return info

    def leave(self) -> None:
        """Leaves the group (shards stay; the rank can join again)."""
        self._c.leave()

    def close(self) -> None:
        """Destroys the C++ Client: the lease ends (the daemon ends this session's summons
        without writeback); waits until the daemon confirms the session ended (at most
        min(call_timeout, 5 s)), so a new Client may join the same rank at once. Idempotent.
        Views handed out stay mapped."""
        self._c.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        self.close()
        return False

    @property
    def registered_modules(self) -> list[str]:
        return list(self._c.registered_modules)

    @property
    def joined(self) -> bool:
        return self._c.joined

    @property
    def rank(self) -> int | None:
        """The rank of the last successful join (None before one)."""
        return self._rank

    @property
    def closed(self) -> bool:
        return self._c.closed

    @property
    def segment_map_calls(self) -> int:
        return self._c.segment_map_calls

    @property
    def ipc_open_calls(self) -> int:
        return self._c.ipc_open_calls

    @property
    def address(self) -> str:
        return self._c.address

    @property
    def lease_status(self) -> FlatshardError | None:
        """None while the lease is open (or before join); else the exception saying why it
        ended (not raised)."""
        s = self._c.lease_status
        return None if s is None else _from_status(*s)

    # --- modules -----------------------------------------------------------------------------

    def register(self, module: str, manifest_json: JsonLike, policy_json: JsonLike = "",
                 init: str = "zeros") -> Registered:
        """Collective: registers a model at `module` ("" = whole model). `init`: "zeros",
        "from_every_rank" or "from_rank0" (then fill ``init_summon``'s views and end it on
        every rank)."""
        if isinstance(manifest_json, (dict, list)):
            manifest_json = json.dumps(manifest_json)
        if isinstance(policy_json, (dict, list)):
            policy_json = json.dumps(policy_json)
        if not policy_json:  # no auto-wrap: the root is the one unit
            policy_json = _NO_AUTO_WRAP
        reg = Registered(self._c.register(module, manifest_json, policy_json, init))
        self._plans[module] = reg.plan
        return reg

    def summon(self, module: str, path: str = "", recurse: bool = True, writeback: bool = True,
               rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False,
               end_first: Summoned | Iterable[Summoned] | None = None,
               compute_precision: bool = False) -> Summoned:
        """Collective: unshards the units at `path` of registered `module` (FSDP's
        summon_full_params). Returns a Summoned, also a context manager.

        ``end_first``: a ``Summoned`` (or a list of them) to end in the same round trip (one
        RPC per unit transition: reshard the unit that ran, unshard the next). They are ended
        whatever the outcome (their tensors are the daemon's again at once); a writeback one
        is ended by its own collective ``end()`` first, whose error then raises here.

        ``compute_precision``: a summon for forward/backward (read-only, not rank0_only):
        units the plan gives a ``compute_dtype`` (policy ``mixed_precision.param_dtype``)
        come in that dtype, cast by the daemon before the all-gather; the others, and every
        other summon, in full precision."""
        s = self._c.summon(module, path, bool(recurse), bool(writeback), bool(rank0_only),
                           bool(offload_to_cpu), bool(with_grads), _raw_summoned(end_first),
                           bool(compute_precision))
        return Summoned(s, self._plans.get(module))

    def summon_async(self, module: str, path: str = "", recurse: bool = True,
                     writeback: bool = True, rank0_only: bool = False,
                     offload_to_cpu: bool = False, with_grads: bool = False,
                     end_first: Summoned | Iterable[Summoned] | None = None,
                     compute_precision: bool = False) -> PendingSummon:
        """Collective, asynchronous: starts ``summon`` and returns a ``PendingSummon`` at
        once (prefetch: start the next unit's all-gather, compute, then ``wait()``). Calls
        this client makes afterwards that act on the group (summon, writeback end, a
        reduce-scatter's ``finish``, commit, register, checkpoints, all_reduce, broadcast,
        leave) first wait for the calls started before them, so every rank's collectives
        keep one order; ``begin_reduce_scatter`` waits only for its unit's started
        ``finish_async``. Errors found before any RPC
        (unknown module, not joined) raise here; the rest at ``wait()``. ``end_first`` as
        in ``summon``: its End goes with the started summon."""
        p = self._c.summon_async(module, path, bool(recurse), bool(writeback), bool(rank0_only),
                                 bool(offload_to_cpu), bool(with_grads),
                                 _raw_summoned(end_first), bool(compute_precision))
        return PendingSummon(p, self._plans.get(module))

    def begin_reduce_scatter(self, module: str, unit: int, op: str = "avg",
                             accumulate: bool = False) -> PendingReduceScatter:
        """Phase one of a gradient reduce-scatter of plan unit `unit`. Local to the daemon
        (no collective): it does not wait for started summons nor for other units'
        ``finish_async``, only for the last ``finish_async`` of the same module and unit
        (and what was started before it), so the buffer it hands out is never one a running
        reduce-scatter still reads."""
        p = self._c.begin_reduce_scatter(module, int(unit), op, bool(accumulate))
        return PendingReduceScatter(p, self._c)

    def reduce_scatter_grads(self, module: str, unit: int, flat_grad: torch.Tensor,
                             op: str = "avg", accumulate: bool = False) -> None:
        """Both phases: copies `flat_grad` (1-D, the unit's padded numel, or its unpadded
        numel with the padding reduced as zeros) into the daemon's buffer, then finishes.
        Needs torch (``begin_reduce_scatter`` does not)."""
        t = tensors("Client.reduce_scatter_grads")
        if not isinstance(flat_grad, t.torch.Tensor):
            raise InvalidArgumentError(
                f"reduce_scatter_grads: flat_grad must be a torch.Tensor, got "
                f"{type(flat_grad).__name__}")
        u = self._unit(module, unit)
        numel, padded = u["numel"], u["padded_numel"]
        want = t.torch_dtype(u["dtype"])
        if flat_grad.dim() != 1 or flat_grad.numel() not in (numel, padded):
            raise InvalidArgumentError(
                f"reduce_scatter_grads: module {module!r} unit {unit}: flat_grad must be 1-D "
                f"with {padded} (padded) or {numel} elements, got shape {tuple(flat_grad.shape)}")
        if flat_grad.dtype != want:
            raise InvalidArgumentError(
                f"reduce_scatter_grads: module {module!r} unit {unit}: flat_grad has dtype "
                f"{flat_grad.dtype}, the unit is {u['dtype']}")
        p = self.begin_reduce_scatter(module, unit, op, accumulate)
        n = flat_grad.numel()
        # On the client's stream: `flat_grad` was produced there (or ordered before it), and
        # finish() sends the event recorded there, which the daemon waits for.
        with self._on_cuda_stream(p.flat):
            p.flat[:n].copy_(flat_grad)
            if n < p.numel:
                p.flat[n:].zero_()
        p.finish()

    def shard_views(self, module: str) -> ShardViews:
        """This rank's shards of `module`, sorted by unit (the optimizer's view): a
        ShardViews, a list of UnitShards with ``.generation``, the committed generation they
        hold. Raises UnavailableError while the shards are being rolled back after a failure;
        read the views again after a rollback (before ``commit``)."""
        v = self._c.shard_views(module)
        return ShardViews([UnitShard(s) for s in v.shards], v.generation, v.state_specs)

    def register_state(self, module: str, specs: Iterable[Sequence[Any]]) -> ShardViews:
        """Local (this rank only): optimizer state buffers of registered `module`, kept by the
        daemon next to this rank's shards (same memory, same lifetime: they survive this
        process, and a restarted trainer gets them back by calling this again with the same
        specs). `specs`: [(name, dtype, shape)], name an identifier (letters, digits, "_",
        "."), dtype a torch.dtype or its flatshard name ("float32"), shape "shard" (one
        element per shard element: exp_avg, momentum_buffer) or "scalar" (one per unit:
        Adam's step). New buffers are zeros. They commit and roll back with the shards
        (``commit``): state registered after the last commit rolls back to zeros.
        The first call for the module (on this daemon) fixes the spec; a different one
        raises FailedPreconditionError naming the state and field. Returns the ShardViews,
        each UnitShard with ``state(name)`` tensors (unlike ``shard_views``, this does not
        count as reading the views again after a rollback, see ``commit``)."""
        norm = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, (tuple, list)) or len(spec) != 3:
                raise InvalidArgumentError(
                    f"register_state: specs[{i}] must be (name, dtype, 'shard' | 'scalar'), "
                    f"got {spec!r}")
            name, dtype, shape = spec
            torch = sys.modules.get("torch")  # not imported: `dtype` is no torch.dtype
            if torch is not None and isinstance(dtype, torch.dtype):
                dtype = tensors("register_state").dtype_name(dtype)
            norm.append((str(name), str(dtype), str(shape)))
        v = self._c.register_state(module, norm)
        return ShardViews([UnitShard(s) for s in v.shards], v.generation, v.state_specs)

    def commit(self, module: str) -> int:
        """Collective: closes the current training step of `module` (call it on every rank
        after the optimizer updated the shards in place); returns the generation committed.

        Crash consistency (spec/semantics.md §3a): a step commits on every rank or on none.
        After any failure (a rank died or left, a deadline, a daemon lost) the group re-forms
        once every rank has joined again and every rank's shards are rolled back to the last
        committed generation, which ``register`` (re-attach) and ``shard_views`` report.
        Every rank, survivors too, must then read its views again (``shard_views`` or
        ``register``) before it commits; a commit from a rank that did not is refused on
        every rank and rolls them back. A writeback ``Summoned.end()`` also commits.
        Errors: UnavailableError naming a rank whose session ended, DeadlineExceededError
        naming the ranks that did not call, FailedPreconditionError for a stale rank or when
        not joined, NotFoundError for a module this client did not register."""
        return int(self._c.commit(module))

    def all_reduce(self, values: Any, op: str = "sum") -> Any:
        """Collective over every rank of the group: the element-wise ``op`` ("sum", "max",
        "min") of every rank's ``values``. A float32 or float64 CPU tensor is reduced in place
        and returned; a list or tuple of numbers is reduced as float64 and a list of floats
        returned (no torch needed). Every rank passes as many values of one type; the daemons
        reduce them in rank order, so every rank gets bit-identical results. For small inputs
        (a norm, a flag): at most 1 MiB. Ordered with this client's other group calls.
        Errors: InvalidArgumentError on every rank naming the rank whose count, dtype or op
        differs from rank 0's; DeadlineExceededError naming the ranks that did not call;
        FailedPreconditionError when not joined."""
        if _is_tensor(values):
            torch = sys.modules["torch"]
            if values.dtype not in (torch.float32, torch.float64) or values.device.type != "cpu":
                raise InvalidArgumentError(
                    f"all_reduce: a {values.dtype} tensor on {values.device}; expected float32 "
                    f"or float64 on the CPU (cast the tensor first)")
            flat = values.detach().contiguous().reshape(-1)
            out = self._c.all_reduce(flat.numpy().tobytes(), values.dtype == torch.float64, op)
            reduced = torch.frombuffer(bytearray(out), dtype=values.dtype)
            with torch.no_grad():
                values.copy_(reduced.view(values.shape))
            return values
        vals = [float(v) for v in values]
        out = self._c.all_reduce(struct.pack(f"<{len(vals)}d", *vals), True, op)
        return list(struct.unpack(f"<{len(vals)}d", out))

    def broadcast(self, data: Any, root: int = 0) -> Any:
        """Collective over every rank of the group: rank ``root``'s ``data`` on every rank.
        A contiguous CPU tensor (any dtype) is overwritten in place and returned; ``bytes``
        (or a bytearray) are returned as the root's bytes. Every rank passes as many bytes
        (at most 64 MiB). Errors as ``all_reduce`` (a bad or differing root is named)."""
        if _is_tensor(data):
            torch = sys.modules["torch"]
            if data.device.type != "cpu" or not data.is_contiguous():
                raise InvalidArgumentError(
                    f"broadcast: the tensor must be contiguous on the CPU (it is "
                    f"{'on ' + str(data.device) if data.device.type != 'cpu' else 'strided'})")
            raw = data.detach().reshape(-1).view(torch.uint8)
            out = self._c.broadcast(raw.numpy().tobytes(), int(root))
            with torch.no_grad():
                raw.copy_(torch.frombuffer(bytearray(out), dtype=torch.uint8))
            return data
        return self._c.broadcast(bytes(data), int(root))

    def publish(self, module: str, name: str, dtype: Any = None,
                reader_uids: Iterable[int] = (), reader_token: Optional[str] = None,
                device: Optional[int] = None) -> Any:
        """Collective: publishes `module`'s committed step (the last ``commit()``; the
        daemon builds it from its committed copies, so training may go on at once) as the
        next version of the weights `name`, for readers on this node
        (``flatshard.weights.open``): the full parameters in the module's state-dict layout,
        cast to `dtype` (a torch dtype or a flatshard dtype name such as "bfloat16"; None:
        the parameters' own). Readers: the publisher's uid, the uids in `reader_uids`, and
        whoever presents `reader_token`. Returns the ``flatshard.weights.PublishedVersion``
        (every rank gets the same). Steps not committed are not in it: commit first.
        `device` (an int): the version goes to device memory of the daemon's GPU with this
        ordinal (README "Versions in GPU memory"; readers get CUDA tensors), read by this uid
        only (no `reader_uids` / `reader_token`); a group on several daemons gets it in that
        GPU of each of its daemons; None: host shared memory."""
        from .weights import PublishedVersion
        if dtype is None:
            dtype_name = ""
        elif isinstance(dtype, str):
            dtype_name = dtype
        else:
            dtype_name = tensors("publish(dtype=torch dtype)").dtype_name(dtype)
        uids = [int(u) for u in reader_uids]
        if device is not None and (isinstance(device, bool) or not isinstance(device, int)
                                   or device < 0):
            raise InvalidArgumentError(
                f"publish: device must be a GPU ordinal (int >= 0) or None, got {device!r}")
        return PublishedVersion._of(
            self._c.publish(module, name, dtype_name, uids, reader_token or "",
                            -1 if device is None else int(device)))

    def _unit(self, module: str, unit: int) -> dict[str, Any]:
        plan = self._plans.get(module)
        if plan is None:
            raise NotFoundError(
                f"module {module!r} was not registered by this client")
        for u in plan["units"]:
            if u["index"] == unit:
                return u
        raise NotFoundError(f"module {module!r} has no unit {unit}")

    def __repr__(self) -> str:
        return f"flatshard.Client({self.address!r}, joined={self.joined})"


def _is_tensor(x: Any) -> bool:
    """Whether `x` is a torch tensor (without importing torch: a process without it passes
    none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)
