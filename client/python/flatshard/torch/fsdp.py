"""``FlatShardModule``: PyTorch FSDP's API (FULL_SHARD) over a flatshard daemon.

One trainer process per rank. The daemon owns every unit's shard and gradient shard; the
trainer holds no parameter memory of its own between uses:

- before a unit's forward its full parameters are summoned (read-only: ranks on one node share
  one copy) and the module's parameters become views into that memory; after the forward they
  are released;
- autograd saves no reference to that memory: a ``saved_tensors_hooks`` pair packs every saved
  tensor that lies in a unit's summoned buffer as (unit, offset, size, stride), and unpacking it
  in backward summons the unit again (the pre-backward unshard) and rebuilds the tensor there;
- the unit's parameter views come out of one autograd function (``_UnitParams``, FSDP's
  ``FlatParameter`` split) whose backward runs once every gradient of the unit is complete: it
  writes them straight into the daemon's gradient buffer (``begin_reduce_scatter``: no other
  copy), reduce-scatters it (AVG, as FSDP) and releases the backward summon;
- ``sharded_parameters()`` are parameters over this rank's shards with ``.grad`` over the
  gradient shards: any ``torch.optim`` optimizer steps them in place;
- ``model.step(optimizer)`` (or ``optimizer.step(); model.commit()``) closes the training step
  with a collective commit (``flatshard.Client.commit``): after a crash every rank's shards are
  rolled back to the last committed step, which ``model.generation`` reports.
"""
import contextlib
import json
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ShardsLostError
from . import manifest as _manifest
from . import wrap as _wrap
from ._shared import TrainingState, _flatten, _in_backward, _plain, register_retrying
from .full_params import ERR_IN_FORWARD_BACKWARD, ERR_NESTED_SUMMON, _FullParams
from .mixed_precision import MixedPrecision, _cast_floating, _Precision, _set_grad
from .prefetch import BackwardPrefetch, _Prefetcher
from .recipe import _TrainingRecipe
from .state_dicts import _StateDicts, _load_post_hook
from .strategies import _Strategies, policy_strategy, resolve_strategy


# Every live FlatShardModule, weakly (summon_full_params maps a submodule to its wrapper).
_WRAPPERS: "weakref.WeakSet[FlatShardModule]" = weakref.WeakSet()


class _Param:
    """One distinct parameter of a unit (in flat order) and every place it is registered."""

    def __init__(self, fqn: str, shape: Tuple[int, ...], offset: int, numel: int):
        self.fqn = fqn
        self.shape = shape
        self.offset = offset
        self.numel = numel
        self.sites: List[Tuple[nn.Module, str]] = []  # (module, attribute name), fqn first
        self.fqns: List[str] = [fqn]                   # fqn and its tied aliases
        self.param: Optional[nn.Parameter] = None      # the original Parameter object


class _Unit:
    def __init__(self, index: int, plan_unit: Dict[str, Any]):
        self.index = index
        self.path: str = plan_unit["module"]
        self.padded_numel = int(plan_unit["padded_numel"])
        self.shard_numel = int(plan_unit["shard_numel"])
        self.requires_grad = bool(plan_unit.get("requires_grad", True))
        # Mixed precision: the daemon hands the unit out in this dtype for compute.
        self.dtype_name: str = plan_unit["dtype"]
        self.low_precision = plan_unit.get("compute_dtype", self.dtype_name) != self.dtype_name
        self.params: List[_Param] = []
        self.module: Optional[nn.Module] = None
        self.shard: Optional[torch.Tensor] = None  # this rank's shard (1-D, padded)
        self.shard_offset = 0
        self.gaps: List[Tuple[int, int]] = []  # [start, end) of padding in the flat buffer
        self.flat_param: Optional[nn.Parameter] = None  # use_orig_params=False: the optimizer's
        self.grad_shard: Optional[torch.Tensor] = None  # this rank's gradient shard, once made

    def compute_gaps(self) -> None:
        pos = 0
        for p in sorted(self.params, key=lambda q: q.offset):
            if p.offset > pos:
                self.gaps.append((pos, p.offset))
            pos = max(pos, p.offset + p.numel)
        if pos < self.padded_numel:
            self.gaps.append((pos, self.padded_numel))


class _Packed:
    """A saved tensor that lies in a unit's summoned buffer, recorded by position."""
    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit: int, offset: int, size, stride):
        self.unit = unit
        self.offset = offset
        self.size = size
        self.stride = stride


class _UnitParams(torch.autograd.Function):
    """Splits a unit's flat buffer into its parameters' views (FSDP's FlatParameter split).
    Backward receives the gradient of every parameter of the unit at once and hands them to
    the wrapper, which writes them into the daemon's gradient buffer and reduce-scatters."""

    @staticmethod
    def forward(ctx, wrapper, unit, dummy, flat):
        ctx.wrapper = wrapper
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(flat.narrow(0, p.offset, p.numel).view(p.shape)
                     for p in wrapper._units[unit].params)

    @staticmethod
    def backward(ctx, *grads):
        ctx.wrapper._post_backward(ctx.unit, grads)
        return None, None, None, None


