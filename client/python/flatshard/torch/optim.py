"""``keep_optimizer_state(optimizer, model)``: a torch.optim optimizer whose per-parameter state
lives in the flatshard daemon, next to the shards it belongs to.

The daemon keeps named state buffers per unit and rank (``flatshard.Client.register_state``):
"shard" buffers with one element per element of the rank's shard, "scalar" buffers with one
element per unit. They survive the trainer, and they are part of every commit and rollback
exactly like the shards, so a restarted trainer resumes with the optimizer state of the last
committed step instead of a fresh one.

How the optimizer's state maps to them, for every parameter of
``model.sharded_parameters()`` (use_orig_params=False: one flat parameter per unit over its
whole shard; True: the original parameters, 1-D parts of the shard at known offsets):

- a state tensor with the parameter's shape (Adam's ``exp_avg`` / ``exp_avg_sq`` /
  ``max_exp_avg_sq``, SGD's ``momentum_buffer``, ...) is replaced by a view of the "shard"
  buffer of that name at the parameter's offset: the optimizer's in-place updates (``mul_``,
  ``add_``, ``addcmul_``, foreach variants) land in daemon memory;
- a 0-dim state tensor (Adam's ``step``, a tensor since torch 1.12) maps to the "scalar"
  buffer of that name. Parameters of one unit share that one value, so the parameter keeps
  a tensor of its own (torch increments it once per parameter) and the daemon's value is
  written from it after each ``optimizer.step()`` (from the unit's first parameter that has
  one) and read back into it before the next (so a rollback or a restart resumes at the
  committed value). All parameters of a unit normally step together; one that a step skips
  (no gradient) gets its unit's count;
- any other state (non-tensor values, other shapes) stays in the trainer, with a warning.

The optimizer creates its state as usual on its first ``step()``; right after it, the spec
(names, dtypes, shapes) is derived from that state, registered with the daemon and the values
copied in. A trainer that finds a spec registered already (it re-attached after a crash) gets
the daemon's values before its first step: the optimizer then starts from them (Adam's zeros
and step 0 are exactly its own initial state when nothing was committed yet). A state tensor
the trainer replaced (``optimizer.load_state_dict``) is copied into the daemon's buffer and
replaced by the view again before the next step.

Commit as usual (``model.step(optimizer)`` or ``optimizer.step(); model.commit()``): the
commit copies the state with the shards. Works with torch 1.13 and 2.x.
"""
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._tensors import dtype_name

__all__ = ["keep_optimizer_state", "DaemonOptimizerState"]


class _Slot:
    """Where one optimizer parameter lives: unit `unit`, elements [offset, offset + numel) of
    this rank's shard."""

    __slots__ = ("param", "unit", "offset", "numel")

    def __init__(self, param, unit, offset, numel):
        self.param, self.unit, self.offset, self.numel = param, unit, offset, numel


def _slots(model) -> Dict[int, _Slot]:
    out: Dict[int, _Slot] = {}
    for u in model._units:
        if not model._use_orig_params:
            if u.flat_param is not None:
                out[id(u.flat_param)] = _Slot(u.flat_param, u.index, 0, u.shard_numel)
            continue
        for p in u.params:
            lo = max(p.offset, u.shard_offset)
            hi = min(p.offset + p.numel, u.shard_offset + u.shard_numel)
            if id(p.param) not in out:
                out[id(p.param)] = _Slot(p.param, u.index, lo - u.shard_offset if hi > lo else 0,
                                         max(0, hi - lo))
    return out


