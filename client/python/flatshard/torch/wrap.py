"""FSDP's auto-wrap policies, turned into flatshard policies (``flatshard.policy/1``).

PyTorch FSDP takes an ``auto_wrap_policy`` callable ``fn(module, recurse, nonwrapped_numel)``.
flatshard plans in the daemon, from JSON, so a policy must become JSON:

- ``size_based_auto_wrap_policy(min_num_params=...)``    -> ``{"kind": "size_based", ...}``
- ``ModuleWrapPolicy({Block, ...})`` (also ``transformer_auto_wrap_policy`` partials)
                                                         -> ``{"kind": "module_types", ...}``
  Classes are matched by name against the manifest's ``type`` and ``bases``, so a base class
  matches its subclasses, as ``isinstance`` does in FSDP.
- ``always_wrap_policy``                                 -> ``{"kind": "always"}``
- any other callable with FSDP's signature (a lambda, ``lambda_auto_wrap_policy`` partial, a
  ``CustomPolicy``-like function) is *resolved*: FSDP's recursion (spec/semantics.md §1) runs
  here over the module, calling the callable exactly as FSDP would, and the modules it wraps
  become ``{"kind": "explicit", "paths": [...]}``.

Each helper is also callable with FSDP's signature, so it can be used where FSDP expects one.
"""
import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Type

import torch.nn as nn

POLICY_FORMAT = "flatshard.policy/1"

# FSDP's defaults (torch.distributed.fsdp.wrap.size_based_auto_wrap_policy).
_DEFAULT_FORCE_LEAF = (nn.MultiheadAttention,)
_DEFAULT_EXCLUDE_WRAP = (nn.ModuleList, nn.ModuleDict)


class Policy:
    """A wrap policy that can be written as flatshard JSON (``auto_wrap`` object)."""

    def auto_wrap_json(self, root: nn.Module) -> Dict[str, Any]:
        raise NotImplementedError

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        raise NotImplementedError


def _names(classes: Iterable[type], what: str) -> List[str]:
    out = []
    for c in classes:
        if not isinstance(c, type) or not issubclass(c, nn.Module):
            raise TypeError(f"{what}: {c!r} is not an nn.Module class")
        out.append(c.__name__)
    return sorted(set(out))


class AlwaysWrapPolicy(Policy):
    """FSDP's ``always_wrap_policy``: every module with parameters becomes a unit."""

    def auto_wrap_json(self, root):
        return {"kind": "always"}

    def __call__(self, module, recurse, nonwrapped_numel):
        return True


always_wrap_policy = AlwaysWrapPolicy()


class SizeBasedPolicy(Policy):
    """FSDP's ``size_based_auto_wrap_policy``."""

    def __init__(self, min_num_params: int = int(1e8),
                 force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
                 exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None):
        if int(min_num_params) < 0:
            raise ValueError(f"size_based_auto_wrap_policy: min_num_params must be >= 0, "
                             f"got {min_num_params}")
        self.min_num_params = int(min_num_params)
        self.force_leaf_modules = tuple(
            _DEFAULT_FORCE_LEAF if force_leaf_modules is None else force_leaf_modules)
        self.exclude_wrap_modules = tuple(
            _DEFAULT_EXCLUDE_WRAP if exclude_wrap_modules is None else exclude_wrap_modules)

    def auto_wrap_json(self, root):
        return {
            "kind": "size_based",
            "min_num_params": self.min_num_params,
            "force_leaf_types": _names(self.force_leaf_modules, "force_leaf_modules"),
            "exclude_wrap_types": _names(self.exclude_wrap_modules, "exclude_wrap_modules"),
        }

    def __call__(self, module, recurse, nonwrapped_numel):
        if recurse:
            return not isinstance(module, self.force_leaf_modules)
        return (nonwrapped_numel >= self.min_num_params
                and not isinstance(module, self.exclude_wrap_modules))


def size_based_auto_wrap_policy(module: Optional[nn.Module] = None, recurse: Optional[bool] = None,
                                nonwrapped_numel: Optional[int] = None,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
                                exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None):
    """``size_based_auto_wrap_policy(min_num_params=N)`` returns the policy; called with FSDP's
    ``(module, recurse, nonwrapped_numel)`` it answers as FSDP's function does. A
    ``functools.partial`` of it works too."""
    policy = SizeBasedPolicy(min_num_params, force_leaf_modules, exclude_wrap_modules)
    if module is None:
        return policy
    return policy(module, recurse, nonwrapped_numel)


class ModuleWrapPolicy(Policy):
    """FSDP's ``ModuleWrapPolicy(module_classes)``: wrap every instance of these classes
    (and of their subclasses)."""

    def __init__(self, module_classes: Iterable[Type[nn.Module]]):
        self.module_classes = tuple(module_classes)
        if not self.module_classes:
            raise ValueError("ModuleWrapPolicy: module_classes is empty")
        _names(self.module_classes, "ModuleWrapPolicy")

    def auto_wrap_json(self, root):
        return {"kind": "module_types", "types": _names(self.module_classes, "ModuleWrapPolicy")}

    def __call__(self, module, recurse, nonwrapped_numel):
        return True if recurse else isinstance(module, self.module_classes)


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Set[Type[nn.Module]]) -> bool:
    """FSDP's ``transformer_auto_wrap_policy`` (use through ``functools.partial``)."""
    return ModuleWrapPolicy(transformer_layer_cls)(module, recurse, nonwrapped_numel)


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """FSDP's ``lambda_auto_wrap_policy`` (use through ``functools.partial``); resolved to
    explicit paths at registration."""
    return True if recurse else bool(lambda_fn(module))


