"""State dicts and checkpoints of ``FlatShardModule`` (a mixin of it): full state dicts
through a summon, torch's ``state_dict``/``load_state_dict`` contract wherever the wrapper
sits, this rank's sharded state dict, and daemon checkpoints of the committed step."""
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, Optional

import torch
import torch.nn as nn

from ..errors import FailedPreconditionError
from ._shared import TrainingState

_SHARDED_META_KEY = "_flatshard_sharded"


class _StateDicts:
    """Mixed into FlatShardModule: uses its summons, plan, client and rank."""

    def full_state_dict(self, rank0_only: bool = False,
                        offload_to_cpu: bool = False) -> Dict[str, torch.Tensor]:
        """The unwrapped module's ``state_dict()`` (same keys, full values, copies). With
        rank0_only, ranks other than 0 get an empty dict (as FSDP)."""
        with self._summon("", True, False, rank0_only, offload_to_cpu, False):
            if rank0_only and self._rank() != 0:
                return {}
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, state_dict: Optional[Dict[str, torch.Tensor]],
                             rank0_only: bool = False, strict: bool = True) -> None:
        """Loads a full state dict (the unwrapped module's keys). Collective. With rank0_only,
        only rank 0's dict is read (others may pass None) and rank 0's values reach every
        shard (beyond FSDP); buffers are then loaded on rank 0 only."""
        with self._summon("", True, True, rank0_only, False, False):
            if rank0_only and self._rank() != 0:
                return
            if state_dict is None:
                raise ValueError("load_full_state_dict: state_dict is None on a rank that reads it")
            with torch.no_grad():
                self.module.load_state_dict(state_dict, strict=strict)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, torch.Tensor]:
        """torch's signature, FSDP's default (FULL_STATE_DICT): the unwrapped module's keys
        under ``prefix`` (no ``module.`` level, so an outer module's state_dict() has the
        keys a plain module there would give), full values as copies, on every rank.
        Collective. ``keep_vars``: parameters come back as Parameters (copies: the full
        values exist only inside a summon). See full_state_dict for rank0_only/offload."""
        if args:  # torch's deprecated positional form (destination, prefix, keep_vars)
            if len(args) > 3:
                raise TypeError(f"state_dict: at most 3 positional arguments, got {len(args)}")
            destination, prefix, keep_vars = (tuple(args) + (destination, prefix,
                                                             keep_vars)[len(args):])
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        with self._summon("", True, False, False, False, False):
            inner = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
            for k, v in inner.items():
                c = v.detach().clone()
                destination[k] = (nn.Parameter(c, requires_grad=v.requires_grad)
                                  if keep_vars and isinstance(v, nn.Parameter) else c)
        meta = getattr(destination, "_metadata", None)
        if meta is not None:
            meta.update(getattr(inner, "_metadata", {}))
        return destination

    def load_state_dict(self, state_dict: Any, strict: bool = True):
        """torch's: the unwrapped module's keys (as ``state_dict()`` gives them), full
        values, strict as torch; returns torch's (missing_keys, unexpected_keys). Collective:
        writes back into the shards and commits (``generation`` + 1)."""
        try:
            return super().load_state_dict(state_dict, strict)
        finally:
            self._end_load()  # an error escaped the walk before the post hook ended it

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # torch's load_state_dict (ours or an outer module's) walks into self.module next,
        # with the prefix "<prefix>module.": rename the keys to that (FSDP's pre-hook does
        # the same) and unshard with writeback, so the walk copies into the full parameters
        # with torch's own strict checks. The post hook ends the summon (write back, commit)
        # and names the keys in the reports without "module." again.
        self._end_load()
        for k in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[prefix + "module." + k[len(prefix):]] = state_dict.pop(k)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        cm = self._summon("", True, True, False, False, False)
        cm.__enter__()
        self._loading = (cm, prefix, [(lst, len(lst)) for lst in (missing_keys,
                                                                  unexpected_keys, error_msgs)])

    def _end_load(self) -> None:
        ctx, self._loading = self._loading, None
        if ctx is None:
            return
        cm, prefix, reports = ctx
        for lst, start in reports:
            lst[start:] = [x.replace(prefix + "module.", prefix) for x in lst[start:]]
        cm.__exit__(None, None, None)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's shards (copies, padded, one ``<unit path>.flat_param`` each) and its
        buffers, with the plan fingerprint, rank and world size to check on load."""
        out: Dict[str, Any] = {}
        for u in self._units:
            out[f"{u.path + '.' if u.path else ''}flat_param"] = u.shard.detach().clone()
        for k, v in self.module.state_dict().items():
            if k not in self._managed_fqns:  # buffers and ignored modules' parameters
                out[k] = v.detach().clone()
        out[_SHARDED_META_KEY] = {"fingerprint": self._plan.get("fingerprint"),
                                  "rank": self._rank(), "world_size": self._world_size()}
        return out

    def load_sharded_state_dict(self, sd: Dict[str, Any]) -> None:
        """Copies a ``sharded_state_dict()`` of this rank back into the shards (local: every
        rank loads its own; not collective)."""
        meta = sd.get(_SHARDED_META_KEY)
        if not isinstance(meta, dict):
            raise ValueError(f"load_sharded_state_dict: no {_SHARDED_META_KEY!r} entry")
        for key, want in (("fingerprint", self._plan.get("fingerprint")), ("rank", self._rank()),
                          ("world_size", self._world_size())):
            if meta.get(key) != want:
                raise ValueError(f"load_sharded_state_dict: {key} is {meta.get(key)!r}, this "
                                 f"rank's is {want!r}")
        with torch.no_grad():
            for u in self._units:
                key = f"{u.path + '.' if u.path else ''}flat_param"
                t = sd.get(key)
                if t is None or tuple(t.shape) != (u.shard_numel,):
                    raise ValueError(f"load_sharded_state_dict: {key}: want shape "
                                     f"({u.shard_numel},), got "
                                     f"{None if t is None else tuple(t.shape)}")
                u.shard.copy_(t)
            self._note_writes(force=True)  # new shard values, not committed yet
            local = {k: v for k, v in self.module.state_dict().items()
                     if k not in self._managed_fqns}
            missing = sorted(set(local) - set(sd))
            if missing:
                raise ValueError(f"load_sharded_state_dict: missing {missing}")
            for k, v in local.items():
                v.copy_(sd[k])

    # ------------------------------------------------------------------ checkpoints
    # (README "Checkpoints"). Not collective: the daemon writes or loads every rank's shards.
    def save_checkpoint(self, directory: str,
                        progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
        """Asks the daemon to write this module's committed step (the last ``commit()``, the
        same generation on every rank) to `directory` (flatshard.checkpoint/1). Call it on
        one rank; the others may go on (a commit landing during the write waits for it).
        Returns the daemon's report (generation, bytes, files, ranks, path).
        Raises FailedPreconditionError, writing nothing, while this rank's parameters hold
        optimizer steps not committed yet (``uncommitted_steps``): the checkpoint would
        silently hold the older committed generation. Commit first.
        `progress`: None, or ``progress(bytes_done, bytes_total)``, called on this thread as
        the daemon reports (``flatshard.Client.save_checkpoint``)."""
        self._note_writes()
        if self._uncommitted:
            n = self._uncommitted
            raise FailedPreconditionError(
                f"save_checkpoint: this rank's shards hold {n} uncommitted optimizer "
                f"step{'' if n == 1 else 's'} (in-place parameter updates since generation "
                f"{self._generation} was committed); the checkpoint would hold generation "
                f"{self._generation}, not what was trained. Call model.commit() on every rank "
                f"after optimizer.step() (or model.step(optimizer)), then save")
        return self._client.save_checkpoint(self._name, directory, progress)

    def load_checkpoint(self, directory: Optional[str] = None, *,
                        safetensors: Optional[str] = None,
                        progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
        """Loads a checkpoint directory (any world size or wrap policy) or a safetensors
        file of the full model into this module on every rank: a committed step, whose
        generation becomes the checkpoint's (a safetensors import: +1). Call it on one rank,
        outside forward/backward and with no summon open on any rank; it reads this rank's
        views again. Every other rank then calls ``refresh_views()`` once the load returned
        (after a barrier of the trainer's own, e.g. ``torch.distributed.barrier()``): until
        it does, its commits are refused (its in-place writes predate the load).
        `progress`: None, or ``progress(bytes_done, bytes_total)``, called on this thread as
        the daemon reports (``flatshard.Client.load_checkpoint``). If it raises, the load still
        runs to its end and this rank's views are read again before its exception propagates
        (the module is then at the loaded generation, as after a plain load)."""
        if (directory is None) == (safetensors is None):
            raise ValueError("load_checkpoint: give exactly one of directory and safetensors")
        try:
            if directory is not None:
                info = self._client.load_checkpoint(self._name, directory, progress)
            else:
                info = self._client.import_safetensors(self._name, safetensors, progress)
        except BaseException as e:  # noqa: B036 - e.g. KeyboardInterrupt from progress
            if getattr(e, "flatshard_checkpoint", None) is not None:  # progress raised
                self.refresh_views()
            raise
        self.refresh_views()
        return info


    # ------------------------------------------------------------------ publishing
    # (README "Publishing weights"). Collective: every rank calls it, with the same arguments.
    def publish(self, name: str, dtype: Any = None, *, reader_uids: Iterable[int] = (),
                reader_token: Optional[str] = None, commit: bool = False,
                device: Optional[int] = None) -> Any:
        """Publishes this module's committed step as the next version of the weights
        ``name`` for inference processes on the node (``flatshard.weights.open(name)``):
        the full parameters under the unwrapped module's ``state_dict()`` keys (tied
        parameters under every key; buffers and ignored modules' parameters are not in the
        daemon, so not in the version), cast to ``dtype`` (e.g. ``torch.bfloat16``; None:
        as trained). Nothing is gathered here: the daemon builds the version from its
        committed copies, and training may go on at once. Readers: this uid, the uids in
        ``reader_uids`` and whoever presents ``reader_token``. Returns the
        ``flatshard.weights.PublishedVersion``. ``device``: a GPU ordinal of the daemon to
        place the version in device memory (``Client.publish``); None: host memory.

        Only committed steps are published. A trainer that ends each step with
        ``model.step(optimizer)`` (or ``commit()``) publishes its last step as is. One that
        calls ``optimizer.step()`` alone (FSDP's loop) passes ``commit=True``: every rank
        commits its pending step first (a collective commit, +1 generation), then publishes.
        Without it, a rank whose parameters hold uncommitted optimizer steps raises
        FailedPreconditionError before publishing (as ``save_checkpoint``) instead of
        silently publishing an older generation; the other ranks' publish then fails too,
        naming this rank, once their deadline passes."""
        self._recover()  # as commit(): a failed step's leftovers, deferred summon Ends
        if self._state != TrainingState.IDLE:
            raise AssertionError("FlatShardModule.publish: called inside a forward/backward "
                                 "or summon_full_params")
        if commit:
            self.commit()
        else:
            self._note_writes()
            if self._uncommitted:
                n = self._uncommitted
                raise FailedPreconditionError(
                    f"publish {name!r}: this rank's shards hold {n} uncommitted optimizer "
                    f"step{'' if n == 1 else 's'} (in-place parameter updates since generation "
                    f"{self._generation} was committed); the version would hold generation "
                    f"{self._generation}, not what was trained. Pass commit=True (on every "
                    f"rank), or end each step with model.step(optimizer)")
        return self._client.publish(self._name, name, dtype=dtype, reader_uids=reader_uids,
                                    reader_token=reader_token, device=device)


def _load_post_hook(module: Any, incompatible_keys: Any) -> None:
    module._end_load()