class DaemonOptimizerState:
    """The link between one optimizer and the daemon's state buffers of one FlatShardModule
    (made by ``keep_optimizer_state``). ``specs``: the registered spec, [(name, dtype name,
    "shard" | "scalar")], None until the optimizer's first step; ``kept_local``: state names
    left in the trainer. ``detach()`` gives the optimizer its own ``step`` back (the state
    tensors stay views of daemon memory)."""

    def __init__(self, optimizer, model):
        self.optimizer = optimizer
        self.model = model
        self.specs: Optional[List[Tuple[str, str, str]]] = None
        self.kept_local: List[str] = []
        self._views: Dict[int, Any] = {}   # unit -> UnitShard (with .state(name))
        self._bound: Dict[Tuple[int, str], torch.Tensor] = {}  # (id(param), name) -> tensor
        self._slots = _slots(model)
        self._orig_step = optimizer.step
        self._warned = set()
        existing = self._registered_specs()
        if existing:
            self._attach(existing, initial=True)
        optimizer.step = self._step

    # ------------------------------------------------------------------ public
    @property
    def attached(self) -> bool:
        return self.specs is not None

    def detach(self) -> None:
        self.optimizer.step = self._orig_step

    def state_views(self, unit: int) -> Dict[str, torch.Tensor]:
        """The daemon's state buffers of unit `unit` on this rank (name -> 1-D tensor)."""
        sh = self._views.get(unit)
        return {} if sh is None else sh.states

    # ------------------------------------------------------------------ internals
    def _registered_specs(self):
        try:
            views = self.model.client.shard_views(self.model.registered_name)
        except Exception:  # noqa: BLE001 - e.g. a rollback in progress: decided at the step
            return None
        return [tuple(s) for s in views.state_specs] or None

    def _params(self, with_group=False):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                slot = self._slots.get(id(p))
                if slot is not None:
                    yield (p, slot, group) if with_group else (p, slot)

    def _holds_state(self) -> bool:
        """Whether the optimizer holds a state tensor for one of this model's parameters."""
        return any(isinstance(v, torch.Tensor)
                   for p, _slot in self._params()
                   for v in self.optimizer.state.get(p, {}).values())

    def _derive_specs(self) -> List[Tuple[str, str, str]]:
        found: Dict[str, Tuple[str, str]] = {}
        local = set()
        for p, _slot in self._params():
            for name, value in self.optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    local.add(name)
                    continue
                shape = "scalar" if value.dim() == 0 else (
                    "shard" if value.shape == p.shape else None)
                if shape is None:
                    local.add(name)
                    continue
                try:
                    spec = (dtype_name(value.dtype), shape)
                except ValueError:
                    local.add(name)
                    continue
                if found.setdefault(name, spec) != spec:
                    local.add(name)  # e.g. a state that is a scalar here, a tensor there
        for name in local:
            found.pop(name, None)
        self.kept_local = sorted(local)
        if self.kept_local:
            warnings.warn(f"keep_optimizer_state: state {self.kept_local} of "
                          f"{type(self.optimizer).__name__} stays in the trainer (not a "
                          f"tensor of the parameter's shape nor a 0-dim one)")
        return [(name, dtype, shape) for name, (dtype, shape) in sorted(found.items())]

    def _attach(self, specs, initial: bool) -> None:
        views = self.model.client.register_state(self.model.registered_name, list(specs))
        self.specs = [tuple(s) for s in views.state_specs]
        self._views = {sh.unit: sh for sh in views}
        self._bind(from_daemon=initial)

    def _bind(self, from_daemon: bool) -> None:
        """Makes every parameter's state tensors views of the daemon's buffers. A tensor that
        is not the view yet (created by the optimizer, or loaded) is copied in, unless
        `from_daemon` (re-attach before the first step: the daemon's values win)."""
        with torch.no_grad():
            for p, slot, group in self._params(with_group=True):
                state = self.optimizer.state[p]  # a defaultdict: created when missing
                sh = self._views.get(slot.unit)
                if sh is None:
                    continue
                for name, _dtype, shape in self.specs:
                    if name in self.kept_local:
                        continue
                    buf = sh.state(name)
                    cur = state.get(name)
                    if shape == "shard":
                        view = buf.narrow(0, slot.offset, slot.numel).view(p.shape)
                        if cur is not None and cur.data_ptr() == view.data_ptr() and \
                                cur.shape == view.shape and cur.numel() > 0:
                            continue
                        if cur is not None and not from_daemon and cur.shape == view.shape:
                            view.copy_(cur)
                        state[name] = view
                    else:
                        # A 0-dim tensor of the parameter's own (see the module docstring).
                        key = (id(p), name)
                        if cur is None or from_daemon:
                            # Where torch keeps it: on the host unless the optimizer runs
                            # capturable or fused (then on the parameter's device).
                            on_device = group.get("capturable") or group.get("fused")
                            cur = buf[0].detach().to(p.device if on_device else "cpu",
                                                     copy=True)
                            state[name] = cur
                            self._bound[key] = cur
                        elif self._bound.get(key) is not cur:  # the optimizer's, or loaded
                            self._bound[key] = cur
                            buf.fill_(cur.item())

    def _sync_scalars(self, to_daemon: bool) -> None:
        scalars = [s[0] for s in self.specs if s[2] == "scalar" and s[0] not in self.kept_local]
        if not scalars:
            return
        written = set()
        with torch.no_grad():
            for p, slot in self._params():
                sh = self._views.get(slot.unit)
                state = self.optimizer.state.get(p)
                if sh is None or not state:
                    continue
                for name in scalars:
                    cur = state.get(name)
                    if not isinstance(cur, torch.Tensor):
                        continue
                    buf = sh.state(name)
                    if to_daemon:
                        if (slot.unit, name) not in written:
                            buf.fill_(cur.item())
                            written.add((slot.unit, name))
                    elif self._bound.get((id(p), name)) is cur:
                        cur.fill_(buf[0].item())

    def _step(self, *args, **kwargs):
        if self.specs is None:
            # State registered since this link was made: by a checkpoint load into a module
            # without state, or by another rank's first step (ranks register the same spec).
            # The daemon's values win, as on a re-attach, unless this optimizer holds state
            # already (optimizer.load_state_dict): then its values go to the daemon.
            existing = self._registered_specs()
            if existing:
                self._attach(existing, initial=not self._holds_state())
        if self.specs is not None:
            # Tensors the trainer replaced (load_state_dict) go to the daemon; the scalars
            # come from it (after a rollback it holds the committed step's).
            self._bind(from_daemon=False)
            self._sync_scalars(to_daemon=False)
        out = self._orig_step(*args, **kwargs)
        if self.specs is None:
            self._attach(self._derive_specs(), initial=False)
        self._sync_scalars(to_daemon=True)
        return out


def keep_optimizer_state(optimizer: torch.optim.Optimizer, model) -> DaemonOptimizerState:
    """Keeps `optimizer`'s per-parameter state in the daemon, next to the shards of `model`
    (a FlatShardModule whose ``sharded_parameters()`` the optimizer steps; see the module
    docstring). Call it once after creating the optimizer, before its first step, on every
    rank; a restarted trainer calls it the same way and its optimizer resumes from the
    committed step's state. Returns the link (``.specs``, ``.state_views(unit)``)."""
    if getattr(optimizer, "_flatshard_state", None) is not None:
        raise RuntimeError("keep_optimizer_state: this optimizer's state is kept already")
    link = DaemonOptimizerState(optimizer, model)
    optimizer._flatshard_state = link
    return link
