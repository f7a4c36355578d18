"""The rest of FSDP's training recipe on ``FlatShardModule`` (a mixin of it): gradient
accumulation without communication (``no_sync``), gradient clipping
(``clip_grad_norm_``, one all-reduce) and ``sync_module_states``' buffer broadcast. The wrapper's backward calls ``_accumulate_locally`` inside
``no_sync`` and adds the sums to its next reduce-scatter (``fsdp.py``)."""
import contextlib
import math
from typing import Any, Iterator, Optional, Tuple

import torch

from ._shared import TrainingState, _plain

# Client.broadcast's limit per call.
_BROADCAST_PIECE = 64 << 20


class _TrainingRecipe:
    """Mixed into FlatShardModule: uses its units, client, state and step bookkeeping."""

    def _accumulate_locally(self, u: Any, grads: Tuple[Optional[torch.Tensor], ...]) -> None:
        acc = self._accum.get(u.index)
        if acc is None:
            acc = torch.zeros(u.padded_numel, dtype=u.flat_param.dtype)
            self._accum[u.index] = acc
        with torch.no_grad():
            for p, g in zip(u.params, grads):
                if g is not None:
                    acc.narrow(0, p.offset, p.numel).view(p.shape).add_(g)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """As FSDP's ``clip_grad_norm_``: the ``norm_type`` norm (``math.inf`` too) of the
        gradients of every rank's shards together, returned as a float32 tensor (bit-identical
        on every rank); when it exceeds ``max_norm``, every rank scales its gradient shards
        in place by ``max_norm / (total_norm + 1e-6)``. Units whose ``.grad`` is None (e.g.
        after ``zero_grad(set_to_none=True)``) count as no gradient. Collective: every rank
        calls it, with the same arguments.

        As FSDP: each rank computes the norm of its gradient shards (float32), and ONE
        all-reduce of one value per rank (``Client.all_reduce``: the sum of the p-th powers,
        or the max for ``inf``) gives the total; no gradient moves."""
        if self._state != TrainingState.IDLE:
            raise AssertionError("FlatShardModule.clip_grad_norm_: called inside a "
                                 "forward/backward or summon_full_params")
        max_norm, norm_type = float(max_norm), float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"clip_grad_norm_: norm_type must be > 0, got {norm_type}")
        with_grads = [u for u in self._units
                      if u.requires_grad and u.grad_shard is not None and self._has_grads(u)]
        inf = norm_type == math.inf
        norms = []
        for u in with_grads:
            g = _plain(u.grad_shard)
            if g.numel() == 0:
                continue
            norms.append(g.abs().max().float() if inf
                         else torch.linalg.vector_norm(g, norm_type, dtype=torch.float32))
        if not norms:
            local = torch.zeros((), dtype=torch.float32)
        elif inf:
            local = torch.stack(norms).max()
        else:
            local = torch.linalg.vector_norm(torch.stack(norms), norm_type) ** norm_type
        if not inf and self._replica_index() > 0:
            # NO_SHARD and HYBRID_*: the ranks of other replicas hold the same shards; each
            # shard counts once (the max of inf is not changed by copies).
            local = torch.zeros((), dtype=torch.float32)
        total = self._client.all_reduce(local.reshape(1).clone(), "max" if inf else "sum")[0]
        if not inf:
            total = total ** (1.0 / norm_type)
        clip_coef = max_norm / (total + 1e-6)
        if clip_coef < 1:
            with torch.no_grad():
                for u in with_grads:
                    u.grad_shard.mul_(clip_coef.to(u.grad_shard.dtype))
                    low = u.flat_param.grad  # keep_low_precision_grads: a copy to scale too
                    if low is not None and low.data_ptr() != u.grad_shard.data_ptr():
                        low.mul_(clip_coef.to(low.dtype))
        return total

    def _replica_index(self) -> int:
        """Which copy of its shard this rank holds: rank // shard_world_size (0 for every rank
        of FULL_SHARD and SHARD_GRAD_OP; the rank itself under NO_SHARD)."""
        sws = int(self._plan.get("shard_world_size", 0) or 0)
        return self._rank() // sws if sws > 0 else 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As FSDP's ``no_sync()``: the backward passes run inside it reduce-scatter
        nothing; each unit's full (unsharded) gradient is summed in this process instead
        (memory: one full-size buffer per unit, as FSDP's), and the first backward outside
        reduce-scatters the sum with its own gradients, once per unit. A unit that backward
        does not reach reduce-scatters its sum alone at its end. Sharded ``.grad`` do not
        change inside. Every rank must use it alike: the collectives must match."""
        if self._state != TrainingState.IDLE:
            raise AssertionError("FlatShardModule.no_sync: called inside a forward/backward "
                                 "or summon_full_params")
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _sync_buffers(self) -> None:
        """sync_module_states for buffers (FSDP broadcasts them with the parameters): rank 0's
        buffer bytes to every rank with ``Client.broadcast`` (bit for bit, any dtype), in
        pieces of at most 64 MiB. Buffers of ignored modules stay as they are. Collective."""
        ignored = {id(b) for m in self._ignored for b in m.buffers()}
        bufs = [b for b in self.module.buffers() if id(b) not in ignored]
        if not bufs:
            return
        with torch.no_grad():
            data = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in bufs])
            for lo in range(0, data.numel(), _BROADCAST_PIECE):
                self._client.broadcast(data.narrow(0, lo, min(_BROADCAST_PIECE,
                                                              data.numel() - lo)), 0)
            pos = 0
            for b in bufs:
                nb = b.numel() * b.element_size()
                b.copy_(data.narrow(0, pos, nb).clone().view(b.dtype).view(b.shape))
                pos += nb
