#!/usr/bin/python3
"""Generate ground-truth planner fixtures from real PyTorch 1.13 FSDP.

Run from the repository root:

    /usr/bin/python3 scripts/fsdp_fixtures/make_fixtures.py

Writes, for every case in CASES, into tests/data/fsdp/:
  <case>.manifest.json   flatshard manifest of the unwrapped model
  <case>.policy.json     flatshard policy (formats.md)
  <case>.expected.json   what FSDP built (see README.md)
and the example models into examples/models/.

Options: --out DIR (fixtures dir), --examples DIR, --no-world-sizes (skip the
multi-process runs for world sizes 2 and 3), --only NAME[,NAME...].
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import fsdp_env  # noqa: E402  (must precede torch.distributed.fsdp imports)
from fsdp_env import FSDP  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import MixedPrecision  # noqa: E402
from torch.distributed.fsdp.wrap import (  # noqa: E402
    _or_policy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import models  # noqa: E402
from flatshard_manifest import dtype_name, dumps, manifest_from_module  # noqa: E402

REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
WORLD_SIZES = (2, 3)
WRAPPER_PARTS = {"_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module"}
# FSDP 1.13 always warns about CPU flattening here; it says nothing about the plan.
BORING_WARNINGS = ("Module is put on CPU", "Deallocating Tensor that still has live PyObject")

# --------------------------------------------------------------------------
# Cases: (name, factory, flatshard policy).  Policies are written verbatim
# (plus "format") to <case>.policy.json.
# --------------------------------------------------------------------------
NONE = {"kind": "none"}
ALWAYS = {"kind": "always"}


def size_based(n: Optional[int] = None, **kw) -> Dict[str, Any]:
    p: Dict[str, Any] = {"kind": "size_based"}
    if n is not None:
        p["min_num_params"] = n
    p.update(kw)
    return p


def module_types(*types: str) -> Dict[str, Any]:
    return {"kind": "module_types", "types": list(types)}


def explicit(*paths: str) -> Dict[str, Any]:
    return {"kind": "explicit", "paths": list(paths)}


CASES: List[Tuple[str, Callable[[], nn.Module], Dict[str, Any]]] = [
    # GPT with tied wte/lm_head
    ("gpt_tied_none", models.gpt_tied, {"auto_wrap": NONE}),
    ("gpt_tied_always", models.gpt_tied, {"auto_wrap": ALWAYS}),
    ("gpt_tied_size_based_0", models.gpt_tied, {"auto_wrap": size_based(0)}),
    ("gpt_tied_size_based_1", models.gpt_tied, {"auto_wrap": size_based(1)}),
    ("gpt_tied_size_based_1k", models.gpt_tied, {"auto_wrap": size_based(1000)}),
    ("gpt_tied_size_based_2k", models.gpt_tied, {"auto_wrap": size_based(2000)}),
    ("gpt_tied_size_based_default", models.gpt_tied, {"auto_wrap": size_based()}),
    ("gpt_tied_size_based_leaf_block", models.gpt_tied, {"auto_wrap": size_based(
        0, force_leaf_types=["Block"],
        exclude_wrap_types=["ModuleList", "ModuleDict", "LayerNorm"])}),
    ("gpt_tied_module_types_block", models.gpt_tied, {"auto_wrap": module_types("Block")}),
    ("gpt_tied_explicit", models.gpt_tied,
     {"auto_wrap": explicit("h.0", "h.1.mlp", "lm_head")}),
    ("gpt_tied_any", models.gpt_tied, {"auto_wrap": {"kind": "any", "policies": [
        size_based(2000), module_types("Block")]}}),
    ("gpt_tied_ignored_h1", models.gpt_tied,
     {"auto_wrap": module_types("Block"), "ignored_modules": ["h.1"]}),
    ("gpt_tied_ignored_wte", models.gpt_tied,
     {"auto_wrap": ALWAYS, "ignored_modules": ["wte"]}),
    ("gpt_tied_module_types_block_ignored_mlp", models.gpt_tied,
     {"auto_wrap": module_types("Block"), "ignored_modules": ["h.1.mlp"]}),
    ("gpt_tied_size_based_2k_ignored_mlp", models.gpt_tied,
     {"auto_wrap": size_based(2000), "ignored_modules": ["h.0.mlp"]}),
    # torch.nn.TransformerEncoder
    ("transformer_encoder_always", models.transformer_encoder, {"auto_wrap": ALWAYS}),
    ("transformer_encoder_size_based_0", models.transformer_encoder,
     {"auto_wrap": size_based(0)}),
    ("transformer_encoder_size_based_no_leaf", models.transformer_encoder,
     {"auto_wrap": size_based(0, force_leaf_types=[],
                              exclude_wrap_types=["ModuleList", "ModuleDict"])}),
    ("transformer_encoder_module_types_layer", models.transformer_encoder,
     {"auto_wrap": module_types("TransformerEncoderLayer")}),
    # convnet with BatchNorm2d
    ("convnet_bn_none", models.convnet_bn, {"auto_wrap": NONE}),
    ("convnet_bn_size_based_100", models.convnet_bn, {"auto_wrap": size_based(100)}),
    ("convnet_bn_module_types_batchnorm", models.convnet_bn,
     {"auto_wrap": module_types("_BatchNorm")}),
    ("convnet_bn_size_based_mp", models.convnet_bn, {
        "auto_wrap": size_based(500),
        "mixed_precision": {"param_dtype": "bfloat16",
                            "module_types_to_ignore": ["_BatchNorm"]}}),
    # one module instance at two paths
    ("shared_module_none", models.shared_module, {"auto_wrap": NONE}),
    ("shared_module_always", models.shared_module, {"auto_wrap": ALWAYS}),
    ("shared_module_explicit_second_path", models.shared_module,
     {"auto_wrap": explicit("branch_b.shared")}),
    ("shared_module_module_types_branch", models.shared_module,
     {"auto_wrap": module_types("Branch")}),
    ("shared_module_ignored_second_path", models.shared_module,
     {"auto_wrap": module_types("Branch"), "ignored_modules": ["branch_b.shared"]}),
    ("alias_net_always", models.alias_net, {"auto_wrap": ALWAYS}),
    ("alias_net_none", models.alias_net, {"auto_wrap": NONE}),
    # tied parameters (same module twice, and across modules)
    ("tied_params_none", models.tied_params, {"auto_wrap": NONE}),
    ("tied_params_always", models.tied_params, {"auto_wrap": ALWAYS}),
    # ModuleDict
    ("module_dict_always", models.module_dict, {"auto_wrap": ALWAYS}),
    ("module_dict_size_based_0", models.module_dict, {"auto_wrap": size_based(0)}),
    # requires_grad mixes
    ("frozen_mix_none", models.frozen_mix, {"auto_wrap": NONE}),
    ("frozen_mix_always", models.frozen_mix, {"auto_wrap": ALWAYS}),
    ("frozen_mix_ignored_proj", models.frozen_mix,
     {"auto_wrap": module_types("Embedding"), "ignored_modules": ["proj"]}),
    ("frozen_modules_none", models.frozen_modules, {"auto_wrap": NONE}),
    ("frozen_modules_always", models.frozen_modules, {"auto_wrap": ALWAYS}),
    # scalar and zero-size params
    ("scalar_zero_none", models.scalar_zero, {"auto_wrap": NONE}),
    ("scalar_zero_always", models.scalar_zero, {"auto_wrap": ALWAYS}),
    # dtypes
    ("mlp_fp16_always", models.mlp_fp16, {"auto_wrap": ALWAYS}),
    ("mlp_bf16_size_based_0", models.mlp_bf16, {"auto_wrap": size_based(0)}),
    ("mlp_fp64_none", models.mlp_fp64, {"auto_wrap": NONE}),
    ("mixed_dtype_modules_none", models.mixed_dtype_modules, {"auto_wrap": NONE}),
    ("mixed_dtype_modules_always", models.mixed_dtype_modules, {"auto_wrap": ALWAYS}),
    ("mixed_dtype_in_module_always", models.mixed_dtype_in_module, {"auto_wrap": ALWAYS}),
    ("int_param_none", models.int_param, {"auto_wrap": NONE}),
    ("int_param_always", models.int_param, {"auto_wrap": ALWAYS}),
]

# Cases where FSDP 1.13 does something shared/spec/semantics.md (written from
# the 2.x source) does not, or where the mapping of the flatshard policy to
# 1.13 arguments is not exact.  Written into <case>.expected.json as "notes".
TIED_DUP = ("fsdp-1.13: a tied parameter registered in two units' subtrees is flattened "
            "into BOTH units (copied twice, the tie is broken); semantics.md §1 puts it only "
            "in the first unit formed and counts it as 0 for later size decisions")
IGNORED_NESTED = ("fsdp-1.13: nested auto-wrapped FSDP instances are constructed without "
                  "ignored_modules, so an ignored module inside an auto-wrapped unit is "
                  "flattened into that unit although FSDP still lists its params as ignored")
NOTES: Dict[str, List[str]] = {
    "gpt_tied_always": [TIED_DUP],
    "gpt_tied_size_based_0": [TIED_DUP],
    "gpt_tied_size_based_1": [TIED_DUP],
    "gpt_tied_size_based_1k": [TIED_DUP],
    "gpt_tied_size_based_leaf_block": [TIED_DUP],
    "gpt_tied_explicit": [TIED_DUP],
    "gpt_tied_module_types_block_ignored_mlp": [IGNORED_NESTED],
    "shared_module_ignored_second_path": [IGNORED_NESTED],
    "shared_module_always": [
        "fsdp-1.13: revisiting the shared module through its second path finds its "
        "children already wrapped and trips _recursive_wrap's assert; semantics.md §1 "
        "treats an already-wrapped module as 0 numel and succeeds"],
    "shared_module_explicit_second_path": [
        "explicit is emulated with lambda_auto_wrap_policy testing module identity, so "
        "the shared instance named by its second path is wrapped where it is first "
        "reached (branch_a.shared); a purely path-based planner wraps it at branch_b.shared"],
    "shared_module_none": [
        "fsdp-1.13: named_modules() dedups the shared module, so its second path "
        "(branch_b.shared.*) appears neither in params nor in shared"],
    "alias_net_always": [
        "fsdp-1.13: the aliased module appears only at its first path (layer), never as alias"],
    "alias_net_none": [
        "fsdp-1.13: the aliased module appears only at its first path (layer), never as alias"],
    "tied_params_none": [
        "fsdp-1.13: a Parameter registered twice on the SAME module (proj.weight, "
        "proj.weight_alias) is flattened once and the second name is left registered, "
        "which _check_orig_params_flattened rejects"],
    "tied_params_always": [
        "fsdp-1.13: a Parameter registered twice on the SAME module (proj.weight, "
        "proj.weight_alias) is flattened once and the second name is left registered, "
        "which _check_orig_params_flattened rejects"],
    "scalar_zero_always": [
        "fsdp-1.13: a module whose only param has 0 elements (zero) still gets a unit, "
        "with numel 0"],
    "convnet_bn_size_based_mp": [
        "fsdp-1.13 has no module_types_to_ignore: with mixed_precision and an "
        "auto_wrap_policy it always ORs in _wrap_batchnorm_individually (_BatchNorm)"],
}

EXAMPLES = [
    ("gpt_tied", models.gpt_tied, {"auto_wrap": module_types("Block")}),
    ("convnet_bn", models.convnet_bn, {
        "auto_wrap": size_based(100),
        "mixed_precision": {"param_dtype": "bfloat16",
                            "module_types_to_ignore": ["_BatchNorm"]}}),
    ("shared_module", models.shared_module, {"auto_wrap": ALWAYS}),
]

# --------------------------------------------------------------------------
# flatshard policy -> FSDP 1.13 arguments
# --------------------------------------------------------------------------
SIZE_BASED_DEFAULTS = {
    "min_num_params": 100000000,
    "force_leaf_types": ["MultiheadAttention"],
    "exclude_wrap_types": ["ModuleList", "ModuleDict"],
}
DTYPES = {"float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64}


def class_resolver(model: nn.Module) -> Callable[[str], type]:
    """Resolve a class name from the model's own module classes (and their
    module bases), falling back to torch.nn."""
    known: Dict[str, type] = {}
    for m in model.modules():
        for c in type(m).__mro__:
            if isinstance(c, type) and issubclass(c, nn.Module):
                known.setdefault(c.__name__, c)

    def resolve(name: str) -> type:
        if name in known:
            return known[name]
        for ns in (nn, nn.modules.batchnorm, nn.modules.conv, nn.modules.normalization):
            c = getattr(ns, name, None)
            if isinstance(c, type) and issubclass(c, nn.Module):
                return c
        raise KeyError(f"unknown module type {name!r}")

    return resolve


def module_at(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def fsdp_policy(model: nn.Module, p: Dict[str, Any]) -> Optional[Callable]:
    resolve = class_resolver(model)
    kind = p["kind"]
    if kind == "none":
        return None
    if kind == "always":
        return always_wrap_policy
    if kind == "size_based":
        q = {**SIZE_BASED_DEFAULTS, **p}
        return functools.partial(
            size_based_auto_wrap_policy,
            min_num_params=q["min_num_params"],
            force_leaf_modules={resolve(n) for n in q["force_leaf_types"]},
            exclude_wrap_modules={resolve(n) for n in q["exclude_wrap_types"]},
        )
    if kind == "module_types":
        return functools.partial(
            transformer_auto_wrap_policy,
            transformer_layer_cls={resolve(n) for n in p["types"]},
        )
    if kind == "explicit":
        targets = [module_at(model, path) for path in p["paths"]]
        return functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: any(m is t for t in targets),
        )
    if kind == "any":
        subs = [fsdp_policy(model, s) for s in p["policies"]]
        return functools.partial(_or_policy, policies=subs)
    raise ValueError(f"unknown auto_wrap kind {kind!r}")


def fsdp_kwargs(model: nn.Module, policy: Dict[str, Any]) -> Dict[str, Any]:
    kw: Dict[str, Any] = {
        "auto_wrap_policy": fsdp_policy(model, policy.get("auto_wrap", NONE)),
    }
    if policy.get("ignored_modules"):
        kw["ignored_modules"] = [module_at(model, p) for p in policy["ignored_modules"]]
    mp = policy.get("mixed_precision")
    if mp:
        # FSDP 1.13 has no module_types_to_ignore: with an auto_wrap_policy it
        # always wraps _BatchNorm separately with mixed precision disabled.
        if mp.get("module_types_to_ignore", ["_BatchNorm"]) != ["_BatchNorm"]:
            raise ValueError("FSDP 1.13 can only ignore _BatchNorm for mixed precision")
        kw["mixed_precision"] = MixedPrecision(
            param_dtype=DTYPES.get(mp.get("param_dtype")),
            reduce_dtype=DTYPES.get(mp.get("reduce_dtype")),
            buffer_dtype=DTYPES.get(mp.get("buffer_dtype")),
        )
    return kw


# --------------------------------------------------------------------------
# Recording what FSDP built
# --------------------------------------------------------------------------
def clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p and p not in WRAPPER_PARTS)


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    if msg:
        return f"{type(e).__name__}: {msg[0]}"
    # A bare `assert`: name the failing statement and where it sits in torch.
    import traceback

    frame = traceback.extract_tb(e.__traceback__)[-1]
    path = frame.filename
    if "/torch/" in path:
        path = "torch/" + path.split("/torch/", 1)[1]
    return f"{type(e).__name__}: {frame.line} ({path}, {frame.name})"


def record_units(wrapped: nn.Module) -> List[Dict[str, Any]]:
    units = []
    for name, m in wrapped.named_modules():
        if not isinstance(m, FSDP):
            continue
        mod_fqn = clean(name)
        inner = m._fsdp_wrapped_module._fpw_module
        for h in m._handles:
            fp = h.flat_param
            params = []
            for pname, shape, numel in zip(fp._prefixed_param_names, fp._shapes, fp._numels):
                params.append({"fqn": join(mod_fqn, clean(pname)),
                               "shape": [int(s) for s in shape],
                               "numel": int(numel)})
            shared = [
                {"fqn": join(mod_fqn, clean(join(spi.module_name, spi.param_name))),
                 "same_as": join(mod_fqn, clean(join(spi.prim_module_name,
                                                     spi.prim_param_name)))}
                for spi in fp._shared_param_infos
            ]
            units.append({
                "module": mod_fqn,
                "module_type": type(inner).__name__,
                "dtype": dtype_name(fp.dtype),
                "requires_grad": bool(fp.requires_grad),
                "params": params,
                "shared": shared,
                "numel": int(fp._unpadded_unsharded_size.numel()),
                # only meaningful for sharded strategies (world size > 1)
                "_local_numel": int(fp.numel()),
                "_numel_padded": int(getattr(fp, "_shard_numel_padded", 0)),
            })
    return units


def run_case(factory: Callable[[], nn.Module], policy: Dict[str, Any]) -> Dict[str, Any]:
    """Wrap a fresh model with FSDP in the current process group."""
    torch.manual_seed(0)
    model = factory()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kw = fsdp_kwargs(model, policy)
            wrapped = FSDP(model, **kw)
        except Exception as e:  # noqa: BLE001 - recorded as the expected outcome
            return {"error": error_text(e)}
    msgs = sorted({str(w.message).strip().splitlines()[0] for w in caught
                   if not str(w.message).startswith(BORING_WARNINGS)})
    return {
        "units": record_units(wrapped),
        "ignored_params": sorted(wrapped._ignored_param_names),
        "warnings": msgs,
    }


def unit_key(u: Dict[str, Any]) -> Any:
    return (u["module"], tuple(p["fqn"] for p in u["params"]), u["numel"])


def expected_doc(res: Dict[str, Any], by_ws: Dict[int, List[Dict[str, Any]]],
                 notes: List[str]) -> Dict[str, Any]:
    doc: Dict[str, Any] = {"torch_version": fsdp_env.torch_version()}
    if "error" in res:
        doc["error"] = res["error"]
        if notes:
            doc["notes"] = notes
        return doc
    doc["world_size"] = 1
    doc["units"] = [{k: v for k, v in u.items() if not k.startswith("_")}
                    for u in res["units"]]
    doc["ignored_params"] = res["ignored_params"]
    if res["warnings"]:
        doc["fsdp_warnings"] = res["warnings"]
    if by_ws:
        shard: Dict[str, List[int]] = {}
        unpadded: Dict[str, List[List[int]]] = {}
        for ws in sorted(by_ws):
            ranks = by_ws[ws]  # list indexed by rank of per-rank results
            for r, rr in enumerate(ranks):
                if "error" in rr:
                    raise RuntimeError(f"world size {ws} rank {r}: {rr['error']}")
                if [unit_key(u) for u in rr["units"]] != [unit_key(u) for u in res["units"]]:
                    raise RuntimeError(f"world size {ws} rank {r} built different units")
            n_units = len(res["units"])
            locals_ = [[rr["units"][i]["_local_numel"] for rr in ranks] for i in range(n_units)]
            for i, l in enumerate(locals_):
                if len(set(l)) != 1:
                    raise RuntimeError(f"world size {ws}: unequal shard sizes {l} for unit {i}")
            shard[str(ws)] = [l[0] for l in locals_]
            unpadded[str(ws)] = [
                [rr["units"][i]["_local_numel"] - rr["units"][i]["_numel_padded"] for rr in ranks]
                for i in range(n_units)
            ]
        doc["shard_numel_by_world_size"] = shard
        doc["unpadded_shard_numel_by_world_size"] = unpadded
    if notes:
        doc["notes"] = notes
    return doc


# --------------------------------------------------------------------------
# Multi-process runs (world sizes 2, 3)
# --------------------------------------------------------------------------
def _worker(rank: int, world_size: int, port: int, outdir: str, names: List[str]) -> None:
    fsdp_env.init_gloo(rank, world_size, port)
    by_name = {c[0]: c for c in CASES}
    results = {}
    for name in names:
        _, factory, policy = by_name[name]
        results[name] = run_case(factory, policy)
    with open(os.path.join(outdir, f"ws{world_size}_rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def run_world_sizes(names: List[str]) -> Dict[str, Dict[int, List[Dict[str, Any]]]]:
    import torch.multiprocessing as mp

    out: Dict[str, Dict[int, List[Dict[str, Any]]]] = {n: {} for n in names}
    with tempfile.TemporaryDirectory(prefix="fsdp_fixtures_") as tmp:
        for ws in WORLD_SIZES:
            mp.spawn(_worker, args=(ws, fsdp_env.free_port(), tmp, names),
                     nprocs=ws, join=True)
            per_rank = []
            for r in range(ws):
                with open(os.path.join(tmp, f"ws{ws}_rank{r}.json")) as f:
                    per_rank.append(json.load(f))
            for n in names:
                out[n][ws] = [pr[n] for pr in per_rank]
    return out


# --------------------------------------------------------------------------
def write(path: str, doc: Any) -> None:
    with open(path, "w") as f:
        f.write(dumps(doc, indent=1))


def policy_doc(policy: Dict[str, Any]) -> Dict[str, Any]:
    return {"format": "flatshard.policy/1", **policy}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description="Generate FSDP 1.13 ground-truth fixtures.")
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "fsdp"))
    ap.add_argument("--examples", default=os.path.join(REPO, "examples", "models"))
    ap.add_argument("--no-world-sizes", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)

    names = [c[0] for c in CASES]
    if len(set(names)) != len(names):
        raise SystemExit("duplicate case names")
    if set(NOTES) - set(names):
        raise SystemExit(f"NOTES for unknown cases: {sorted(set(NOTES) - set(names))}")
    if args.only:
        wanted = set(args.only.split(","))
        names = [n for n in names if n in wanted]
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.examples, exist_ok=True)

    fsdp_env.init_gloo(0, 1, fsdp_env.free_port())
    by_name = {c[0]: c for c in CASES}
    ws1 = {}
    for n in names:
        _, factory, policy = by_name[n]
        torch.manual_seed(0)
        write(os.path.join(args.out, f"{n}.manifest.json"), manifest_from_module(factory()))
        write(os.path.join(args.out, f"{n}.policy.json"), policy_doc(policy))
        ws1[n] = run_case(factory, policy)
    torch.distributed.destroy_process_group()

    multi: Dict[str, Dict[int, List[Dict[str, Any]]]] = {}
    if not args.no_world_sizes:
        ok = [n for n in names if "error" not in ws1[n]]
        multi = run_world_sizes(ok)

    for n in names:
        doc = expected_doc(ws1[n], multi.get(n, {}), NOTES.get(n, []))
        write(os.path.join(args.out, f"{n}.expected.json"), doc)
        status = doc.get("error") or f"{len(doc['units'])} units"
        print(f"{n}: {status}")

    if not args.only:
        for n, factory, policy in EXAMPLES:
            torch.manual_seed(0)
            write(os.path.join(args.examples, f"{n}.manifest.json"),
                  manifest_from_module(factory()))
            write(os.path.join(args.examples, f"{n}.policy.json"), policy_doc(policy))
    print(f"{len(names)} cases written to {os.path.relpath(args.out, os.getcwd())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