class FlatShardModule(_Strategies, _TrainingRecipe, _StateDicts, _FullParams, nn.Module):
    """Wraps ``module`` and trains it with FSDP's semantics on a flatshard daemon.

    ``client`` is a joined ``flatshard.Client``. Every rank constructs the wrapper with the same
    module structure and arguments (it registers collectively). Arguments as FSDP's where they
    apply:

    - ``auto_wrap_policy``: None (one unit), a helper of ``flatshard.torch.wrap``
      (``size_based_auto_wrap_policy(min_num_params=...)``, ``ModuleWrapPolicy({...})``,
      ``always_wrap_policy``) or any FSDP-style callable (resolved to explicit paths).
    - ``ignored_modules``: modules left alone (their parameters stay ordinary local tensors).
    - ``sync_module_states``: True: rank 0's values initialise the shards (FSDP's broadcast);
      False: every rank supplies the full values and keeps its own range.
    - ``use_orig_params``: as FSDP: the optimizer sees the original parameters (1-D views of
      this rank's part of each, possibly empty); False: one flat shard per unit.
    - ``name``: the module path to register under ("" = the whole model).
    - ``backward_prefetch`` (``BackwardPrefetch.BACKWARD_PRE``, FSDP's default; ``BACKWARD_POST``;
      None) and ``forward_prefetch`` (False): start the next unit's all-gather (in the first
      iteration's order) as this unit's backward starts / after its reduce-scatter / as its
      forward starts, so that the daemon gathers while this process computes. At most one unit
      is prefetched at a time, so ``limit_all_gathers`` is always in force (accepted for FSDP
      compatibility). Every rank must run the same units in the same order (as FSDP).
    - ``mixed_precision``: a ``flatshard.torch.MixedPrecision`` (or torch's): compute in
      ``param_dtype`` on units the daemon casts and all-gathers so, gradients reduced in
      ``reduce_dtype``, float32 shards and gradients for the optimizer (mixed_precision.py).
    - ``sharding_strategy``: FSDP's (``flatshard.torch.ShardingStrategy``, torch's enum or its
      name; default FULL_SHARD). SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2 and NO_SHARD keep a unit
      unsharded from its forward until its backward (strategies.py).
    - ``require_reattach``: True for a trainer that restarts and expects to find its module
      registered: if the group no longer has it (e.g. the daemon restarted without
      ``--state_dir``), ``flatshard.ShardsLostError`` instead of a fresh registration.
    - ``register_timeout`` (seconds, default 60): how long registering (here and in
      ``reattach()``) retries while the daemon answers UNAVAILABLE "... register again" (a
      re-formed group over several daemons still rolling the module back); then that error.

    A module already registered in the group (a trainer that crashed and came back, see
    ``reattached``) is re-attached: the live shards win over the module's current values.

    Steps commit: after ``optimizer.step()`` call ``model.commit()`` on every rank (or let
    ``model.step(optimizer)`` do both). ``model.generation`` is the committed generation the
    shards hold: 0 after initialisation, +1 per commit (also per writeback
    ``summon_full_params`` / ``load_state_dict``, which commit too). After a failure the
    group rolls every rank's shards back to the last committed generation once every rank
    has joined again; a restarted trainer re-attaches there (``generation`` tells which step
    to resume from), a surviving one calls ``reattach()`` after joining again.

    Checkpoints hold committed steps only: ``save_checkpoint`` raises
    ``FailedPreconditionError`` while this rank's parameters hold optimizer steps that were
    not committed (``uncommitted_steps``), instead of silently saving an older generation.

    Nested inside another module, the wrapper keeps the nn.Module contract: the outer
    module's ``state_dict()`` / ``load_state_dict()`` see the unwrapped module's full
    parameters and buffers under the wrapper's own prefix (as FSDP's FULL_STATE_DICT), and
    both are collective (every rank calls them).
    """

    def __init__(self, module: nn.Module, client: Any, *, auto_wrap_policy: Any = None,
                 ignored_modules: Optional[Iterable[nn.Module]] = None,
                 sync_module_states: bool = False, use_orig_params: bool = False,
                 name: str = "", reduce_op: str = "avg", require_reattach: bool = False,
                 backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch: bool = False, limit_all_gathers: bool = False,
                 mixed_precision: Optional[MixedPrecision] = None,
                 sharding_strategy: Any = None, register_timeout: float = 60.0):
        super().__init__()
        self.module = module
        self._client = client
        self._name = name
        self._use_orig_params = bool(use_orig_params)
        self._reduce_op = reduce_op
        self._state = TrainingState.IDLE
        self._ignored = list(ignored_modules or [])
        if not (isinstance(register_timeout, (int, float)) and register_timeout > 0):
            raise ValueError(f"FlatShardModule: register_timeout must be > 0 seconds, got "
                             f"{register_timeout!r}")
        self._register_timeout = float(register_timeout)
        if not getattr(client, "joined", False):
            raise RuntimeError("FlatShardModule: the client has not joined a group "
                               "(call client.join(group, world_size, rank) first)")
        manifest = _manifest.manifest_json(module)
        policy = _wrap.policy_json(module, auto_wrap_policy, self._ignored, use_orig_params)
        self.sharding_strategy = resolve_strategy(sharding_strategy)
        policy["sharding_strategy"] = policy_strategy(self.sharding_strategy)
        self._kept: Dict[int, Any] = {}  # unit -> forward summon kept for its backward
        self._mp = _Precision(mixed_precision, module, self._ignored)
        if self._mp.enabled:
            policy["mixed_precision"] = self._mp.policy_json()
        self.policy_json = json.dumps(policy, separators=(",", ":"))
        # registered_modules: the group's modules when this client joined (the same on every
        # rank, so every rank decides alike, before the collective register).
        self.reattached = name in list(client.registered_modules)
        if require_reattach and not self.reattached:
            raise ShardsLostError(
                f"FlatShardModule(require_reattach=True): the group has no module {name!r} "
                f"registered, so its shards are gone (e.g. the daemon restarted without "
                f"--state_dir); registering would start over from this module's values at "
                f"generation 0. Load a checkpoint into a wrapper made without "
                f"require_reattach, or start over knowingly")
        init = "from_rank0" if sync_module_states else "from_every_rank"
        self._manifest_json, self._init = manifest, init
        self.backward_error: Optional[BaseException] = None
        # Per step state.
        self._fwd: Dict[int, Any] = {}      # unit -> open forward summon
        self._fwd_depth: Dict[int, int] = {}
        self._bwd: Dict[int, Any] = {}      # unit -> open backward summon
        self._reduced: set = set()          # units reduce-scattered in this backward
        self._finishing: List[Any] = []     # their phase twos still running (finish_async)
        self._final_queued = False          # also: a backward started and did not finish
        self._in_forward = 0                # forward() calls running (re-entrance)
        self._loading: Optional[Tuple[Any, ...]] = None  # an open load_state_dict summon
        self._uncommitted = 0               # optimizer steps since the last commit (seen)
        self._no_sync = False               # inside no_sync(): gradients stay local
        self._recomputing: Dict[int, int] = {}  # unit -> layers recomputed in backward now
        self._accum: Dict[int, torch.Tensor] = {}  # unit -> its full gradient summed locally
        self._seen_versions: List[int] = []
        reg = register_retrying(client, name, manifest, self.policy_json, init,
                                self._register_timeout)
        self._plan = reg.plan
        self._generation = int(getattr(reg, "generation", 0))
        self._build_units(reg.plan)
        # limit_all_gathers is always in force: prefetching runs at most one unit ahead.
        self.limit_all_gathers = bool(limit_all_gathers)
        self._prefetch = _Prefetcher(client, name, lambda unit: self._units[unit].path,
                                     forward_prefetch, backward_prefetch,
                                     compute_precision=self._mp.enabled)
        fresh = reg.init_summon is not None  # the same on every rank
        if fresh:
            self._fill_init_summon(reg.init_summon)
        self._attach_shards(reg.shards)
        if sync_module_states and fresh:
            self._sync_buffers()
        self._mp.cast_buffers()
        self._mark_committed()
        self._install_hooks()
        self.register_load_state_dict_post_hook(_load_post_hook)
        _WRAPPERS.add(self)

    # ------------------------------------------------------------------ registration
    @property
    def plan(self) -> Dict[str, Any]:
        return self._plan

    @property
    def client(self) -> Any:
        return self._client

    @property
    def registered_name(self) -> str:
        return self._name

    @property
    def training_state(self) -> TrainingState:
        return self._state

    @property
    def generation(self) -> int:
        """The committed generation this rank's shards hold, as last reported by the daemon
        (registration, ``reattach()``, ``commit()``): 0 after initialisation, +1 per commit.
        A trainer that commits once per optimizer step and does no writeback summons in
        between resumes at step ``generation``."""
        return self._generation

    def commit(self) -> int:
        """Collective: closes the training step (call it on every rank after the optimizer
        updated the shards in place, and outside forward/backward/summon). Returns the new
        generation. On error (UnavailableError naming a rank that died, DeadlineExceededError
        naming late ranks, FailedPreconditionError for a rank that did not re-read its views
        after a rollback) no rank committed: the step's in-place updates are rolled back on
        every rank once every rank has joined again; join again and ``reattach()``."""
        self._recover()
        if self._state == TrainingState.SUMMON_FULL_PARAMS or self._fwd or self._bwd:
            raise AssertionError("FlatShardModule.commit: called inside "
                                 + ("summon_full_params" if self._state ==
                                    TrainingState.SUMMON_FULL_PARAMS else "forward/backward"))
        self._release_kept(end_now=True)  # as summon_full_params: a backward summons again
        self._generation = int(self._client.commit(self._name))
        self._mark_committed()
        return self._generation

    # Uncommitted steps. torch bumps a tensor's version counter on every in-place write, which
    # is how optimizers update parameters; a changed version seen at a forward (or at the
    # check) is one more optimizer step the daemon's committed copy does not hold.
    def _param_versions(self) -> List[int]:
        return [p._version for _, p in self.named_sharded_parameters()]

    def _note_writes(self, force: bool = False) -> None:
        versions = self._param_versions()
        if force or versions != self._seen_versions:
            self._uncommitted += 1
            self._seen_versions = versions

    def _mark_committed(self) -> None:
        self._uncommitted = 0
        self._seen_versions = self._param_versions()

    @property
    def uncommitted_steps(self) -> int:
        """Optimizer steps (in-place updates of this rank's sharded parameters, counted once
        between forwards) since the last commit: what ``save_checkpoint`` refuses to drop."""
        self._note_writes()
        return self._uncommitted

    def step(self, optimizer: Any, closure: Any = None) -> int:
        """``optimizer.step(closure)`` then ``commit()``: one committed training step.
        Returns the new generation (the optimizer's return value is dropped)."""
        if closure is None:
            optimizer.step()
        else:
            optimizer.step(closure)
        return self.commit()

    def _build_units(self, plan: Dict[str, Any]) -> None:
        by_fqn: Dict[str, nn.Parameter] = _wrap.all_named_params(self.module)
        self._units: List[_Unit] = []
        self._unit_of_module: Dict[int, int] = {}
        self._managed: Dict[int, Tuple[int, _Param]] = {}  # id(Parameter) -> (unit, _Param)
        for i, pu in enumerate(plan["units"]):
            u = _Unit(i, pu)
            if int(pu.get("index", i)) != i:
                raise RuntimeError(f"plan: unit at position {i} has index {pu.get('index')}")
            u.module = self.module.get_submodule(u.path) if u.path else self.module
            for pp in pu["params"]:
                p = _Param(pp["fqn"], tuple(int(s) for s in pp["shape"]), int(pp["offset"]),
                           int(pp["numel"]))
                p.sites.append(self._site(p.fqn))
                p.param = by_fqn.get(p.fqn)
                if p.param is None:
                    raise RuntimeError(f"plan: unit {i} holds {p.fqn!r}, which the module "
                                       f"{type(self.module).__name__} does not have")
                u.params.append(p)
                self._managed[id(p.param)] = (i, p)
            for alias in pu.get("shared", []):
                target = next((q for q in u.params if q.fqn == alias["same_as"]), None)
                if target is None:
                    raise RuntimeError(f"plan: unit {i}: shared {alias['fqn']!r} names "
                                       f"{alias['same_as']!r}, not a parameter of the unit")
                target.sites.append(self._site(alias["fqn"]))
                target.fqns.append(alias["fqn"])
            u.compute_gaps()
            self._units.append(u)
            self._unit_of_module[id(u.module)] = i
        self._unit_by_path = {u.path: u.index for u in self._units}
        self._managed_fqns = {fqn for u in self._units for p in u.params for fqn in p.fqns}

    def _site(self, fqn: str) -> Tuple[nn.Module, str]:
        prefix, _, attr = fqn.rpartition(".")
        return (self.module.get_submodule(prefix) if prefix else self.module, attr)

    def _fill_init_summon(self, s: Any) -> None:
        named = _wrap.all_named_params(self.module)
        try:
            with torch.no_grad():
                for fqn, view in s.params.items():
                    src = named.get(fqn)
                    if src is None:
                        raise RuntimeError(f"init summon: {fqn!r} is not a parameter of the module")
                    view.copy_(src.detach().reshape(view.shape))
        except BaseException:
            s.end()
            raise
        s.end()

    def _attach_shards(self, shards: Iterable[Any]) -> None:
        got = {sh.unit: sh for sh in shards}
        for u in self._units:
            sh = got.get(u.index)
            if sh is None:
                raise RuntimeError(f"registered module {self._name!r}: this rank holds no shard "
                                   f"of unit {u.index} ({u.path or '<root>'})")
            u.shard = sh.shard
            u.shard_offset = int(sh.shard_offset)
            if int(sh.shard_numel) != u.shard_numel:
                raise RuntimeError(f"unit {u.index}: shard has {sh.shard_numel} elements, the "
                                   f"plan says {u.shard_numel}")
            if u.flat_param is None:
                u.flat_param = nn.Parameter(u.shard, requires_grad=u.requires_grad)
            else:
                u.flat_param.data = u.shard
            # A gradient shard left by an earlier session (re-attach) stays in the daemon
            # (summon with_grads shows it) but is not handed to the optimizer: it may be a
            # crashed step's partial result. The first backward overwrites it.
            u.grad_shard = sh.grad if u.requires_grad else None
            u.flat_param.grad = None
            for p in u.params:
                p.param.data = self._shard_slice(u, p, u.shard)
                p.param.grad = None

    def reattach(self) -> int:
        """Continues after a failed step, e.g. when another rank crashed: call it once the
        client has joined its group again (``client.leave(); client.join(...)``, the same
        group and rank: the join waits for the replacement, and once every rank has joined
        the shards are rolled back to the last committed step). Drops what the failed step
        left open, registers the module again (re-attach: this reads the rolled-back views,
        which the daemon requires before this rank commits again) and points the same
        parameter objects at the shards, so the optimizer carries on (its state, e.g.
        momentum, is the trainer's and is not rolled back, unless it is kept in the daemon
        with ``flatshard.torch.keep_optimizer_state``: then it is rolled back with the
        shards). Returns ``generation``: redo the steps from there.

        Raises ``flatshard.ShardsLostError`` (registering nothing) when the group no longer
        has the module (e.g. the daemon restarted without ``--state_dir``): registering
        again would silently start over at generation 0."""
        self._abandon_step()
        self._prefetch.reset()  # a restarted rank knows no order: every rank starts over
        self._end_load()
        if self._name not in list(self._client.registered_modules):
            # The group's modules as of this client's last join, the same on every rank:
            # every rank raises here, before the collective register.
            raise ShardsLostError(
                f"reattach: the group has no module {self._name!r} registered (as of this "
                f"client's last join): the shards this wrapper trained to generation "
                f"{self._generation} are gone (e.g. the daemon restarted without "
                f"--state_dir), or this client did not join again after the failure "
                f"(client.leave(); client.join(...) first). Registering would start over "
                f"from the initial values at generation 0: load a checkpoint into a new "
                f"FlatShardModule instead")
        reg = register_retrying(self._client, self._name, self._manifest_json, self.policy_json,
                                self._init, self._register_timeout)
        if reg.plan.get("fingerprint") != self._plan.get("fingerprint"):
            raise RuntimeError(f"reattach: the group's module {self._name!r} has another plan "
                               f"(fingerprint {reg.plan.get('fingerprint')}, this wrapper's "
                               f"{self._plan.get('fingerprint')})")
        if reg.init_summon is not None:
            self._fill_init_summon(reg.init_summon)
        self._attach_shards(reg.shards)
        self._generation = int(getattr(reg, "generation", 0))
        self._mark_committed()
        self.reattached = True
        self.backward_error = None
        return self._generation

    @staticmethod
    def _shard_slice(u: _Unit, p: _Param, flat_shard: torch.Tensor) -> torch.Tensor:
        lo = max(p.offset, u.shard_offset)
        hi = min(p.offset + p.numel, u.shard_offset + u.shard_numel)
        if hi <= lo:
            return flat_shard.narrow(0, 0, 0)
        return flat_shard.narrow(0, lo - u.shard_offset, hi - lo)

    def _has_grads(self, u: _Unit) -> bool:
        """Whether the optimizer's view of unit u holds a gradient (then the next backward
        accumulates into it, as torch does); ``zero_grad(set_to_none=True)`` clears it."""
        if self._use_orig_params:
            return any(p.param.grad is not None for p in u.params)
        return u.flat_param.grad is not None

    def _refresh_grads(self) -> None:
        """Points every sharded parameter's .grad at its gradient shard. The daemon creates a
        unit's gradient shard at its first reduce-scatter; it stays where it is afterwards."""
        need = [u for u in self._units if u.requires_grad and u.grad_shard is None]
        if need:
            views = {sh.unit: sh for sh in self._client.shard_views(self._name)}
            for u in need:
                sh = views.get(u.index)
                if sh is not None and sh.grad is not None:
                    u.grad_shard = sh.grad
        for u in self._units:
            if u.grad_shard is None or u.index not in self._reduced:
                continue
            grad = self._mp.optimizer_grad(u.grad_shard) if u.low_precision else u.grad_shard
            _set_grad(u.flat_param, grad)
            if self._use_orig_params:
                for p in u.params:
                    _set_grad(p.param, self._shard_slice(u, p, grad))

    # ------------------------------------------------------------------ parameters
    def sharded_parameters(self) -> List[nn.Parameter]:
        """What the optimizer steps: parameters over this rank's shards, ``.grad`` over the
        gradient shards (after the first backward). use_orig_params=False: one flat
        parameter per unit; True: the original parameters (1-D, this rank's part)."""
        if self._use_orig_params:
            out, seen = [], set()
            for u in self._units:
                for p in u.params:
                    if p.param.requires_grad and id(p.param) not in seen:
                        seen.add(id(p.param))
                        out.append(p.param)
            return out
        return [u.flat_param for u in self._units if u.requires_grad]

    def named_sharded_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        if self._use_orig_params:
            return [(p.fqn, p.param) for u in self._units for p in u.params]
        return [(f"{u.path + '.' if u.path else ''}flat_param", u.flat_param) for u in self._units]

    def _ignored_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if id(p) not in self._managed]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """As FSDP: the sharded parameters (flat per unit, or the original ones with
        use_orig_params) and the parameters of ignored modules."""
        pre = prefix + "." if prefix else ""
        for n, p in self.named_sharded_parameters() + self._ignored_parameters():
            yield pre + n, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # ------------------------------------------------------------------ forward / backward
    def _install_hooks(self) -> None:
        self._hook_handles = []
        for u in self._units:
            if u.module is self.module:
                continue  # the root unit is handled by forward()
            self._hook_handles.append(u.module.register_forward_pre_hook(
                lambda m, args, _u=u.index: self._pre_forward(_u)))
            cast_to = self._mp.unit_input_dtype(u.module, getattr(torch, u.dtype_name))
            if cast_to is not None:
                self._hook_handles.append(u.module.register_forward_pre_hook(
                    lambda m, args, _d=cast_to: _cast_floating(args, _d)))
            self._hook_handles.append(u.module.register_forward_hook(
                lambda m, args, out, _u=u.index: self._post_forward(_u)))
        # Activation checkpointing inside a unit: the recomputation calls a layer of the unit
        # again during backward, outside any forward; its parameters must be full then.
        for u in self._units:
            owners = {id(m): m for p in u.params for m, _ in p.sites}
            for m in owners.values():
                self._hook_handles.append(m.register_forward_pre_hook(
                    lambda m, args, _u=u.index: self._pre_recompute(_u)))
                self._hook_handles.append(m.register_forward_hook(
                    lambda m, args, out, _u=u.index: self._post_recompute(_u)))

    def _pre_recompute(self, unit: int) -> None:
        if (self._state != TrainingState.FORWARD_BACKWARD or self._in_forward
                or unit in self._fwd):
            return  # not a recomputation, or the unit's own summon is in place
        u = self._units[unit]
        depth = self._recomputing.get(unit, 0)
        self._recomputing[unit] = depth + 1
        if depth > 0:
            return
        try:
            # Re-entrant checkpointing back-propagates through the recomputation: its
            # gradients reach the unit's reduce-scatter through the views' autograd node.
            self._install_views(u, self._backward_flat(unit))
        except BaseException as e:
            self._recomputing.pop(unit, None)
            self._restore_sites(u)
            self.backward_error = e
            raise

    def _post_recompute(self, unit: int) -> None:
        depth = self._recomputing.get(unit, 0)
        if depth == 0:
            return
        if depth > 1:
            self._recomputing[unit] = depth - 1
            return
        del self._recomputing[unit]
        self._restore_sites(self._units[unit])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._recover()
        if self._state == TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError("FlatShardModule: forward inside summon_full_params")
        if not self._in_forward and (self._state == TrainingState.FORWARD_BACKWARD or
                                     self._fwd or self._fwd_depth or self._bwd):
            # An earlier step did not finish its backward (no backward, or it failed), or
            # unit hooks ran outside forward() and failed: drop what is left open first.
            self._abandon_step()
        self._note_writes()
        self._state = TrainingState.FORWARD_BACKWARD
        self.backward_error = None
        root = self._unit_of_module.get(id(self.module))
        self._in_forward += 1
        try:
            args, kwargs = self._mp.cast_root_inputs(args, kwargs)
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                if root is not None:
                    self._pre_forward(root)
                out = self.module(*args, **kwargs)
                if root is not None:
                    self._post_forward(root)
            if torch.is_grad_enabled() and self._register_pre_backward(out):
                return out
        except BaseException:
            self._abandon_step()
            raise
        finally:
            self._in_forward -= 1
        if not self._in_forward:  # no backward follows: nothing prefetched will be used
            self._release_kept()
            self._prefetch.cancel()
            self._prefetch.order.end_iteration()
        self._state = TrainingState.IDLE
        return out

    def _recover(self) -> None:
        """Makes the wrapper usable again after an error that escaped it: ends a
        ``load_state_dict`` summon an outer module's failed load left open, and drops a step
        whose backward started but ended without its final callback (the engine raised), and
        outside forward and backward sends the Ends deferred to a next summon that may never
        come (a backward that failed before reaching the units)."""
        self._end_load()
        if not self._in_forward and not _in_backward():
            with contextlib.suppress(Exception):  # read-only Ends: the call that follows
                self._prefetch.flush()            # reports a broken session itself
        if (self._state == TrainingState.FORWARD_BACKWARD and not self._in_forward
                and self._final_queued and not _in_backward()):
            self._abandon_step()

    def _register_pre_backward(self, out: Any) -> bool:
        tensors = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(self._pre_backward_hook)
        self._final_queued = False
        return bool(tensors)

    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)
        return grad

    def _pre_forward(self, unit: int) -> None:
        # The summon's full parameters are installed: a unit's own summon would fail (and
        # before this check, left a depth count behind that skipped the next summon).
        if self._state == TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError("FlatShardModule: forward inside summon_full_params")
        u = self._units[unit]
        depth = self._fwd_depth.get(unit, 0)
        if depth > 0:
            self._fwd_depth[unit] = depth + 1
            return  # a module called again inside its own forward: already summoned
        kept = self._take_kept(unit)  # SHARD_GRAD_OP: run again in this step
        s = kept[0] if kept is not None else self._prefetch.summon(unit)
        try:
            flat = kept[1] if kept is not None else _plain(s.flat(unit))
            self._fwd[unit] = (s, flat, flat.data_ptr(),
                               flat.data_ptr() + flat.numel() * flat.element_size())
            self._install_views(u, flat)
        except BaseException:
            self._restore_sites(u)
            self._fwd.pop(unit, None)
            with contextlib.suppress(Exception):
                s.end()
            raise
        self._fwd_depth[unit] = 1  # counted only once the summon is in place
        if self._in_forward:  # not a recomputation in backward
            self._prefetch.order.record_pre(unit)
            if self._prefetch.forward:
                self._prefetch.start(self._prefetch.order.next_forward(unit), self._summoned)

    @property
    def prefetch_stats(self) -> Dict[str, float]:
        """Since construction: ``summons`` (a unit's parameters unsharded for its forward or
        backward), ``prefetched`` (of which started ahead by prefetching) and ``waited_s``
        (seconds this process waited for them: the all-gather time prefetching did not
        hide)."""
        p = self._prefetch
        return {"summons": p.summons, "prefetched": p.prefetched, "waited_s": p.waited_s}

    def _summoned(self, unit: int) -> bool:
        return unit in self._fwd or unit in self._bwd or unit in self._kept

    def _install_views(self, u: _Unit, flat: torch.Tensor) -> None:
        """Points the unit's parameters at their views in its full buffer `flat`: views out
        of one _UnitParams node (its backward reduce-scatters the unit) when gradients are
        recorded, plain views otherwise."""
        if torch.is_grad_enabled() and u.requires_grad:
            dummy = torch.empty(0, requires_grad=True)
            views = _UnitParams.apply(self, u.index, dummy, flat)
        else:
            views = tuple(flat.narrow(0, p.offset, p.numel).view(p.shape) for p in u.params)
        for p, v in zip(u.params, views):
            for m, attr in p.sites:
                m._parameters[attr] = v

    def _restore_sites(self, u: _Unit) -> None:
        for p in u.params:
            for m, attr in p.sites:
                m._parameters[attr] = p.param

    def _post_forward(self, unit: int) -> None:
        depth = self._fwd_depth.get(unit, 0) - 1
        if depth > 0:
            self._fwd_depth[unit] = depth
            return
        self._fwd_depth.pop(unit, None)
        if self._in_forward:
            self._prefetch.order.record_post(unit)
        self._restore_sites(self._units[unit])
        got = self._fwd.pop(unit, None)
        if got is not None and not self._keep_after_forward(unit, got):
            self._prefetch.release(got[0])  # ended by the next summon's RPC

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._fwd or t.device.type != "cpu" or t.numel() == 0:
            return t
        ptr = t.data_ptr()
        for unit, (_, flat, lo, hi) in self._fwd.items():
            if lo <= ptr < hi and t.dtype == flat.dtype:
                return _Packed(unit, (ptr - lo) // flat.element_size(), tuple(t.size()),
                               tuple(t.stride()))
        return t

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Packed):
            return x
        try:
            flat = self._backward_flat(x.unit)
        except BaseException as e:
            self.backward_error = e  # torch's engine re-raises it as a RuntimeError
            raise
        return flat.as_strided(x.size, x.stride, x.offset)

    def _backward_flat(self, unit: int) -> torch.Tensor:
        got = self._bwd.get(unit)
        if got is None:
            got = self._take_kept(unit)  # SHARD_GRAD_OP: the forward's, still open
            if got is None:
                s = self._prefetch.summon(unit)
                got = (s, _plain(s.flat(unit)))
            self._bwd[unit] = got
            self._prefetch.order.record_backward(unit)
            if self._prefetch.backward == BackwardPrefetch.BACKWARD_PRE:
                self._prefetch.start(self._prefetch.order.next_backward(unit), self._summoned)
        return got[1]

    def _post_backward(self, unit: int, grads: Tuple[Optional[torch.Tensor], ...]) -> None:
        try:
            self._reduce_scatter(unit, grads)
            if self._prefetch.backward == BackwardPrefetch.BACKWARD_POST:
                self._prefetch.start(self._prefetch.order.next_backward(unit), self._summoned)
        except BaseException as e:
            self.backward_error = e  # torch's engine re-raises it as a RuntimeError
            raise

    def _reduce_scatter(self, unit: int, grads: Tuple[Optional[torch.Tensor], ...]) -> None:
        u = self._units[unit]
        if self._no_sync:
            self._accumulate_locally(u, grads)
        else:
            held = self._accum.pop(unit, None)  # what no_sync() backward passes summed
            accumulate = unit in self._reduced or self._has_grads(u)
            pending = self._client.begin_reduce_scatter(self._name, unit, self._reduce_op,
                                                        accumulate)
            buf = _plain(pending.flat)
            with torch.no_grad():
                for p, g in zip(u.params, grads):
                    dst = buf.narrow(0, p.offset, p.numel)
                    if g is None:
                        dst.zero_()
                    else:
                        dst.view(p.shape).copy_(g)
                for lo, hi in u.gaps:
                    buf.narrow(0, lo, hi - lo).zero_()
                if held is not None:
                    # Its gaps are zeros. Mixed precision: the float32 sum rounded once to
                    # the reduce dtype (an in-place add would refuse the wider dtype).
                    buf.add_(held.to(buf.dtype))
            # Phase two runs while the backward goes on; the final callback waits for it.
            self._finishing.append(pending.finish_async())
            self._reduced.add(unit)
        got = self._bwd.pop(unit, None)
        if got is not None:
            self._prefetch.release(got[0])  # ended by the next summon's RPC

    def _final_callback(self) -> None:
        try:
            self._prefetch.cancel()
            self._prefetch.order.end_iteration()
            for unit in list(self._bwd):
                self._bwd.pop(unit)[0].end()
            self._release_kept()  # units this backward did not reach
            if not self._no_sync:
                # Units this backward did not reach still owe their no_sync() sums; the same
                # units on every rank (same model, same order), so the collectives match.
                for unit in sorted(self._accum):
                    self._reduce_scatter(unit, (None,) * len(self._units[unit].params))
            self._prefetch.flush()  # the last unit's End: no summon follows it
            self._wait_reduce_scatters()
            self._refresh_grads()
        except BaseException as e:
            self.backward_error = e
            raise
        finally:
            self._reduced.clear()
            self._final_queued = False
            self._state = TrainingState.IDLE

    def _wait_reduce_scatters(self, raise_errors: bool = True) -> None:
        """Waits for every started phase two; raises the first error after all finished."""
        finishing, self._finishing = self._finishing, []
        first: Optional[BaseException] = None
        for f in finishing:
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None and raise_errors:
            raise first

    def _abandon_step(self) -> None:
        """Ends whatever a failed or unfinished step left open (best effort: the daemon ends
        them itself when the session goes)."""
        self._prefetch.cancel()
        self._prefetch.order.discard_iteration()
        self._release_kept(end_now=True)
        self._wait_reduce_scatters(raise_errors=False)
        for table in (self._fwd, self._bwd):
            for unit in list(table):
                s = table.pop(unit)[0]
                try:
                    s.end()
                except Exception:  # noqa: BLE001 - the step already failed; keep its error
                    pass
        for u in self._units:
            self._restore_sites(u)
        self._fwd_depth.clear()
        self._recomputing.clear()
        self._reduced.clear()
        self._final_queued = False
        self._state = TrainingState.IDLE

    # ------------------------------------------------------------------ summon_full_params
    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False):
        """FSDP's ``summon_full_params`` (same signature and defaults). ``module`` is a
        FlatShardModule or a module inside one (then: the units at that module's path)."""
        wrapper, path = _find_wrapper(module)
        with wrapper._summon(path, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    def _rank(self) -> int:
        rank = getattr(self._client, "rank", None)
        return int(rank) if rank is not None else self._plan_rank()

    def _plan_rank(self) -> int:
        u = self._units[0]
        return u.shard_offset // max(u.shard_numel, 1)

    def _world_size(self) -> int:
        return int(self._plan.get("world_size", 0))

    def refresh_views(self) -> int:
        """Reads this rank's views again in the same session (after another rank's
        ``load_checkpoint``): the same parameter objects point at the shards, gradients are
        dropped; returns ``generation``."""
        views = self._client.shard_views(self._name)
        self._attach_shards(views)
        self._generation = int(views.generation)
        self._mark_committed()
        return self._generation


def _find_wrapper(module: nn.Module) -> Tuple[FlatShardModule, str]:
    if isinstance(module, FlatShardModule):
        return module, ""
    for w in list(_WRAPPERS):
        paths = _wrap.module_paths(w.module)
        if id(module) in paths:
            return w, paths[id(module)]
    raise ValueError(f"summon_full_params: {type(module).__name__} is not inside a "
                     f"FlatShardModule")

summon_full_params = FlatShardModule.summon_full_params
