"""FSDP's ``sharding_strategy`` on ``FlatShardModule`` (a mixin of it), and the enum.

What each strategy changes:

- the daemon side (how a unit is sharded, how gradients are reduced) is the plan's: the
  policy's ``"sharding_strategy"`` (README "Sharding strategies": NO_SHARD all-reduces
  gradients). ``_HYBRID_SHARD_ZERO2`` is sent as ``HYBRID_SHARD``: the daemon runs both alike
  (they differ in the trainer only), and daemons without the newer name plan it too;
- the trainer side is when a unit is resharded: FULL_SHARD and HYBRID_SHARD release a unit's
  forward summon after its forward and summon it again for its backward (two all-gathers per
  unit and step), except the root unit's, kept for its backward as FSDP's; SHARD_GRAD_OP,
  _HYBRID_SHARD_ZERO2 and NO_SHARD keep the forward summon open until the unit's backward
  has used it (one all-gather per unit and step, more memory: every
  unit's full parameters from its forward until its backward, as FSDP's).
"""
import enum
from typing import Any, Dict, Optional, Tuple

import torch


class ShardingStrategy(enum.Enum):
    """As ``torch.distributed.fsdp.ShardingStrategy`` (torch's enum, or its names as strings,
    are accepted wherever this one is)."""
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"


# Strategies that keep a unit unsharded from its forward until its backward.
_KEEP_AFTER_FORWARD = {ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2,
                       ShardingStrategy.NO_SHARD}


def resolve_strategy(value: Any) -> ShardingStrategy:
    """flatshard's enum, torch's ``ShardingStrategy`` (by name: torch 1.13's FSDP does not
    import on every Python) or a name ("SHARD_GRAD_OP", case-insensitive); None: FULL_SHARD."""
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(value, ShardingStrategy):
        return value
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if isinstance(name, str):
        key = name.strip().upper()
        for s in ShardingStrategy:
            if s.name == key:
                return s
    raise ValueError(f"sharding_strategy: {value!r} is not one of "
                     f"{', '.join(s.name for s in ShardingStrategy)}")


def policy_strategy(strategy: ShardingStrategy) -> str:
    """The policy document's ``sharding_strategy`` (the planner's four names)."""
    if strategy == ShardingStrategy._HYBRID_SHARD_ZERO2:
        return ShardingStrategy.HYBRID_SHARD.value
    return strategy.value


class _Strategies:
    """Mixed into FlatShardModule: keeps forward summons open until the unit's backward when
    the strategy says so (``_kept``: unit -> (summon, flat buffer))."""

    _kept: Dict[int, Tuple[Any, torch.Tensor]]
    sharding_strategy: ShardingStrategy

    def _keep_after_forward(self, unit: int, got: Tuple[Any, ...]) -> bool:
        """After a unit's forward: True when its summon stays open for its backward (only
        when a backward will follow: gradients are recorded). The root unit's always does,
        as FSDP's root is not resharded after forward: its backward starts right away, so a
        second all-gather would only make every rank wait for it (nothing runs before it to
        hide it behind)."""
        root = self._units[unit].module is self.module
        if not (root or self.sharding_strategy in _KEEP_AFTER_FORWARD):
            return False
        if not torch.is_grad_enabled():
            return False
        if not self._units[unit].requires_grad or not self._in_forward:
            return False
        self._kept[unit] = (got[0], got[1])
        return True

    def _take_kept(self, unit: int) -> Optional[Tuple[Any, torch.Tensor]]:
        """The unit's kept forward summon, handed to its backward (or to its forward again
        when the module runs twice in one step), or None."""
        return self._kept.pop(unit, None)

    def _release_kept(self, end_now: bool = False) -> None:
        """Ends the kept summons no backward used (a forward without backward, the end of a
        backward that did not reach every unit, an abandoned step)."""
        kept, self._kept = self._kept, {}
        for s, _ in kept.values():
            if end_now:
                try:
                    s.end()
                except Exception:  # noqa: BLE001 - read-only: the daemon ends it with the
                    pass           # session at worst; the step's own calls report errors
            else:
                self._prefetch.release(s)
