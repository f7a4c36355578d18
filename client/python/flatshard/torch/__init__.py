"""``flatshard.torch``: PyTorch FSDP's API over a flatshard daemon.

- ``manifest_of(module)``: the ``flatshard.manifest/1`` of an ``nn.Module``;
- policies: ``size_based_auto_wrap_policy``, ``ModuleWrapPolicy``, ``always_wrap_policy``,
  ``transformer_auto_wrap_policy``, ``lambda_auto_wrap_policy`` (and any FSDP-style callable,
  resolved to explicit paths); ``policy_json(...)`` builds the whole policy document;
- ``FlatShardModule(module, client, auto_wrap_policy=..., ignored_modules=...,
  sync_module_states=..., use_orig_params=..., backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
  forward_prefetch=False, sharding_strategy=ShardingStrategy.FULL_SHARD)``: trains with
  FSDP's semantics, the next unit's all-gather overlapping this unit's compute;
  ``model.step(opt)`` (``opt.step()`` + ``model.commit()``) commits each step, and
  ``model.generation`` is the committed step a re-attaching trainer resumes from;
- ``keep_optimizer_state(optimizer, model)``: the optimizer's per-parameter state (Adam's
  moments and step, SGD's momentum) lives in the daemon next to the shards, commits and rolls
  back with them, and a restarted trainer resumes with it;
- ``full_optim_state_dict(model, optim, rank0_only=True)`` / ``optim_state_dict(model, optim)``
  and ``optim_state_dict_to_load(model, optim, osd)``: the optimizer's state keyed like the
  unwrapped model's, for a plain ``torch.optim`` optimizer and back (optim_state_dicts.py);
- ``summon_full_params(model, recurse=True, writeback=True, rank0_only=False,
  offload_to_cpu=False, with_grads=False)``; full and sharded state dicts on the wrapper;
- ``fully_shard(module, client=..., reshard_after_forward=True, mp_policy=None)``: FSDP2's
  entry point (bottom-up: units first, the root with ``client`` last) over FlatShardModule
  (fully_shard.py);
- ``model.publish(name, dtype=None, ...)``: the committed step as the next version of the
  published weights ``name``, for inference processes (``flatshard.weights.open(name)``).

See the README's "PyTorch" section.
"""
__all__ = [
    "manifest_json", "manifest_of", "ModuleWrapPolicy", "always_wrap_policy",
    "lambda_auto_wrap_policy", "policy_json", "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy", "ERR_IN_FORWARD_BACKWARD", "ERR_NESTED_SUMMON",
    "FlatShardModule", "TrainingState", "summon_full_params", "keep_optimizer_state",
    "DaemonOptimizerState", "BackwardPrefetch", "MixedPrecision", "ShardingStrategy",
    "full_optim_state_dict", "optim_state_dict", "optim_state_dict_to_load",
    "shard_full_optim_state_dict", "fully_shard", "FlatShardFSDPModule", "MixedPrecisionPolicy",
]

from .manifest import manifest_json, manifest_of  # noqa: F401
from .wrap import (  # noqa: F401
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    policy_json,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from .fsdp import (  # noqa: F401
    ERR_IN_FORWARD_BACKWARD,
    ERR_NESTED_SUMMON,
    FlatShardModule,
    TrainingState,
    summon_full_params,
)
from .optim import DaemonOptimizerState, keep_optimizer_state  # noqa: F401
from .mixed_precision import MixedPrecision  # noqa: F401
from .prefetch import BackwardPrefetch  # noqa: F401
from .strategies import ShardingStrategy  # noqa: F401
from .optim_state_dicts import (  # noqa: F401
    full_optim_state_dict,
    optim_state_dict,
    optim_state_dict_to_load,
    shard_full_optim_state_dict,
)
from .fully_shard import FlatShardFSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401

# FSDP spells them as static methods of the wrapper class.
FlatShardModule.full_optim_state_dict = staticmethod(full_optim_state_dict)
FlatShardModule.optim_state_dict = staticmethod(optim_state_dict)
FlatShardModule.optim_state_dict_to_load = staticmethod(optim_state_dict_to_load)
FlatShardModule.shard_full_optim_state_dict = staticmethod(shard_full_optim_state_dict)
