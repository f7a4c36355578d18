"""``fully_shard``: FSDP2's entry point (torch 2.x ``torch.distributed.fsdp.fully_shard``) over
``FlatShardModule``.

As FSDP2, it is applied bottom-up and the modules keep their classes::

    for block in model.blocks:
        fully_shard(block)                       # marks a unit: registers nothing
    fully_shard(model, client=client)            # the root: registers (collective)
    opt = torch.optim.AdamW(model.parameters())  # the original parameters, this rank's part
    loss = model(x); loss.backward(); opt.step(); model.commit()

A call without ``client`` marks its module as a unit. The root's call (the one with
``client``) registers the model once as ``FlatShardModule(model, client, auto_wrap_policy=
<the marked modules' paths>, use_orig_params=True, sharding_strategy=FULL_SHARD, or
SHARD_GRAD_OP for reshard_after_forward=False, mixed_precision=<from mp_policy>)``: the same
plan, the same training and the same numbers. The root's class becomes a subclass of its own
(``FlatShard<Name>``, as FSDP2's ``FSDP<Name>``), whose call runs the wrapper's forward and
which adds ``commit()``, ``step(opt)``, ``generation``, ``reattach()`` and ``flatshard`` (the
FlatShardModule, for everything else: summons, state dicts, checkpoints).

Refused, with an error naming the argument (nothing is marked or registered then):
``reshard_after_forward`` as an int (FSDP2 reshards to a smaller world; flatshard's units
are sharded over the whole group), values that differ between the units and the root (one
strategy and one mixed precision per registered model), ``mesh`` (the group is the client's),
``shard_placement_fn``, an ``offload_policy`` other than the default ``OffloadPolicy()``,
``ignored_params``, ``MixedPrecisionPolicy.output_dtype``, a list of modules, a module
marked or registered twice.
"""
import dataclasses
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from . import wrap as _wrap
from .fsdp import FlatShardModule
from .mixed_precision import MixedPrecision
from .strategies import ShardingStrategy


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As FSDP2's ``MixedPrecisionPolicy`` (torch's own object is accepted too).
    ``param_dtype``: forward and backward compute dtype; ``reduce_dtype``: the dtype gradients
    are reduce-scattered in (default ``param_dtype``); ``cast_forward_inputs``: every unit
    casts its floating inputs to ``param_dtype``. ``output_dtype`` is not supported."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


class _Mark:
    """What ``fully_shard`` recorded on a module: its arguments and, once a root registered
    the model, the wrapper that trains it."""

    def __init__(self, reshard_after_forward: bool, mp: Optional[MixedPrecision]):
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.owner: Optional["weakref.ReferenceType[FlatShardModule]"] = None


_MARK = "_flatshard_fully_shard"
_WRAPPER = "_flatshard_wrapper"


def _mixed_precision(mp_policy: Any) -> Optional[MixedPrecision]:
    """The FlatShardModule MixedPrecision an FSDP2 policy means (None: full precision)."""
    if mp_policy is None:
        return None
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if not all(hasattr(mp_policy, f) for f in fields):
        raise TypeError(f"fully_shard: mp_policy {type(mp_policy).__name__} is not a "
                        f"MixedPrecisionPolicy (fields {', '.join(fields)})")
    if mp_policy.output_dtype is not None:
        raise ValueError(f"fully_shard: mp_policy.output_dtype={mp_policy.output_dtype} is not "
                         f"supported (leave it None: outputs keep the compute dtype)")
    if mp_policy.param_dtype is None and mp_policy.reduce_dtype is None:
        return None
    cast = bool(mp_policy.cast_forward_inputs)
    # FSDP2 has no BatchNorm exception (FSDP1's _module_classes_to_ignore).
    return MixedPrecision(param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
                          cast_forward_inputs=cast, cast_root_forward_inputs=cast,
                          _module_classes_to_ignore=())


