"""``summon_full_params`` on ``FlatShardModule`` (a mixin of it): the units at a path
unsharded into full parameters for the body of a ``with`` block, written back (and committed)
at its end when ``writeback``; FSDP's rules and errors for when it may run."""
import contextlib
import warnings
from typing import Any, List

import torch.nn as nn

from ._shared import TrainingState, _in_backward

# FSDP's texts (torch/distributed/fsdp/_unshard_param_utils.py).
ERR_IN_FORWARD_BACKWARD = "Cannot manually unshard parameters during forward/backward"
ERR_NESTED_SUMMON = "Cannot manually unshard parameters when already unsharding parameters"


class _FullParams:
    """Mixed into FlatShardModule: uses its units, client, state and generation."""

    @contextlib.contextmanager
    def _summon(self, path: str, recurse: bool, writeback: bool, rank0_only: bool,
                offload_to_cpu: bool, with_grads: bool):
        self._recover()
        # As FSDP: refused during a forward or backward, allowed between them (a forward
        # whose backward has not started, or never will).
        if self._state == TrainingState.FORWARD_BACKWARD and (
                self._in_forward or self._bwd or _in_backward()):
            raise AssertionError(ERR_IN_FORWARD_BACKWARD)
        if self._state == TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError(ERR_NESTED_SUMMON)
        # Between a forward and its backward: the summons kept for the backward (the root's,
        # SHARD_GRAD_OP's) end here, as the daemon unshards a unit once per rank; a backward
        # that follows summons them again.
        self._release_kept(end_now=True)
        if offload_to_cpu and not rank0_only and writeback:
            # FSDP warns always; flatshard only when more than one host copy may exist (a
            # writeback summon gives every rank its own copy; read-only ones share one).
            warnings.warn("offload_to_cpu=True and rank0_only=False with writeback=True gives "
                          "every rank its own host copy of the unsharded parameters")
        prev, self._state = self._state, TrainingState.SUMMON_FULL_PARAMS
        installed: List[Any] = []  # the units' _Params whose sites hold full parameters
        # Mixed precision: buffers are full precision inside too (state dicts, as FSDP's).
        full_buffers = self._mp.full_precision_buffers()
        full_buffers.__enter__()
        try:
            s = self._client.summon(self._name, path, recurse=recurse, writeback=writeback,
                                    rank0_only=rank0_only, offload_to_cpu=offload_to_cpu,
                                    with_grads=with_grads)
            try:
                if s.has_views:
                    params = s.params
                    grads = s.grads if with_grads else {}
                    for unit in s.units:
                        for p in self._units[unit].params:
                            view = params[p.fqn]
                            if writeback:
                                full = nn.Parameter(view, requires_grad=p.param.requires_grad)
                            else:
                                # A read-only summon's tensor (writes raise, never segfault).
                                full = view.requires_grad_(p.param.requires_grad)
                            g = grads.get(p.fqn)
                            if g is not None:
                                full.grad = g
                            for m, attr in p.sites:
                                m._parameters[attr] = full
                            installed.append(p)
                yield
            finally:
                for p in installed:
                    for m, attr in p.sites:
                        m._parameters[attr] = p.param
                s.end()
            if writeback:  # a writeback End commits: its answer carries the new generation
                generation = getattr(s, "generation", None)
                if generation is None:  # an older daemon: ask (a local call)
                    generation = self._client.shard_views(self._name).generation
                self._generation = int(generation)
                self._mark_committed()  # the commit took this rank's in-place updates too
        finally:
            full_buffers.__exit__(None, None, None)
            self._state = prev  # IDLE, or a forward still waiting for its backward