class ExplicitPolicy(Policy):
    """The units given by module paths (``{"kind": "explicit"}``)."""

    def __init__(self, paths: Iterable[str]):
        self.paths = list(paths)

    def auto_wrap_json(self, root):
        return {"kind": "explicit", "paths": list(self.paths)}

    def __call__(self, module, recurse, nonwrapped_numel):
        raise TypeError("ExplicitPolicy works on paths; it has no per-module answer")


def module_paths(root: nn.Module) -> Dict[int, str]:
    """id(module) -> its first path (pre-order, registration order, as the manifest)."""
    out: Dict[int, str] = {}

    def visit(m: nn.Module, path: str) -> None:
        if id(m) in out:
            return
        out[id(m)] = path
        for name, c in m._modules.items():
            if c is not None:
                visit(c, f"{path}.{name}" if path else name)

    visit(root, "")
    return out


def all_named_params(root: nn.Module) -> Dict[str, nn.Parameter]:
    """Every FQN of every parameter, tied and shared ones at each of their paths."""
    out: Dict[str, nn.Parameter] = {}

    def visit(m: nn.Module, prefix: str, stack: Tuple[int, ...]) -> None:
        if id(m) in stack:
            return
        for n, p in m._parameters.items():
            if p is not None:
                out[prefix + n] = p
        for n, c in m._modules.items():
            if c is not None:
                visit(c, f"{prefix}{n}.", stack + (id(m),))

    visit(root, "", ())
    return out


def resolve_callable(root: nn.Module, fn: Callable[..., bool],
                     ignored_modules: Iterable[nn.Module] = ()) -> List[str]:
    """Runs FSDP's ``_recursive_wrap`` (spec/semantics.md §1) over ``root`` with the policy
    callable ``fn`` and returns the paths of the modules it wraps (the root excluded: it is
    always a unit)."""
    ignored_ids: Set[int] = set()
    for m in ignored_modules:
        for sub in m.modules():
            ignored_ids.add(id(sub))
    ignored_params: Set[int] = set()
    for m in root.modules():
        if id(m) in ignored_ids:
            for p in m.parameters(recurse=False):
                ignored_params.add(id(p))
    units: Set[int] = set()
    in_unit: Set[int] = set()
    paths: List[str] = []

    def remaining(m: nn.Module) -> List[Any]:
        seen: Set[int] = set()
        out = []
        for p in m.parameters():
            if id(p) in seen or id(p) in ignored_params or id(p) in in_unit:
                continue
            seen.add(id(p))
            out.append(p)
        return out

    def wrap(m: nn.Module, path: str, only_children: bool) -> int:
        if id(m) in units:
            return 0
        params = remaining(m)
        n = sum(p.numel() for p in params)
        if not fn(module=m, recurse=True, nonwrapped_numel=n):
            return 0
        wrapped = 0
        for name, c in m._modules.items():
            if c is None or id(c) in ignored_ids:
                continue
            wrapped += wrap(c, f"{path}.{name}" if path else name, False)
        if not only_children and fn(module=m, recurse=False, nonwrapped_numel=n - wrapped):
            units.add(id(m))
            for p in remaining(m):
                in_unit.add(id(p))
            paths.append(path)
            return n
        return wrapped

    wrap(root, "", True)
    return paths


def auto_wrap_json(root: nn.Module, policy: Any,
                   ignored_modules: Iterable[nn.Module] = ()) -> Dict[str, Any]:
    """The ``auto_wrap`` object for ``policy`` (None, a Policy, a partial of one of the helper
    functions, or any FSDP-style callable)."""
    if policy is None:
        return {"kind": "none"}
    if isinstance(policy, Policy):
        return policy.auto_wrap_json(root)
    if isinstance(policy, functools.partial):
        kw = dict(policy.keywords or {})
        if policy.func is size_based_auto_wrap_policy and not policy.args:
            return SizeBasedPolicy(**kw).auto_wrap_json(root)
        if policy.func is transformer_auto_wrap_policy and set(kw) == {"transformer_layer_cls"}:
            return ModuleWrapPolicy(kw["transformer_layer_cls"]).auto_wrap_json(root)
    if not callable(policy):
        raise TypeError(f"auto_wrap_policy: {policy!r} is neither a policy nor a callable")
    return {"kind": "explicit", "paths": resolve_callable(root, policy, ignored_modules)}


def policy_json(root: nn.Module, auto_wrap_policy: Any = None,
                ignored_modules: Optional[Iterable[nn.Module]] = None,
                use_orig_params: bool = False) -> Dict[str, Any]:
    """The whole ``flatshard.policy/1`` document FSDP's constructor arguments describe."""
    ignored = list(ignored_modules or [])
    paths = module_paths(root)
    ignored_paths = []
    for m in ignored:
        if not isinstance(m, nn.Module):
            raise TypeError(f"ignored_modules: {m!r} is not an nn.Module")
        if m is root:
            raise ValueError("ignored_modules: the root module itself cannot be ignored "
                             "(FSDP: nothing would be left to flatten)")
        if id(m) not in paths:
            raise ValueError(f"ignored_modules: {type(m).__name__} is not a submodule of the "
                             f"wrapped {type(root).__name__}")
        ignored_paths.append(paths[id(m)])
    doc: Dict[str, Any] = {
        "format": POLICY_FORMAT,
        "auto_wrap": auto_wrap_json(root, auto_wrap_policy, ignored),
        "use_orig_params": bool(use_orig_params),
        "sharding_strategy": "FULL_SHARD",
    }
    if ignored_paths:
        doc["ignored_modules"] = ignored_paths
    return doc
