"""Zero-copy torch tensors over flatshard's mapped memory, and read-only tensors.

Tensors are made from DLPack capsules (flatshard._C): host memory as CPU tensors, device
memory as CUDA tensors. Each tensor owns a share of the mappings it points into, so it stays
valid after its summon ended or its Client closed (writes after End are lost).

Read-only summons and published weights (flatshard.weights) are mapped read-only: a store
through the memory would be a SIGSEGV.
torch 1.13 has no read-only tensors, so their tensors are ReadOnlyTensor, which refuses every
torch operation that would write them (in-place methods, ``t[i] = x``, augmented assignment,
``out=``) with ReadOnlyViewError before anything is written, and hands out read-only numpy
arrays. Reads run unchanged (one Python-level dispatch per op). Escape hatches torch offers
below the tensor API (``t.storage()`` item writes, ``data_ptr()`` in C code, re-exporting
through DLPack) are not guarded.
"""

import inspect

import numpy as _np
import torch
import torch.utils.dlpack as _dlpack

from .errors import ReadOnlyViewError

__all__ = ["ReadOnlyTensor", "ReadOnlyViewError", "torch_dtype", "dtype_name", "from_capsule"]

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def torch_dtype(name):
    """The torch dtype of a flatshard dtype name ("float32", "bfloat16", ...)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown flatshard dtype {name!r}") from None


def dtype_name(dtype):
    """The flatshard dtype name of a torch dtype (ValueError for one flatshard has not)."""
    for name, d in _TORCH_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"torch dtype {dtype} has no flatshard dtype")


# In-place methods whose name ends in "_" but that write no element.
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "_fix_weakref",
                         "detach_", "rename_"})
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__idiv__",
})


def _name(func):
    return getattr(func, "__name__", "") or ""


_INPLACE_INDEX: dict = {}  # func -> position of its `inplace` parameter, or None


def _inplace_index(func):
    """Position of `func`'s `inplace` parameter (torch.nn.functional's relu, dropout, ...)."""
    try:
        return _INPLACE_INDEX[func]
    except (KeyError, TypeError):
        pass
    idx = None
    try:
        params = list(inspect.signature(func).parameters)
        if "inplace" in params:
            idx = params.index("inplace")
    except (TypeError, ValueError):  # builtins without a signature
        pass
    try:
        _INPLACE_INDEX[func] = idx
    except TypeError:
        pass
    return idx


def _first_read_only(value):
    if isinstance(value, ReadOnlyTensor):
        return value
    if isinstance(value, (tuple, list)):  # torch._foreach_*_(tensors, ...)
        for v in value:
            if isinstance(v, ReadOnlyTensor):
                return v
    return None


def _writes(func, args, kwargs):
    """The ReadOnlyTensor `func` would write, or None."""
    name = _name(func)
    if args:
        first = _first_read_only(args[0])
    elif kwargs:  # handle_torch_function(f, (t,), tensor=t, ...): nn.init passes all by name
        first = _first_read_only(next(iter(kwargs.values())))
    else:
        first = None
    if first is not None:
        if name in _INPLACE_DUNDERS:
            return first
        if name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES:
            return first
        if kwargs.get("inplace"):
            return first
        idx = _inplace_index(func)
        if idx is not None and len(args) > idx and args[idx]:
            return first
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, ReadOnlyTensor):
                return o
    return None


def _range_of(t):
    """(first, end) byte addresses of the read-only memory `t` views (cached on `t`)."""
    r = getattr(t, "_fs_range", None)
    if r is None:
        with torch._C.DisableTorchFunction():
            try:
                st = t.storage()
                lo = st.data_ptr()
                r = (lo, lo + st.nbytes())
            except Exception:  # sparse, meta, ...: no memory of ours
                r = (0, 0)
        t._fs_range = r
    return r


def _aliased(t, ranges):
    """The range of `ranges` whose memory `t` starts in, or None."""
    if t.numel() == 0:
        return None
    p = t.data_ptr()
    for r in ranges:
        if r[0] <= p < r[1]:
            return r
    return None


def _rewrap(value, ranges):
    """Results that alias read-only memory stay ReadOnlyTensor; fresh ones become plain."""
    if isinstance(value, torch.Tensor):
        r = _aliased(value, ranges) if ranges else None
        if r is not None:
            if type(value) is not ReadOnlyTensor:
                value = value.as_subclass(ReadOnlyTensor)
            value._fs_range = r
            return value
        return value.as_subclass(torch.Tensor) if isinstance(value, ReadOnlyTensor) else value
    if isinstance(value, _np.ndarray):
        if value.flags.writeable:
            value.flags.writeable = False  # numpy()/__array__ of read-only memory
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_rewrap(v, ranges) for v in value)
    if isinstance(value, list):
        return [_rewrap(v, ranges) for v in value]
    return value


def _collect(value, acc):
    if isinstance(value, ReadOnlyTensor):
        acc.append(_range_of(value))
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect(v, acc)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, acc)


class ReadOnlyTensor(torch.Tensor):
    """A tensor over read-only memory: writes raise ReadOnlyViewError, reads work."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _writes(func, args, kwargs)
        if target is not None:
            raise ReadOnlyViewError(
                f"{_name(func) or func}: this tensor views read-only memory (a "
                "writeback=False summon, or published weights); summon with writeback=True "
                "to edit parameters, or .clone() it for a private copy")
        with torch._C.DisableTorchFunction():
            ret = func(*args, **kwargs)
            ranges = []
            _collect(args, ranges)
            _collect(kwargs, ranges)
            if not ranges and _name(func) not in ("numpy", "__array__"):
                return ret
            return _rewrap(ret, ranges)

    def __deepcopy__(self, memo):
        """A deep copy is a private copy: an ordinary, writable tensor."""
        with torch._C.DisableTorchFunction():
            copied = self.detach().clone().as_subclass(torch.Tensor)
            copied.requires_grad_(self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save) as an ordinary tensor of the same values."""
        with torch._C.DisableTorchFunction():
            plain = self.as_subclass(torch.Tensor)
        return plain.__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None):
        with torch._C.DisableTorchFunction():
            return "ReadOnly" + torch.Tensor.__repr__(self.as_subclass(torch.Tensor))


def from_capsule(capsule, dtype_name, writable=True):
    """A tensor over a flatshard._C DLPack capsule; ReadOnlyTensor unless `writable`."""
    t = _dlpack.from_dlpack(capsule)
    want = _TORCH_DTYPES.get(dtype_name)
    if want is not None and t.dtype != want:  # DLPack readers without a bfloat16/bool code
        t = t.view(want)
    if not writable:
        lo = t.data_ptr()  # on the plain tensor: no __torch_function__ dispatch
        r = (lo, lo + t.numel() * t.element_size())
        t = t.as_subclass(ReadOnlyTensor)
        t._fs_range = r
    return t