def _check_unsupported(module: Any, reshard_after_forward: Any, mesh: Any,
                       shard_placement_fn: Any, offload_policy: Any, ignored_params: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: module must be one nn.Module, got {type(module).__name__}"
                        f" (a list of modules sharing one unit is not supported)")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward!r} is not "
                         f"supported: True (FULL_SHARD) or False (SHARD_GRAD_OP); an int "
                         f"(resharding to a smaller world) has no flatshard equivalent")
    if mesh is not None:
        raise ValueError("fully_shard: mesh is not supported (pass None): the ranks are the "
                         "client's group; for HSDP use FlatShardModule(sharding_strategy="
                         "HYBRID_SHARD)")
    if shard_placement_fn is not None:
        raise ValueError("fully_shard: shard_placement_fn is not supported (pass None): "
                         "flatshard shards each unit's flat parameter evenly over the ranks")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise ValueError(f"fully_shard: offload_policy {type(offload_policy).__name__} is not "
                         f"supported (None or the default OffloadPolicy()): the shards live "
                         f"in the daemon's memory")
    if ignored_params:
        raise ValueError("fully_shard: ignored_params is not supported (pass None); "
                         "FlatShardModule(ignored_modules=...) leaves whole modules alone")


def fully_shard(module: nn.Module, *, client: Any = None, mesh: Any = None,
                reshard_after_forward: Any = True, shard_placement_fn: Any = None,
                mp_policy: Any = None, offload_policy: Any = None, ignored_params: Any = None,
                **flatshard_kwargs: Any) -> nn.Module:
    """FSDP2's ``fully_shard(module)``: without ``client``, marks ``module`` as a unit; with
    ``client`` (a joined ``flatshard.Client``), registers ``module`` as the root, every
    marked module inside it a unit of its own (collective: every rank calls it alike).
    Returns ``module`` (the same object; the root's class becomes ``FlatShard<Name>``, a
    subclass of its own).

    ``reshard_after_forward``: True (FULL_SHARD: two all-gathers per unit and step) or False
    (SHARD_GRAD_OP: the forward's all-gather kept for the backward); every unit and the root
    alike. ``mp_policy``: a ``MixedPrecisionPolicy`` (flatshard's or torch's), the same on
    every unit and the root. ``flatshard_kwargs`` (the root's call only): FlatShardModule's
    ``name``, ``sync_module_states``, ``require_reattach``, ``register_timeout``,
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``, ``reduce_op``.
    The optimizer takes ``module.parameters()``: the original Parameter objects, which are
    1-D views of this rank's part of each (``use_orig_params=True``; FSDP2 gives DTensors of
    dim-0 rows instead). ``module.state_dict()`` is the module's own: this rank's parts and
    the buffers; ``module.flatshard.state_dict()`` is the full one (collective). See the
    module docstring for what is refused."""
    _check_unsupported(module, reshard_after_forward, mesh, shard_placement_fn, offload_policy,
                       ignored_params)
    mp = _mixed_precision(mp_policy)
    if _WRAPPER in module.__dict__ or _MARK in module.__dict__:
        raise ValueError(f"fully_shard: {type(module).__name__} was passed to fully_shard "
                         f"already")
    owner = _owner_of(module)
    if owner is not None:
        raise ValueError(f"fully_shard: {type(module).__name__} is inside a model registered "
                         f"already (fully_shard is applied bottom-up: the root last)")
    allowed = {"name", "sync_module_states", "require_reattach", "register_timeout",
               "backward_prefetch", "forward_prefetch", "limit_all_gathers", "reduce_op"}
    unknown = sorted(set(flatshard_kwargs) - allowed)
    if unknown:
        raise TypeError(f"fully_shard: unexpected argument(s) {', '.join(unknown)} (FlatShard"
                        f"Module arguments allowed here: {', '.join(sorted(allowed))})")
    mark = _Mark(reshard_after_forward, mp)
    if client is None:
        if flatshard_kwargs:
            raise ValueError(f"fully_shard: {', '.join(sorted(flatshard_kwargs))} only apply to "
                             f"the root's call (the one with client=)")
        module.__dict__[_MARK] = mark
        module.register_forward_pre_hook(_unregistered_guard)
        return module
    return _register_root(module, client, mark, flatshard_kwargs)


