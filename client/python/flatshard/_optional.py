"""torch, optional for the core: flatshard.Client, its errors and the memoryview (and numpy)
views run without it; tensor views import flatshard._tensors (and so torch) on first use."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["tensors"]


def tensors(feature: str) -> ModuleType:
    """flatshard._tensors, imported now; an ImportError naming torch and `feature` when this
    Python has no torch."""
    try:
        return importlib.import_module("flatshard._tensors")
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "numpy"):
            raise
        raise ImportError(
            f"flatshard: {feature} needs {e.name!r} (torch tensors over the daemon's memory), "
            f"which this Python cannot import: install it (pip install torch), or use the "
            "views that need neither: Summoned.memoryview_params, UnitShard.memoryview_shard",
            name=e.name) from e
