"""FSDP's ``MixedPrecision`` for ``FlatShardModule``.

The daemon does the parameter work: the policy's ``mixed_precision`` gives each plan unit a
``compute_dtype`` (``param_dtype``) and a ``reduce_dtype``; a forward/backward summon
(``compute_precision=True``) hands the unit out in ``param_dtype``, the daemon casting each
rank's float32 shard before the all-gather, and the gradient the trainer hands over is
reduce-scattered in ``reduce_dtype`` and cast into the float32 gradient shard. This module
holds what stays in the trainer: the policy document, the casts of forward inputs and of
buffers, and the low-precision gradients of ``keep_low_precision_grads``.
"""
import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.float64: "float64"}


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """As ``torch.distributed.fsdp.MixedPrecision`` (torch 2.x fields; torch 1.13 has the
    first four). ``param_dtype``: the dtype forward and backward run in (the shards and the
    optimizer stay float32). ``reduce_dtype``: the dtype gradients are reduce-scattered in
    (default: ``param_dtype``, as FSDP). ``buffer_dtype``: floating buffers are kept in it
    (full precision inside ``summon_full_params`` and state dicts). ``keep_low_precision_grads``:
    the optimizer's ``.grad`` are ``param_dtype`` copies of the float32 gradient shards.
    ``cast_forward_inputs``: every wrapped unit casts the floating tensors of its forward's
    arguments to ``param_dtype``; ``cast_root_forward_inputs`` (default True, FSDP's root
    behaviour): the wrapper's own forward does. ``_module_classes_to_ignore``: units rooted at
    such modules (wrapped separately by the auto-wrap policy) keep full precision and cast
    their inputs to it."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type] = (_BatchNorm,)


def _dtype_name(dtype: Optional[torch.dtype], field: str) -> Optional[str]:
    if dtype is None:
        return None
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"MixedPrecision.{field}: {dtype} is not a floating dtype flatshard "
                         f"can shard (one of {', '.join(_DTYPE_NAMES.values())})")
    return name


def _normalize(mp: Any) -> Optional[MixedPrecision]:
    """Ours, or torch's own ``MixedPrecision`` (any object with its fields), or None."""
    if mp is None or isinstance(mp, MixedPrecision):
        return mp
    fields = {f.name for f in dataclasses.fields(MixedPrecision)}
    got = {k: getattr(mp, k) for k in fields if hasattr(mp, k)}
    if "param_dtype" not in got:
        raise TypeError(f"mixed_precision: {type(mp).__name__} is not a MixedPrecision")
    return MixedPrecision(**got)


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x
    if isinstance(x, (list, tuple)):
        cast = [_cast_floating(v, dtype) for v in x]
        return type(x)(*cast) if hasattr(x, "_fields") else type(x)(cast)
    if isinstance(x, dict):
        return {k: _cast_floating(v, dtype) for k, v in x.items()}
    return x


class _Precision:
    """One wrapper's mixed precision (or none): an owner of its own state."""

    def __init__(self, mp: Any, root: nn.Module, ignored: List[nn.Module]):
        self.mp = _normalize(mp)
        self._root = root
        self._ignored = ignored
        self._orig: Dict[int, Tuple[torch.Tensor, torch.dtype]] = {}  # id(buffer) -> dtype
        self._full = 0  # nesting of full_precision_buffers()

    @property
    def enabled(self) -> bool:
        return self.mp is not None

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        return self.mp.param_dtype if self.mp else None

    def policy_json(self) -> Optional[Dict[str, Any]]:
        """The policy's ``mixed_precision`` (formats.md): what the daemon plans with."""
        if self.mp is None:
            return None
        doc: Dict[str, Any] = {"module_types_to_ignore": [
            c.__name__ for c in self.mp._module_classes_to_ignore]}
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            name = _dtype_name(getattr(self.mp, field), field)
            if name is not None:
                doc[field] = name
        return doc

    def ignores(self, module: nn.Module) -> bool:
        return self.mp is not None and isinstance(module,
                                                  tuple(self.mp._module_classes_to_ignore))

    # ---------------------------------------------------------------- forward inputs
    def cast_root_inputs(self, args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        if (self.mp is None or self.mp.param_dtype is None
                or not self.mp.cast_root_forward_inputs or self.ignores(self._root)):
            return args, kwargs
        return _cast_floating(args, self.mp.param_dtype), _cast_floating(kwargs,
                                                                         self.mp.param_dtype)

    def unit_input_dtype(self, unit_module: nn.Module,
                         full_dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype a (non-root) unit's forward casts its floating inputs to, or None."""
        if self.mp is None:
            return None
        if self.ignores(unit_module):
            return full_dtype  # runs in full precision: its parameters are float32
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            return self.mp.param_dtype
        return None

    # ---------------------------------------------------------------- buffers
    def _buffers(self) -> Iterator[Tuple[nn.Module, str, torch.Tensor]]:
        skip = {id(b) for m in self._ignored for b in m.buffers()}
        for m in self._root.modules():
            if self.ignores(m):
                continue  # full precision, as its parameters
            for name, b in m.named_buffers(recurse=False):
                if b is not None and id(b) not in skip and torch.is_floating_point(b):
                    yield m, name, b

    def cast_buffers(self) -> None:
        """Casts the floating buffers to ``buffer_dtype`` (FSDP does at its lazy init)."""
        if self.mp is None or self.mp.buffer_dtype is None:
            return
        for m, name, b in list(self._buffers()):
            if b.dtype != self.mp.buffer_dtype:
                self._orig[id(m), name] = b.dtype
                m._buffers[name] = b.detach().to(self.mp.buffer_dtype)

    @contextlib.contextmanager
    def full_precision_buffers(self) -> Iterator[None]:
        """Buffers in their original dtype for the block (summon_full_params, state dicts,
        checkpoints are full precision, as FSDP's), back to ``buffer_dtype`` after it (values
        loaded inside are kept)."""
        if not self._orig or self._full:
            yield
            return
        self._full += 1
        mods = dict(self._root.named_modules())
        by_key = {(id(m), n): (m, n) for m in mods.values() for n in m._buffers}
        try:
            for key, dtype in self._orig.items():
                m, n = by_key[key]
                m._buffers[n] = m._buffers[n].to(dtype)
            yield
        finally:
            self._full -= 1
            for key in self._orig:
                m, n = by_key[key]
                m._buffers[n] = m._buffers[n].detach().to(self.mp.buffer_dtype)

    # ---------------------------------------------------------------- gradients
    def optimizer_grad(self, grad_shard: torch.Tensor) -> torch.Tensor:
        """What the optimizer's ``.grad`` is over a gradient shard: the float32 shard itself,
        or a ``param_dtype`` copy of it under ``keep_low_precision_grads``."""
        if (self.mp is not None and self.mp.keep_low_precision_grads
                and self.mp.param_dtype is not None):
            return grad_shard.to(self.mp.param_dtype)
        return grad_shard


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also for a gradient of another dtype (keep_low_precision_grads:
    torch refuses that assignment, so, as FSDP, a same-dtype stand-in gets ``.data`` set)."""
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty(grad.shape, dtype=param.dtype)
    param.grad.data = grad
