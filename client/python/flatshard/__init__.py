"""flatshard: the Python client of flatshardd (PyTorch FSDP's FlatParameter as a service).

A binding of the C++ client library (flatshard._C over client/include/flatshard/client.h);
parameter bytes stay in the daemon's shared memory and come out as zero-copy torch tensors,
numpy arrays and memoryviews. The core (Client, errors, memoryview and numpy views) runs
without torch; tensor views import it on first use, flatshard.torch needs it.

    import flatshard
    c = flatshard.Client("unix:/run/flatshard/flatshardd.sock")
    c.join("job-17", world_size, rank, token)
    reg = c.register("", manifest_json, policy_json, init="from_rank0")
    if reg.init_summon is not None:
        if rank == 0:
            for fqn, t in reg.init_summon.params.items():
                t.copy_(initial[fqn])
        reg.init_summon.end()
    with c.summon("", "layers.0") as s:          # unshard; written back and resharded on exit
        s.params["layers.0.weight"].mul_(0.5)
    c.reduce_scatter_grads("", unit, flat_grad)  # each rank keeps its slice
    shards = c.shard_views("")                    # the optimizer's view (.generation)
    # ... the optimizer updates the shards in place ...
    st = c.register_state("", [("exp_avg", "float32", "shard")])  # optimizer state buffers
    st[0].state("exp_avg")                        # in the daemon, committed with the shards
    c.commit("")                                  # collective: closes the step
    c.publish("", "policy")                       # collective: the committed step, for readers
    c.leave(); c.close()

Published weights are read by any granted process of the node with flatshard.weights
(``flatshard.weights.open("policy")``: a read-only mapping FQN -> zero-copy tensor).

Errors are flatshard.FlatshardError subclasses carrying .code (gRPC code name) and .message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._C import FinishingReduceScatter
from ._client import (Client, PendingReduceScatter, PendingSummon, Registered, ShardViews,
                      Summoned, UnitShard)
from .errors import (AbortedError, AlreadyExistsError, DeadlineExceededError,
                     FailedPreconditionError, FlatshardError, InternalError,
                     InvalidArgumentError, NotFoundError, PermissionDeniedError,
                     ReadOnlyViewError, ResourceExhaustedError, ShardsLostError,
                     UnavailableError)

if TYPE_CHECKING:
    from . import testing, weights
    from ._tensors import ReadOnlyTensor

# ReadOnlyTensor (a torch.Tensor subclass) is left out so that `from flatshard import *` works
# without torch; `flatshard.ReadOnlyTensor` imports torch on first use (__getattr__ below).
__all__ = [
    "Client", "Registered", "Summoned", "PendingSummon", "PendingReduceScatter",
    "FinishingReduceScatter", "ShardViews",
    "UnitShard",
    "ReadOnlyViewError",
    "FlatshardError", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError",
    "PermissionDeniedError", "FailedPreconditionError", "AbortedError", "UnavailableError",
    "DeadlineExceededError", "ResourceExhaustedError", "InternalError", "ShardsLostError",
]


def __getattr__(name: str) -> Any:  # imported on first use: testing, weights, ReadOnlyTensor
    import importlib
    if name in ("testing", "weights"):
        return importlib.import_module(".testing", __name__)
    if name == "ReadOnlyTensor":
        from ._optional import tensors
        return tensors("flatshard.ReadOnlyTensor").ReadOnlyTensor
    raise AttributeError(f"module 'flatshard' has no attribute {name!r}")