def _owner_of(module: nn.Module) -> Optional[FlatShardModule]:
    """The live FlatShardModule whose model contains ``module``, if any."""
    from .fsdp import _WRAPPERS
    for w in list(_WRAPPERS):
        if id(module) in _wrap.module_paths(w.module):
            return w
    return None


def _unregistered_guard(module: nn.Module, args: Any) -> None:
    mark = module.__dict__.get(_MARK)
    if mark is not None and (mark.owner is None or mark.owner() is None):
        raise RuntimeError(f"fully_shard: {type(module).__name__} is marked as a unit but no "
                           f"root registered it: call fully_shard(root, client=client) on the "
                           f"model that contains it, last")


def _register_root(root: nn.Module, client: Any, mark: _Mark,
                   kwargs: Dict[str, Any]) -> nn.Module:
    paths = _wrap.module_paths(root)
    units: List[Tuple[str, nn.Module]] = []
    for m in root.modules():
        if m is root:
            continue
        if _WRAPPER in m.__dict__:
            raise ValueError(f"fully_shard: {paths[id(m)]} ({type(m).__name__}) is the root of "
                             f"a registered model already: only the outermost call gets client=")
        other = m.__dict__.get(_MARK)
        if other is None:
            continue
        path = paths[id(m)]
        if other.reshard_after_forward != mark.reshard_after_forward:
            raise ValueError(f"fully_shard: reshard_after_forward is {other.reshard_after_forward}"
                             f" on {path} ({type(m).__name__}) and {mark.reshard_after_forward} "
                             f"on the root: flatshard needs one value per registered model")
        if other.mp != mark.mp:
            raise ValueError(f"fully_shard: mp_policy of {path} ({type(m).__name__}) differs "
                             f"from the root's: flatshard needs one per registered model")
        units.append((path, m))
    strategy = (ShardingStrategy.FULL_SHARD if mark.reshard_after_forward
                else ShardingStrategy.SHARD_GRAD_OP)
    wrapper = FlatShardModule(root, client, use_orig_params=True, mixed_precision=mark.mp,
                              auto_wrap_policy=_wrap.ExplicitPolicy([p for p, _ in units]),
                              sharding_strategy=strategy, **kwargs)
    for _, m in units:
        m.__dict__[_MARK].owner = weakref.ref(wrapper)
    # The root holds its wrapper (not as a submodule: the wrapper holds the root as one).
    root.__dict__[_WRAPPER] = wrapper
    root.__dict__[_MARK] = mark
    root.__class__ = _root_class(type(root))
    return root


class FlatShardFSDPModule:
    """Mixed into the root's class by ``fully_shard`` (FSDP2's ``FSDPModule``): calls go
    through the FlatShardModule, which runs the module's own forward."""

    @property
    def flatshard(self) -> FlatShardModule:
        """The FlatShardModule that trains this model (state dicts, summons, checkpoints,
        ``no_sync``, ``clip_grad_norm_``, ``publish``...)."""
        return self.__dict__[_WRAPPER]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        w = self.flatshard
        if w._in_forward:  # the wrapper's own call of the module: run it
            return super().__call__(*args, **kwargs)
        return w(*args, **kwargs)

    def commit(self) -> int:
        """``FlatShardModule.commit``: collective, closes the step; the new generation."""
        return self.flatshard.commit()

    def step(self, optimizer: Any, closure: Any = None) -> int:
        """``optimizer.step(closure)`` then ``commit()``."""
        return self.flatshard.step(optimizer, closure)

    @property
    def generation(self) -> int:
        """The committed generation the shards hold (the step to resume from)."""
        return self.flatshard.generation

    def reattach(self) -> int:
        """``FlatShardModule.reattach``: after a failed step and joining again."""
        return self.flatshard.reattach()


_ROOT_CLASSES: Dict[type, type] = {}


def _root_class(cls: type) -> type:
    got = _ROOT_CLASSES.get(cls)
    if got is None:
        got = type(f"FlatShard{cls.__name__}", (FlatShardFSDPModule, cls),
                   {"__module__": cls.__module__})
        _ROOT_CLASSES[cls] = got
    return got
