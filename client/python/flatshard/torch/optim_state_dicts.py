"""Full optimizer state dicts of a ``FlatShardModule``'s optimizer, as FSDP's:

- ``full_optim_state_dict(model, optim, rank0_only=True)`` (FSDP's, also
  ``FlatShardModule.full_optim_state_dict``) and ``optim_state_dict(model, optim)`` (FSDP 2.x,
  on every rank): the optimizer's state keyed like the *unwrapped* model's optimizer would
  have it: parameter ids 0, 1, ... in ``model.module.named_parameters()`` order (tied
  parameters once), each parameter's state tensors full-sized in its shape, the same
  ``param_groups`` (hyperparameters of the wrapped optimizer's groups, ``params`` as those
  ids). A plain ``torch.optim`` optimizer over ``model.module``'s parameters (or an equal
  unwrapped model) loads it with ``load_state_dict``.
- ``optim_state_dict_to_load(model, optim, optim_state_dict)`` (FSDP 2.x; also
  ``shard_full_optim_state_dict(full_osd, model, optim)`` as 1.13's): the other way, this
  rank's part of a full optimizer state dict, keyed for the wrapped optimizer ``optim``:
  ``optim.load_state_dict(optim_state_dict_to_load(model, optim, osd))``.

Both work with the optimizer state in the trainer and with ``keep_optimizer_state`` (the state
tensors are then views of the daemon's buffers; a loaded state is copied into them before the
next step). Collective: ``full_optim_state_dict`` gathers every rank's state shards with one
``Client.broadcast`` per rank (pieces of at most 64 MiB), so every rank calls it; loading is
local (each rank needs the full dict: ``rank0_only=False`` or pass it around).

Which state is sharded: a tensor state with its parameter's (sharded) shape (Adam's
``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``), gathered into the full shape; a
0-dim tensor (Adam's ``step``) is per unit (flat parameters) or per parameter
(``use_orig_params``), taken from rank 0; anything else (None, numbers) is copied as rank 0
has it. Every rank's optimizer must hold the same state names and dtypes per unit (true for
torch's optimizers once every rank stepped alike): checked with one all-reduce, the differing
unit named otherwise.
"""
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["full_optim_state_dict", "optim_state_dict", "optim_state_dict_to_load",
           "shard_full_optim_state_dict"]

_PIECE = 64 << 20  # Client.broadcast's limit per call


