"""The flatshard manifest (``flatshard.manifest/1``, spec/formats.md) of an ``nn.Module``.

This is the one home of the exporter: ``flatshard.torch.manifest_of`` and
``scripts/fsdp_fixtures/flatshard_manifest.py`` (a thin command-line wrapper that
loads this file by path, so it works without the built extension) both use it.
It needs only ``torch``.

Rules (formats.md):
- modules are numbered per *instance* in pre-order (registration order); a
  module instance registered at several paths is written in full at its first
  occurrence and as ``{"ref": id}`` everywhere else;
- ``type`` is the class name, ``bases`` the names of the ``nn.Module``
  subclasses in ``type(m).__mro__[1:]`` (nearest first);
- ``params``/``buffers`` are the tensors registered directly on the module
  (``_parameters`` / ``_buffers``, registration order, ``None`` entries
  skipped, duplicates kept), each with a tensor id that is the same for the
  same tensor object wherever it is registered (tied parameters share an id).
  Params and buffers share one id space; ids are assigned in order of first
  appearance. Buffers report ``requires_grad: false``; the key is left out when
  a module has no buffers.
"""
import json
from typing import Any, Dict, List

import torch
import torch.nn as nn

FORMAT = "flatshard.manifest/1"

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no flatshard manifest name") from None


def module_bases(m: nn.Module) -> List[str]:
    return [
        c.__name__
        for c in type(m).__mro__[1:]
        if isinstance(c, type) and issubclass(c, nn.Module)
    ]


def manifest_from_module(module: nn.Module) -> Dict[str, Any]:
    """Return the flatshard manifest of ``module`` as a JSON-ready dict."""
    module_ids: Dict[int, int] = {}  # id(module) -> manifest module id
    tensor_ids: Dict[int, int] = {}  # id(tensor) -> manifest tensor id
    keep_alive: List[Any] = []  # keep objects alive so id() stays unique

    def tensor_entry(name: str, t: torch.Tensor, requires_grad: bool) -> Dict[str, Any]:
        key = id(t)
        if key not in tensor_ids:
            tensor_ids[key] = len(tensor_ids)
            keep_alive.append(t)
        return {
            "name": name,
            "id": tensor_ids[key],
            "shape": [int(s) for s in t.shape],
            "dtype": dtype_name(t.dtype),
            "requires_grad": bool(requires_grad),
        }

    def visit(m: nn.Module) -> Dict[str, Any]:
        key = id(m)
        if key in module_ids:
            return {"ref": module_ids[key]}
        module_ids[key] = len(module_ids)
        keep_alive.append(m)
        out: Dict[str, Any] = {
            "id": module_ids[key],
            "type": type(m).__name__,
            "bases": module_bases(m),
            "params": [
                tensor_entry(n, p, p.requires_grad)
                for n, p in m._parameters.items()
                if p is not None
            ],
        }
        buffers = [
            tensor_entry(n, b, False) for n, b in m._buffers.items() if b is not None
        ]
        if buffers:
            out["buffers"] = buffers
        out["children"] = [
            {"name": n, "module": visit(c)}
            for n, c in m._modules.items()
            if c is not None
        ]
        return out

    return {"format": FORMAT, "root": visit(module)}


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _fmt(v: Any, indent: int, level: int, width: int) -> str:
    if _is_scalar(v):
        return json.dumps(v, ensure_ascii=True)
    pad = " " * (indent * (level + 1))
    end = " " * (indent * level)
    if isinstance(v, list):
        if not v:
            return "[]"
        if all(_is_scalar(x) for x in v):
            return "[" + ", ".join(json.dumps(x, ensure_ascii=True) for x in v) + "]"
        items = [_fmt(x, indent, level + 1, width) for x in v]
        return "[\n" + ",\n".join(pad + i for i in items) + "\n" + end + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        if all(_is_scalar(x) or (isinstance(x, list) and all(_is_scalar(y) for y in x))
               for x in v.values()):
            one = "{" + ", ".join(
                json.dumps(k) + ": " + _fmt(x, indent, level + 1, width) for k, x in v.items()
            ) + "}"
            if len(one) + len(pad) <= width:
                return one
        items = [json.dumps(k) + ": " + _fmt(x, indent, level + 1, width) for k, x in v.items()]
        return "{\n" + ",\n".join(pad + i for i in items) + "\n" + end + "}"
    raise TypeError(f"cannot serialise {type(v).__name__}")


def dumps(doc: Any, indent: int = 1, width: int = 120) -> str:
    """Deterministic, compact-but-readable JSON text with a trailing newline:
    objects holding only scalars (and lists of scalars) and lists of scalars
    are written on one line; everything else one item per line."""
    text = _fmt(doc, indent, 0, width)
    json.loads(text)  # sanity: still valid JSON
    return text + "\n"


def manifest_of(module: nn.Module) -> Dict[str, Any]:
    """The manifest of ``module`` as a JSON-ready dict (alias of ``manifest_from_module``)."""
    return manifest_from_module(module)


def manifest_json(module: nn.Module) -> str:
    """The manifest of ``module`` as compact JSON text (what ``Client.register`` takes)."""
    return json.dumps(manifest_from_module(module), separators=(",", ":"))
