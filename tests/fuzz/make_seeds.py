#!/usr/bin/env python3
"""Writes the hand-made seed inputs of tests/fuzz/corpus/ (see planner_fuzzer.cc for the layout).

    python3 tests/fuzz/make_seeds.py [--flatshardctl build/client/flatshardctl]

Seeds are named seed_*, reproducers of fixed (or still open) bugs regressions/*; files libFuzzer adds on a merge are named by their SHA-1 and are left
alone. With --flatshardctl, valid plan documents are added too (the whole input is then a plan,
fed to PlanFromJson). Deterministic: the same tree gives the same files.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
FIXTURES = os.path.join(ROOT, "tests", "data", "fsdp")
EXAMPLES = os.path.join(ROOT, "examples", "models")

MF = "flatshard.manifest/1"
PF = "flatshard.policy/1"


def compact(obj):
    return json.dumps(obj, separators=(",", ":"))


def load(path):
    with open(path) as f:
        return json.load(f)


def options_byte(world_size, ranks_per_node=0):
    assert 1 <= world_size <= 8 and 0 <= ranks_per_node <= 7
    return bytes([(world_size - 1) | (ranks_per_node << 3)])


def pair(manifest_text, policy_text, world_size=1, ranks_per_node=0):
    if isinstance(manifest_text, (dict, list)):
        manifest_text = compact(manifest_text)
    if isinstance(policy_text, (dict, list)):
        policy_text = compact(policy_text)
    return (options_byte(world_size, ranks_per_node) + manifest_text.encode() + b"\0" +
            policy_text.encode())


def param(name, pid, shape, dtype="float32", requires_grad=True):
    return {"name": name, "id": pid, "shape": shape, "dtype": dtype, "requires_grad": requires_grad}


def module(mid, mtype, params=(), children=(), bases=("Module",), buffers=None):
    m = {"id": mid, "type": mtype, "bases": list(bases), "params": list(params),
         "children": [{"name": n, "module": c} for n, c in children]}
    if buffers is not None:
        m["buffers"] = buffers
    return m


def manifest(root):
    return {"format": MF, "root": root}


def small_net():
    """root -> a (Linear), b (Linear, weight tied to a.weight), c = ref a."""
    a = module(1, "Linear", [param("weight", 0, [4, 3]), param("bias", 1, [4])])
    b = module(2, "Linear", [param("weight", 0, [4, 3]), param("bias", 2, [4])])
    return manifest(module(0, "Net", [param("scale", 3, [])],
                           [("a", a), ("b", b), ("c", {"ref": 1})]))


def seeds():
    out = {}

    # --- Valid manifest + policy pairs from the FSDP fixtures and the examples. ---
    fixture_cases = [
        ("alias_net_always", 1), ("convnet_bn_size_based_mp", 2), ("frozen_mix_always", 1),
        ("frozen_mix_ignored_proj", 3), ("frozen_modules_always", 4),
        ("gpt_tied_any", 2), ("gpt_tied_explicit", 1), ("gpt_tied_ignored_wte", 8),
        ("gpt_tied_module_types_block_ignored_mlp", 3), ("gpt_tied_size_based_leaf_block", 5),
        ("int_param_always", 1), ("mixed_dtype_in_module_always", 2), ("mlp_bf16_size_based_0", 7),
        ("mlp_fp16_always", 6), ("module_dict_size_based_0", 2), ("scalar_zero_always", 3),
        ("shared_module_explicit_second_path", 4), ("shared_module_ignored_second_path", 1),
        ("tied_params_always", 2), ("transformer_encoder_size_based_no_leaf", 4),
    ]
    for name, world in fixture_cases:
        m = load(os.path.join(FIXTURES, name + ".manifest.json"))
        p = load(os.path.join(FIXTURES, name + ".policy.json"))
        out["seed_fixture_" + name] = pair(m, p, world)
    for name in ("convnet_bn", "gpt_tied", "shared_module"):
        m = load(os.path.join(EXAMPLES, name + ".manifest.json"))
        p = load(os.path.join(EXAMPLES, name + ".policy.json"))
        out["seed_example_" + name] = pair(m, p, 2)

    # --- Policy variants on a small net with a tied param and a shared module. ---
    net = small_net()
    out["seed_policy_hybrid"] = pair(net, {"format": PF, "auto_wrap": {"kind": "always"},
                                           "sharding_strategy": "HYBRID_SHARD"}, 8, 4)
    out["seed_policy_hybrid_bad_rpn"] = pair(net, {"sharding_strategy": "HYBRID_SHARD"}, 6, 4)
    out["seed_policy_no_shard_orig"] = pair(net, {"use_orig_params": True,
                                                  "sharding_strategy": "NO_SHARD",
                                                  "auto_wrap": {"kind": "module_types",
                                                                "types": ["Linear"]}}, 5)
    out["seed_policy_grad_op_mp"] = pair(net, {
        "sharding_strategy": "SHARD_GRAD_OP",
        "auto_wrap": {"kind": "size_based", "min_num_params": 5,
                      "force_leaf_types": [], "exclude_wrap_types": ["Net"]},
        "mixed_precision": {"param_dtype": "float16", "reduce_dtype": "float32",
                            "buffer_dtype": "bfloat16", "module_types_to_ignore": ["Linear"]}}, 3)
    out["seed_policy_any_nested"] = pair(net, {"auto_wrap": {"kind": "any", "policies": [
        {"kind": "explicit", "paths": ["c"]},
        {"kind": "any", "policies": [{"kind": "none"}, {"kind": "module_types", "types": []}]}]}},
        2)
    out["seed_policy_ignored"] = pair(net, {"ignored_modules": ["c"], "ignored_params": ["scale"],
                                            "auto_wrap": {"kind": "always"}}, 2)
    out["seed_policy_ignore_root"] = pair(net, {"ignored_modules": [""]}, 1)
    out["seed_policy_unknown_path"] = pair(net, {"auto_wrap": {"kind": "explicit",
                                                               "paths": ["a.nope"]}}, 1)
    out["seed_policy_bad_format"] = pair(net, {"format": "flatshard.policy/2"}, 1)
    out["seed_policy_unknown_key"] = pair(net, {"auto_wrap": {"kind": "always", "x": 1}}, 1)
    out["seed_policy_wrong_types"] = pair(net, {"use_orig_params": "yes",
                                                "auto_wrap": {"kind": "any", "policies": []},
                                                "mixed_precision": {"param_dtype": "int8"}}, 1)
    out["seed_policy_negative_min"] = pair(net, {"auto_wrap": {"kind": "size_based",
                                                               "min_num_params": -1}}, 1)
    out["seed_no_separator"] = options_byte(2) + compact(net).encode()

    # --- Manifests that must be refused. ---
    def bad(name, root_or_doc, world=1, raw=False):
        text = root_or_doc if raw else compact(root_or_doc)
        out["seed_bad_" + name] = pair(text, "{}", world)

    lin = lambda mid, pid: module(mid, "Linear", [param("weight", pid, [2, 2])])
    bad("format_version", {"format": "flatshard.manifest/2", "root": lin(0, 0)})
    bad("dangling_ref", manifest(module(0, "Net", [], [("a", {"ref": 7})])))
    bad("cyclic_ref", manifest(module(0, "Net", [], [("a", module(1, "M", [], [("b", {"ref": 1})]))])))
    bad("root_ref", {"format": MF, "root": {"ref": 0}})
    bad("ref_extra_key", manifest(module(0, "Net", [], [("a", lin(1, 0)),
                                                        ("b", {"ref": 1, "id": 3})])))
    bad("duplicate_module_id", manifest(module(0, "Net", [], [("a", lin(1, 0)), ("b", lin(1, 1))])))
    bad("tied_shape_conflict", manifest(module(0, "Net", [param("w", 5, [2, 3])],
                                               [("a", module(1, "L", [param("w", 5, [3, 2])]))])))
    bad("tied_dtype_conflict", manifest(module(0, "Net", [param("w", 5, [2])],
                                               [("a", module(1, "L", [param("w", 5, [2], "float16")]))])))
    bad("tied_grad_conflict", manifest(module(0, "Net", [param("w", 5, [2])],
                                              [("a", module(1, "L", [param("w", 5, [2], "float32", False)]))])))
    bad("negative_dim", manifest(module(0, "Net", [param("w", 0, [-1, 4])])))
    bad("float_dim", manifest(module(0, "Net", [param("w", 0, [2.0])])))
    bad("numel_overflow", manifest(module(0, "Net", [param("w", 0, [4294967296, 4294967296])])))
    bad("uint64_dim", '{"format":"%s","root":{"id":0,"type":"N","params":[{"name":"w","id":0,'
        '"shape":[18446744073709551615],"dtype":"float32"}]}}' % MF, raw=True)
    bad("huge_exponent", '{"format":"%s","root":{"id":1e400,"type":"N"}}' % MF, raw=True)
    bad("bignum_id", '{"format":"%s","root":{"id":123456789012345678901234567890,"type":"N"}}'
        % MF, raw=True)
    bad("duplicate_key", '{"format":"%s","root":{"id":0,"type":"N","type":"M"}}' % MF, raw=True)
    bad("unknown_key", manifest(dict(lin(0, 0), extra=True)))
    bad("wrong_types", {"format": MF, "root": {"id": "0", "type": 3, "params": {}, "children": 1}})
    bad("dotted_name", manifest(module(0, "Net", [param("a.b", 0, [1])])))
    bad("empty_name", manifest(module(0, "Net", [], [("", lin(1, 0))])))
    bad("name_clash", manifest(module(0, "Net", [param("x", 0, [1])], [("x", lin(1, 1))])))
    bad("unknown_dtype", manifest(module(0, "Net", [param("w", 0, [1], "float8")])))
    bad("truncated", compact(small_net())[:57], raw=True)
    bad("deep_arrays", "[" * 600 + "]" * 600, raw=True)
    bad("deep_objects", '{"a":' * 520 + "1" + "}" * 520, raw=True)
    bad("not_object", "[1,2,3]", raw=True)
    bad("nul_escape_name", '{"format":"%s","root":{"id":0,"type":"N\\u0000","params":[{"name":'
        '"\\ud83d\\ude00","id":0,"shape":[],"dtype":"float32"}]}}' % MF, raw=True)
    bad("lone_surrogate", '{"format":"%s","root":{"id":0,"type":"\\ud800"}}' % MF, raw=True)
    bad("comment", '{"format":"%s",/*x*/"root":{"id":0,"type":"N"}}' % MF, raw=True)

    # --- Valid but demanding manifests. ---
    # Each level registers the previous one twice: 2^24 paths, refused by max_module_paths.
    inner = lin(1, 0)
    for level in range(24):
        inner = module(level + 2, "Pair", [], [("l", inner), ("r", {"ref": level + 1})])
    out["seed_exponential_refs"] = pair(manifest(module(0, "Net", [], [("x", inner)])),
                                        {"auto_wrap": {"kind": "always"}}, 2)
    # Two large params in one unit: their total overflows int64.
    out["regressions/planner_flatten_numel_overflow"] = pair(
        manifest(module(0, "Net", [param("a", 0, [4611686018427387904]),
                                   param("b", 1, [2, 2305843009213693952])])), "{}", 2)
    out["regressions/planner_unwrapped_numel_overflow"] = pair(
        manifest(module(0, "Net", [], [("x", module(1, "L", [param("a", 0, [9223372036854775807])])),
                                       ("y", module(2, "L", [param("b", 1, [9223372036854775807])]))])),
        {"auto_wrap": {"kind": "size_based", "min_num_params": 1}}, 3)
    # One tensor of 2^62 float32 elements: 2^64 bytes.
    out["regressions/plan_summarize_memory_overflow"] = pair(
        manifest(module(0, "Net", [param("a", 0, [4611686018427387904])])), "{}", 1)
    out["seed_orig_params_align_overflow"] = pair(
        manifest(module(0, "Net", [param("a", 0, [1], "float16"),
                                   param("b", 1, [9223372036854775800], "float16")])),
        {"use_orig_params": True}, 7)
    out["seed_zero_numel"] = pair(
        manifest(module(0, "Net", [param("a", 0, [0, 5]), param("b", 1, [0]), param("c", 2, [])],
                        [("e", module(1, "Empty"))])), {"use_orig_params": True}, 8)
    depth_chain = lin(200, 0)
    for level in range(150):
        depth_chain = module(level + 1, "Seq", [param("p", level + 1, [1])], [("m", depth_chain)])
    out["seed_deep_tree"] = pair(manifest(module(0, "Net", [], [("m", depth_chain)])),
                                 {"auto_wrap": {"kind": "always"}}, 4)
    # A ladder of refs: m_k registers m_(k-1), so the root reaches n(n+1)/2 + 1 module paths
    # 201 modules deep, from a manifest linear in n. ManifestFromJson used to accept it (its
    # depth limit counted JSON nesting only) while ValidateManifest refused it.
    children = []
    for k in range(1, 201):
        m = module(k, "L", [param("w", k, [2])])
        if k > 1:
            m["children"].append({"name": "p", "module": {"ref": k - 1}})
        children.append(("m%d" % k, m))
    out["regressions/manifest_depth_via_refs_validate_mismatch"] = pair(
        manifest(module(0, "Net", [], children)), {"auto_wrap": {"kind": "always"}}, 2)
    # One Linear registered 19,702 times (a: 99 refs to it, then 198 refs to a): 19,902 module
    # paths, so the root unit lists 19,701 `shared` FQNs. Reading that plan back took ~50 s
    # under the sanitizers: nlohmann's callback parser (ParseJson's duplicate-key check)
    # is quadratic in the length of an array of objects.
    a = module(2, "Fan", [], [(str(i), {"ref": 1}) for i in range(99)])
    wide = [("p", lin(1, 0)), ("a", a)] + [("b%d" % i, {"ref": 2}) for i in range(198)]
    out["regressions/json_parse_quadratic_shared_list"] = pair(
        manifest(module(0, "Net", [], wide)), "{}", 2)
    # Long names times many paths: a 100 KB module name above 19,902 module paths (within the
    # fuzzer's path limit) makes ~20,000 FQNs of 100 KB each, plus as many `same_as` copies:
    # about 4 GB for a 100 KB input. max_module_paths bounds paths, not FQN bytes (at the
    # default limit an 88 KB manifest asks for ~20 GB and dies of std::bad_alloc).
    b = module(3, "Fan", [], [("l0", lin(4, 0))] + [("l%d" % i, {"ref": 4}) for i in range(1, 99)])
    fan = module(2, "Fan", [], [("b0", b)] + [("b%d" % i, {"ref": 3}) for i in range(1, 199)])
    out["regressions/planner_fqn_bytes_unbounded"] = pair(
        manifest(module(0, "Net", [], [("x" * 100000, fan)])), "{}", 2)
    return out


def plan_seeds(flatshardctl):
    """Valid plan documents (and two corruptions), each prefixed by a JSON whitespace byte."""
    out = {}
    cases = [("gpt_tied_any", 2), ("shared_module_always", 4), ("tied_params_always", 1),
             ("frozen_mix_ignored_proj", 3)]
    for name, world in cases:
        args = [flatshardctl, "plan", "--manifest", os.path.join(FIXTURES, name + ".manifest.json"),
                "--policy", os.path.join(FIXTURES, name + ".policy.json"),
                "--world-size", str(world)]
        text = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        doc = json.loads(text)
        out["seed_plan_" + name] = b" " + compact(doc).encode()
    doc = json.loads(out["seed_plan_gpt_tied_any"][1:])
    doc["fingerprint"] = "0" * 64
    out["seed_plan_bad_fingerprint"] = b"\n" + compact(doc).encode()
    doc = json.loads(out["seed_plan_tied_params_always"][1:])
    doc["units"][0]["params"][-1]["offset"] += 1
    out["seed_plan_bad_offset"] = b"\t" + compact(doc).encode()
    doc = json.loads(out["seed_plan_shared_module_always"][1:])
    doc["format"] = "flatshard.plan/0"
    out["seed_plan_bad_format"] = b"\r" + compact(doc).encode()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flatshardctl", help="built flatshardctl, to add plan documents")
    args = parser.parse_args()
    files = seeds()
    if args.flatshardctl:
        files.update(plan_seeds(args.flatshardctl))
    for name, data in sorted(files.items()):
        os.makedirs(os.path.dirname(os.path.join(CORPUS, name)), exist_ok=True)
        with open(os.path.join(CORPUS, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(files)} seeds to {os.path.relpath(CORPUS, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