def _orig_params(model) -> List[nn.Parameter]:
    """The unwrapped model's parameters in named_parameters() order (ids of the full dict)."""
    seen, out = set(), []
    for _, p in model.module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _is_shard_state(v: Any, param: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == param.shape


def _is_scalar_state(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 0


def _unit_params(model, u) -> List[Any]:
    """The unit's distinct _Params whose Parameter the optimizer steps (use_orig_params)."""
    seen, out = set(), []
    for p in u.params:
        if id(p.param) not in seen:
            seen.add(id(p.param))
            out.append(p)
    return out


def _owners(model, u) -> List[Tuple[int, nn.Parameter]]:
    """(key, parameter) of what the optimizer steps for unit u: (-1, flat parameter), or
    (j, j-th distinct original parameter) with use_orig_params."""
    if not model._use_orig_params:
        return [(-1, u.flat_param)]
    return [(j, p.param) for j, p in enumerate(_unit_params(model, u))]


def _local_spec(model, optim) -> Tuple[List[Tuple[int, str, torch.dtype]],
                                       List[Tuple[int, int, str, torch.Tensor]]]:
    """This rank's sharded states (unit, name, dtype) and 0-dim states (unit, owner key,
    name, value), each in a fixed order."""
    shard, scalars = {}, []
    for u in model._units:
        if not u.requires_grad:
            continue
        for key, param in _owners(model, u):
            for name, v in sorted(optim.state.get(param, {}).items()):
                if _is_shard_state(v, param):
                    shard.setdefault((u.index, name), v.dtype)
                elif _is_scalar_state(v):
                    scalars.append((u.index, key, name, v.detach()))
    return [(unit, name, dtype) for (unit, name), dtype in sorted(shard.items())], scalars


def _check_same_spec(model, spec, scalars) -> None:
    text = ";".join([f"{unit}:{name}:{dtype}" for unit, name, dtype in spec] +
                    [f"{unit}.{key}:{name}:{v.dtype}" for unit, key, name, v in scalars])
    h = float(zlib.crc32(text.encode()))
    got = model.client.all_reduce([h, -h], "max")
    if got[0] != h or -got[1] != h:
        raise ValueError(f"full_optim_state_dict: the ranks' optimizers hold different state "
                         f"(rank {model._rank()}: {text[:300] or 'none'}); every rank must "
                         f"step the same parameters with the same optimizer first")


def _shard_buffer(model, optim, u, name: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's state `name` of unit u as one shard-shaped buffer (zeros where none)."""
    if not model._use_orig_params:
        v = optim.state.get(u.flat_param, {}).get(name)
        if _is_shard_state(v, u.flat_param):
            return v.detach().to(dtype).reshape(-1)
        return torch.zeros(u.shard_numel, dtype=dtype)
    buf = torch.zeros(u.shard_numel, dtype=dtype)
    for p in _unit_params(model, u):
        v = optim.state.get(p.param, {}).get(name)
        lo = max(p.offset, u.shard_offset)
        hi = min(p.offset + p.numel, u.shard_offset + u.shard_numel)
        if hi > lo and _is_shard_state(v, p.param):
            buf.narrow(0, lo - u.shard_offset, hi - lo).copy_(v.detach().reshape(-1))
    return buf


def _broadcast(client, data: torch.Tensor, root: int) -> None:
    for lo in range(0, data.numel(), _PIECE):
        client.broadcast(data.narrow(0, lo, min(_PIECE, data.numel() - lo)), root)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _gather_full(model, optim, spec, scalars
                 ) -> Tuple[Dict[Tuple[int, str], torch.Tensor],
                            Dict[Tuple[int, int, str], torch.Tensor]]:
    """(unit, name) -> the full flat (padded) state, every rank's shard in place, and
    (unit, owner key, name) -> rank 0's 0-dim states. One broadcast per rank: its shard
    offsets, its state shards and its 0-dim states."""
    offsets = torch.tensor([u.shard_offset for u in model._units], dtype=torch.int64)
    parts = ([_bytes(offsets)] +
             [_bytes(_shard_buffer(model, optim, model._units[unit], name, dtype))
              for unit, name, dtype in spec] +
             [_bytes(v.reshape(1)) for _, _, _, v in scalars])
    sizes = [t.numel() for t in parts]
    own = torch.cat(parts)
    full = {(unit, name): torch.zeros(model._units[unit].padded_numel, dtype=dtype)
            for unit, name, dtype in spec}
    rank0: Dict[Tuple[int, int, str], torch.Tensor] = {}
    for root in range(model._world_size()):
        blob = own.clone()
        _broadcast(model.client, blob, root)
        pieces = torch.split(blob, sizes)
        offs = pieces[0].clone().view(torch.int64)
        for (unit, name, dtype), piece in zip(spec, pieces[1:1 + len(spec)]):
            u = model._units[unit]
            full[(unit, name)].narrow(0, int(offs[unit]), u.shard_numel).copy_(
                piece.clone().view(dtype))
        if root == 0:
            for (unit, key, name, v), piece in zip(scalars, pieces[1 + len(spec):]):
                rank0[(unit, key, name)] = piece.clone().view(v.dtype).reshape(())
    return full, rank0


def full_optim_state_dict(model, optim: torch.optim.Optimizer, rank0_only: bool = True
                          ) -> Dict[str, Any]:
    """FSDP's ``full_optim_state_dict``: the full optimizer state dict keyed like the
    unwrapped model's (see the module's docstring); ``rank0_only``: the other ranks return
    ``{}``. Collective: every rank calls it."""
    if model.training_state.value != "IDLE":
        raise AssertionError("full_optim_state_dict: called inside a forward/backward or "
                             "summon_full_params")
    spec, scalars = _local_spec(model, optim)
    _check_same_spec(model, spec, scalars)
    full, rank0 = _gather_full(model, optim, spec, scalars)
    by_unit: Dict[int, List[Tuple[str, torch.dtype]]] = {}
    for unit, name, dtype in spec:
        by_unit.setdefault(unit, []).append((name, dtype))
    params = _orig_params(model)
    index = {id(p): i for i, p in enumerate(params)}
    state: Dict[int, Dict[str, Any]] = {}
    for i, param in enumerate(params):
        managed = model._managed.get(id(param))
        if managed is None:  # an ignored module's parameter: the optimizer's own state
            st = optim.state.get(param)
            if st:
                state[i] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in st.items()}
            continue
        unit, p = managed
        u = model._units[unit]
        key, owner = next((k, q) for k, q in _owners(model, u)
                          if model._use_orig_params is False or q is p.param)
        st = optim.state.get(owner, {})
        if not st and unit not in by_unit:
            continue
        out: Dict[str, Any] = {}
        for name, _ in by_unit.get(unit, []):
            out[name] = full[(unit, name)].narrow(0, p.offset, p.numel).view(p.shape).clone()
        for name, v in st.items():
            if _is_shard_state(v, owner):
                continue
            out[name] = (rank0[(unit, key, name)].clone() if _is_scalar_state(v)
                         else v)
        state[i] = out
    groups = []
    for g in optim.param_groups:
        ids = set()
        for q in g["params"]:
            if id(q) in index:
                ids.add(index[id(q)])
                continue
            for u in model._units:  # a flat parameter: every parameter of its unit
                if u.flat_param is q:
                    ids.update(index[id(p.param)] for p in u.params if id(p.param) in index)
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": sorted(ids)})
    if rank0_only and model._rank() != 0:
        return {}
    return {"state": state, "param_groups": groups}


def optim_state_dict(model, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """FSDP 2.x's ``optim_state_dict`` (full state dict type): ``full_optim_state_dict``
    on every rank. Collective."""
    return full_optim_state_dict(model, optim, rank0_only=False)


def optim_state_dict_to_load(model, optim: torch.optim.Optimizer,
                             optim_state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """FSDP 2.x's ``optim_state_dict_to_load``: this rank's part of the full optimizer state
    dict ``optim_state_dict`` (as ``full_optim_state_dict`` makes it, or a plain optimizer of
    the unwrapped model saved it), keyed for ``optim`` (the wrapped model's optimizer):
    ``optim.load_state_dict(...)`` it. Local. Hyperparameters: each group of ``optim`` takes
    those of the full dict's group that holds its first parameter."""
    params = _orig_params(model)
    full_state = {int(k): v for k, v in optim_state_dict.get("state", {}).items()}
    index = {id(p): i for i, p in enumerate(params)}
    group_of = {}
    for gi, g in enumerate(optim_state_dict.get("param_groups", [])):
        for i in g["params"]:
            group_of[int(i)] = gi
    state: Dict[int, Dict[str, Any]] = {}
    groups = []
    k = 0
    for g in optim.param_groups:
        first_full: Optional[int] = None
        ids = []
        for q in g["params"]:
            st = _load_one(model, q, full_state, index)
            if st:
                state[k] = st
            ids.append(k)
            if first_full is None:
                first_full = _first_index(model, q, index)
            k += 1
        src = optim_state_dict["param_groups"][group_of.get(first_full, 0)] \
            if optim_state_dict.get("param_groups") else {}
        hyper = {n: v for n, v in src.items() if n != "params"}
        groups.append({**{n: v for n, v in g.items() if n != "params"}, **hyper, "params": ids})
    return {"state": state, "param_groups": groups}


def _first_index(model, q, index) -> Optional[int]:
    if id(q) in index:
        return index[id(q)]
    for u in model._units:
        if u.flat_param is q and u.params:
            return index.get(id(u.params[0].param))
    return None


def _load_one(model, q, full_state, index) -> Dict[str, Any]:
    """The state of wrapped optimizer parameter q (a flat parameter, an original parameter's
    shard part, or an ignored parameter) cut from the full dict."""
    if id(q) in index and id(q) not in model._managed:  # ignored: as saved
        return dict(full_state.get(index[id(q)], {}))
    unit_params = None
    for u in model._units:
        if u.flat_param is q:
            unit_params = (u, list(u.params))
            break
    if unit_params is None:
        unit, p = model._managed[id(q)]
        unit_params = (model._units[unit], [p])
    u, ps = unit_params
    flat = not model._use_orig_params
    out: Dict[str, Any] = {}
    for p in ps:
        st = full_state.get(index.get(id(p.param), -1), {})
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and tuple(v.shape) == p.shape:
                if flat:
                    buf = out.get(name)
                    if buf is None:
                        buf = out[name] = torch.zeros(u.padded_numel, dtype=v.dtype)
                    buf.narrow(0, p.offset, p.numel).copy_(v.reshape(-1))
                else:
                    lo = max(p.offset, u.shard_offset)
                    hi = min(p.offset + p.numel, u.shard_offset + u.shard_numel)
                    out[name] = v.reshape(-1).narrow(0, lo - p.offset,
                                                     max(0, hi - lo)).clone()
            elif name not in out:
                out[name] = v.clone() if isinstance(v, torch.Tensor) else v
    if flat:
        for name, v in list(out.items()):
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == u.padded_numel:
                out[name] = v.narrow(0, u.shard_offset, u.shard_numel).clone()
    return out


def shard_full_optim_state_dict(full_optim_state_dict: Dict[str, Any], model,
                                optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """FSDP 1.13's ``shard_full_optim_state_dict`` (with the optimizer to key for):
    ``optim_state_dict_to_load(model, optim, full_optim_state_dict)``."""
    return optim_state_dict_to_load(model, optim, full_optim_state_dict)
