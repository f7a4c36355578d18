// Tests for common/policy: flatshard.policy/1 parsing (formats.md "Policy"), defaults of every
// auto-wrap kind, errors naming the JSON path, and the PolicyToJson round trip.

#include "common/policy.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

Policy MustParse(const std::string& text) {
  absl::StatusOr<Policy> p = PolicyFromJson(text);
  EXPECT_TRUE(p.ok()) << p.status() << "\n" << text;
  return p.ok() ? *p : Policy{};
}

void ExpectRefused(const std::string& text, const std::string& message) {
  absl::StatusOr<Policy> p = PolicyFromJson(text);
  ASSERT_FALSE(p.ok()) << text;
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(p.status()), message);
}

TEST(PolicyTest, FormatsExampleParses) {
  Policy p = MustParse(R"({
    "format": "flatshard.policy/1",
    "auto_wrap": {"kind": "size_based", "min_num_params": 100000000,
                  "force_leaf_types": ["MultiheadAttention"],
                  "exclude_wrap_types": ["ModuleList", "ModuleDict"]},
    "ignored_modules": ["h.1"],
    "ignored_params": ["lm_head.weight"],
    "use_orig_params": false,
    "sharding_strategy": "FULL_SHARD",
    "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                        "module_types_to_ignore": ["_BatchNorm"]}
  })");
  EXPECT_EQ(p.auto_wrap.kind, AutoWrapKind::kSizeBased);
  EXPECT_EQ(p.auto_wrap.min_num_params, 100000000);
  EXPECT_THAT(p.auto_wrap.force_leaf_types, ElementsAre("MultiheadAttention"));
  EXPECT_THAT(p.auto_wrap.exclude_wrap_types, ElementsAre("ModuleList", "ModuleDict"));
  EXPECT_THAT(p.ignored_modules, ElementsAre("h.1"));
  EXPECT_THAT(p.ignored_params, ElementsAre("lm_head.weight"));
  EXPECT_FALSE(p.use_orig_params);
  EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kFullShard);
  ASSERT_TRUE(p.mixed_precision.has_value());
  EXPECT_EQ(p.mixed_precision->param_dtype, DType::kBFloat16);
  EXPECT_EQ(p.mixed_precision->reduce_dtype, DType::kFloat32);
  EXPECT_FALSE(p.mixed_precision->buffer_dtype.has_value());
  EXPECT_THAT(p.mixed_precision->module_types_to_ignore, ElementsAre("_BatchNorm"));
}

TEST(PolicyTest, EmptyDocumentGivesDefaults) {
  Policy p = MustParse("{}");
  EXPECT_EQ(p.auto_wrap.kind, AutoWrapKind::kNone);
  EXPECT_THAT(p.ignored_modules, IsEmpty());
  EXPECT_THAT(p.ignored_params, IsEmpty());
  EXPECT_FALSE(p.use_orig_params);
  EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kFullShard);
  EXPECT_FALSE(p.mixed_precision.has_value());
  EXPECT_EQ(p, Policy{});
}

TEST(PolicyTest, FormatIsOptionalButMustBeExactWhenGiven) {
  EXPECT_EQ(MustParse(R"({"format": "flatshard.policy/1"})"), Policy{});
  ExpectRefused(R"({"format": "flatshard.policy/2"})",
                "policy: $.format: unknown format \"flatshard.policy/2\", expected "
                "\"flatshard.policy/1\"");
  ExpectRefused(R"({"format": 1})", "policy: $.format: must be a string, got an integer");
}

TEST(PolicyTest, SizeBasedDefaults) {
  Policy p = MustParse(R"({"auto_wrap": {"kind": "size_based"}})");
  EXPECT_EQ(p.auto_wrap.kind, AutoWrapKind::kSizeBased);
  EXPECT_EQ(p.auto_wrap.min_num_params, 100000000);
  EXPECT_THAT(p.auto_wrap.force_leaf_types, ElementsAre("MultiheadAttention"));
  EXPECT_THAT(p.auto_wrap.exclude_wrap_types, ElementsAre("ModuleList", "ModuleDict"));
}

TEST(PolicyTest, SizeBasedExplicitValuesIncludingEmptyLists) {
  Policy p = MustParse(R"({"auto_wrap": {"kind": "size_based", "min_num_params": 0,
                          "force_leaf_types": [], "exclude_wrap_types": ["Seq"]}})");
  EXPECT_EQ(p.auto_wrap.min_num_params, 0);
  EXPECT_THAT(p.auto_wrap.force_leaf_types, IsEmpty());
  EXPECT_THAT(p.auto_wrap.exclude_wrap_types, ElementsAre("Seq"));
}

TEST(PolicyTest, NoneAndAlwaysTakeNoFields) {
  EXPECT_EQ(MustParse(R"({"auto_wrap": {"kind": "none"}})").auto_wrap.kind, AutoWrapKind::kNone);
  EXPECT_EQ(MustParse(R"({"auto_wrap": {"kind": "always"}})").auto_wrap.kind,
            AutoWrapKind::kAlways);
  ExpectRefused(R"({"auto_wrap": {"kind": "always", "min_num_params": 5}})",
                "policy: $.auto_wrap: unknown key \"min_num_params\" (allowed: kind)");
  ExpectRefused(R"({"auto_wrap": {"kind": "none", "types": []}})",
                "policy: $.auto_wrap: unknown key \"types\" (allowed: kind)");
}

TEST(PolicyTest, ModuleTypesRequiresTypes) {
  Policy p =
      MustParse(R"({"auto_wrap": {"kind": "module_types", "types": ["Block", "Embedding"]}})");
  EXPECT_EQ(p.auto_wrap.kind, AutoWrapKind::kModuleTypes);
  EXPECT_THAT(p.auto_wrap.types, ElementsAre("Block", "Embedding"));
  ExpectRefused(R"({"auto_wrap": {"kind": "module_types"}})",
                "policy: $.auto_wrap: missing required key \"types\"");
  ExpectRefused(R"({"auto_wrap": {"kind": "module_types", "types": "Block"}})",
                "policy: $.auto_wrap.types: must be an array of strings, got a string");
  ExpectRefused(R"({"auto_wrap": {"kind": "module_types", "types": ["Block", 3]}})",
                "policy: $.auto_wrap.types[1]: must be a string, got an integer");
  ExpectRefused(R"({"auto_wrap": {"kind": "module_types", "types": [], "paths": []}})",
                "policy: $.auto_wrap: unknown key \"paths\" (allowed: kind, types)");
}

TEST(PolicyTest, ExplicitRequiresPaths) {
  Policy p = MustParse(R"({"auto_wrap": {"kind": "explicit", "paths": ["h.0", "h.1.attn"]}})");
  EXPECT_EQ(p.auto_wrap.kind, AutoWrapKind::kExplicit);
  EXPECT_THAT(p.auto_wrap.paths, ElementsAre("h.0", "h.1.attn"));
  ExpectRefused(R"({"auto_wrap": {"kind": "explicit"}})",
                "policy: $.auto_wrap: missing required key \"paths\"");
  ExpectRefused(R"({"auto_wrap": {"kind": "explicit", "paths": [], "types": []}})",
                "policy: $.auto_wrap: unknown key \"types\" (allowed: kind, paths)");
}

TEST(PolicyTest, AnyNestsPolicies) {
  Policy p = MustParse(R"({"auto_wrap": {"kind": "any", "policies": [
      {"kind": "module_types", "types": ["Block"]},
      {"kind": "any", "policies": [{"kind": "size_based", "min_num_params": 7},
                                   {"kind": "explicit", "paths": ["x"]}]},
      {"kind": "always"}]}})");
  const AutoWrapPolicy& any = p.auto_wrap;
  EXPECT_EQ(any.kind, AutoWrapKind::kAny);
  ASSERT_EQ(any.policies.size(), 3u);
  EXPECT_EQ(any.policies[0].kind, AutoWrapKind::kModuleTypes);
  EXPECT_THAT(any.policies[0].types, ElementsAre("Block"));
  EXPECT_EQ(any.policies[1].kind, AutoWrapKind::kAny);
  ASSERT_EQ(any.policies[1].policies.size(), 2u);
  EXPECT_EQ(any.policies[1].policies[0].kind, AutoWrapKind::kSizeBased);
  EXPECT_EQ(any.policies[1].policies[0].min_num_params, 7);
  EXPECT_THAT(any.policies[1].policies[0].force_leaf_types, ElementsAre("MultiheadAttention"));
  EXPECT_THAT(any.policies[1].policies[1].paths, ElementsAre("x"));
  EXPECT_EQ(any.policies[2].kind, AutoWrapKind::kAlways);
}

TEST(PolicyTest, AnyErrorsNameTheMemberPath) {
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": []}})",
                "policy: $.auto_wrap.policies: must list at least one policy");
  ExpectRefused(R"({"auto_wrap": {"kind": "any"}})",
                "policy: $.auto_wrap: missing required key \"policies\"");
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": {"kind": "always"}}})",
                "policy: $.auto_wrap.policies: must be an array, got an object");
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": [{"kind": "always"},
                   {"kind": "any", "policies": [{"kind": "sometimes"}]}]}})",
                "policy: $.auto_wrap.policies[1].policies[0].kind: unknown auto_wrap kind "
                "\"sometimes\" (one of none, always, size_based, module_types, explicit, any)");
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": [{"kind": "always"},
                   {"kind": "size_based", "min_params": 1}]}})",
                "policy: $.auto_wrap.policies[1]: unknown key \"min_params\" (allowed: kind, "
                "min_num_params, force_leaf_types, exclude_wrap_types)");
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": [{"kind": "any", "policies": []}]}})",
                "policy: $.auto_wrap.policies[0].policies: must list at least one policy");
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": ["always"]}})",
                "policy: $.auto_wrap.policies[0]: must be an object with a \"kind\"");
  ExpectRefused(R"({"auto_wrap": {"kind": "any", "policies": [{}]}})",
                "policy: $.auto_wrap.policies[0]: missing required key \"kind\"");
}

TEST(PolicyTest, DeeplyNestedAnyIsHandled) {
  // 200 levels of `any` (400 JSON levels) parse; 300 (600 levels) exceed kMaxJsonDepth.
  auto nested = [](int levels) {
    std::string s;
    for (int i = 0; i < levels; ++i) s += R"({"kind": "any", "policies": [)";
    s += R"({"kind": "always"})";
    for (int i = 0; i < levels; ++i) s += "]}";
    return "{\"auto_wrap\": " + s + "}";
  };
  Policy p = MustParse(nested(200));
  const AutoWrapPolicy* a = &p.auto_wrap;
  int depth = 0;
  while (a->kind == AutoWrapKind::kAny) {
    ASSERT_EQ(a->policies.size(), 1u);
    a = &a->policies[0];
    ++depth;
  }
  EXPECT_EQ(depth, 200);
  EXPECT_EQ(a->kind, AutoWrapKind::kAlways);
  ExpectRefused(nested(300), "policy: JSON nests deeper than 512 levels");
}

TEST(PolicyTest, UnknownKindStrategyAndKeysNameThePath) {
  ExpectRefused(R"({"auto_wrap": {"kind": "transformer"}})",
                "policy: $.auto_wrap.kind: unknown auto_wrap kind \"transformer\" (one of none, "
                "always, size_based, module_types, explicit, any)");
  ExpectRefused(R"({"auto_wrap": {}})", "policy: $.auto_wrap: missing required key \"kind\"");
  ExpectRefused(R"({"auto_wrap": "always"})",
                "policy: $.auto_wrap: must be an object with a \"kind\"");
  ExpectRefused(R"({"sharding_strategy": "full_shard"})",
                "policy: $.sharding_strategy: unknown sharding strategy \"full_shard\" (one of "
                "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2)");
  ExpectRefused(R"({"sharding_strategy": 1})",
                "policy: $.sharding_strategy: must be a string, got an integer");
  ExpectRefused(R"({"auto_wrap_policy": {"kind": "always"}})",
                "policy: $: unknown key \"auto_wrap_policy\" (allowed: format, auto_wrap, "
                "ignored_modules, ignored_params, use_orig_params, sharding_strategy, "
                "mixed_precision)");
  ExpectRefused(
      R"({"mixed_precision": {"param_dtype": "float16", "keep_low_precision_grads": true}})",
      "policy: $.mixed_precision: unknown key \"keep_low_precision_grads\" (allowed: "
      "param_dtype, reduce_dtype, buffer_dtype, module_types_to_ignore)");
  ExpectRefused(R"({"use_orig_params": "true"})",
                "policy: $.use_orig_params: must be true or false, got a string");
  ExpectRefused(R"({"ignored_modules": "h.1"})",
                "policy: $.ignored_modules: must be an array of strings, got a string");
  ExpectRefused(R"({"ignored_params": ["a", null]})",
                "policy: $.ignored_params[1]: must be a string, got null");
  ExpectRefused("[]", "policy: $: must be an object, got an array");
}

TEST(PolicyTest, EveryShardingStrategyParses) {
  const std::vector<std::pair<std::string, ShardingStrategy>> cases = {
      {"FULL_SHARD", ShardingStrategy::kFullShard},
      {"SHARD_GRAD_OP", ShardingStrategy::kShardGradOp},
      {"NO_SHARD", ShardingStrategy::kNoShard},
      {"HYBRID_SHARD", ShardingStrategy::kHybridShard},
      {"_HYBRID_SHARD_ZERO2", ShardingStrategy::kHybridShardZero2}};
  for (const auto& [name, strategy] : cases) {
    EXPECT_EQ(MustParse("{\"sharding_strategy\": \"" + name + "\"}").sharding_strategy, strategy);
    EXPECT_EQ(ShardingStrategyName(strategy), name);
    EXPECT_EQ(ParseShardingStrategy(name), strategy);
  }
  EXPECT_FALSE(ParseShardingStrategy("HYBRID_SHARD_ZERO2").has_value());  // FSDP's leading _
  EXPECT_TRUE(IsHybrid(ShardingStrategy::kHybridShard));
  EXPECT_TRUE(IsHybrid(ShardingStrategy::kHybridShardZero2));
  EXPECT_FALSE(IsHybrid(ShardingStrategy::kShardGradOp));
}

TEST(PolicyTest, KindNamesRoundTrip) {
  for (AutoWrapKind k : {AutoWrapKind::kNone, AutoWrapKind::kAlways, AutoWrapKind::kSizeBased,
                         AutoWrapKind::kModuleTypes, AutoWrapKind::kExplicit, AutoWrapKind::kAny}) {
    EXPECT_EQ(ParseAutoWrapKind(AutoWrapKindName(k)), k);
  }
  EXPECT_EQ(AutoWrapKindName(AutoWrapKind::kSizeBased), "size_based");
  EXPECT_EQ(AutoWrapKindName(AutoWrapKind::kModuleTypes), "module_types");
  EXPECT_FALSE(ParseAutoWrapKind("Always").has_value());
}

TEST(PolicyTest, MixedPrecisionDefaultsAndExplicitEmptyIgnoreList) {
  Policy p = MustParse(R"({"mixed_precision": {}})");
  ASSERT_TRUE(p.mixed_precision.has_value());
  EXPECT_FALSE(p.mixed_precision->param_dtype.has_value());
  EXPECT_FALSE(p.mixed_precision->reduce_dtype.has_value());
  EXPECT_FALSE(p.mixed_precision->buffer_dtype.has_value());
  EXPECT_THAT(p.mixed_precision->module_types_to_ignore, ElementsAre("_BatchNorm"));

  p = MustParse(R"({"mixed_precision": {"param_dtype": "float16", "module_types_to_ignore": []}})");
  ASSERT_TRUE(p.mixed_precision.has_value());
  EXPECT_EQ(p.mixed_precision->param_dtype, DType::kFloat16);
  EXPECT_THAT(p.mixed_precision->module_types_to_ignore, IsEmpty());

  p = MustParse(R"({"mixed_precision": {"buffer_dtype": "float64", "reduce_dtype": "bfloat16",
                   "module_types_to_ignore": ["LayerNorm", "_BatchNorm"]}})");
  EXPECT_EQ(p.mixed_precision->buffer_dtype, DType::kFloat64);
  EXPECT_EQ(p.mixed_precision->reduce_dtype, DType::kBFloat16);
  EXPECT_THAT(p.mixed_precision->module_types_to_ignore, ElementsAre("LayerNorm", "_BatchNorm"));

  // null means no mixed precision.
  EXPECT_FALSE(MustParse(R"({"mixed_precision": null})").mixed_precision.has_value());
}

TEST(PolicyTest, NonFloatingMixedPrecisionDTypeIsRefused) {
  ExpectRefused(R"({"mixed_precision": {"param_dtype": "int8"}})",
                "policy: $.mixed_precision.param_dtype: unknown floating dtype \"int8\" (one of "
                "float32 float16 bfloat16 float64)");
  ExpectRefused(R"({"mixed_precision": {"reduce_dtype": "bool"}})",
                "policy: $.mixed_precision.reduce_dtype: unknown floating dtype \"bool\" (one of "
                "float32 float16 bfloat16 float64)");
  ExpectRefused(R"({"mixed_precision": {"buffer_dtype": "half"}})",
                "policy: $.mixed_precision.buffer_dtype: unknown floating dtype \"half\" (one of "
                "float32 float16 bfloat16 float64)");
  ExpectRefused(R"({"mixed_precision": {"param_dtype": 16}})",
                "policy: $.mixed_precision.param_dtype: must be a string, got an integer");
  ExpectRefused(R"({"mixed_precision": ["float16"]})",
                "policy: $.mixed_precision: must be an object, got an array");
}

TEST(PolicyTest, NegativeOrFloatMinNumParamsIsRefused) {
  ExpectRefused(R"({"auto_wrap": {"kind": "size_based", "min_num_params": -1}})",
                "policy: $.auto_wrap.min_num_params: must be at least 0, got -1");
  ExpectRefused(R"({"auto_wrap": {"kind": "size_based", "min_num_params": 1e8}})",
                "policy: $.auto_wrap.min_num_params: must be an integer, got 100000000.0 (too "
                "large, or has a fraction or exponent)");
}

TEST(PolicyTest, MalformedAndDuplicateKeysAreRefused) {
  absl::StatusOr<Policy> p = PolicyFromJson("{\"auto_wrap\": ");
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), ::testing::StartsWith("policy: malformed JSON: "));
  ExpectRefused(R"({"use_orig_params": true, "use_orig_params": false})",
                "policy: duplicate key \"use_orig_params\" in an object");
}

Policy AllFieldsPolicy() {
  Policy p;
  p.auto_wrap.kind = AutoWrapKind::kAny;
  AutoWrapPolicy size;
  size.kind = AutoWrapKind::kSizeBased;
  size.min_num_params = 12345;
  size.force_leaf_types = {};
  size.exclude_wrap_types = {"ModuleList"};
  AutoWrapPolicy types;
  types.kind = AutoWrapKind::kModuleTypes;
  types.types = {"Block"};
  AutoWrapPolicy paths;
  paths.kind = AutoWrapKind::kExplicit;
  paths.paths = {"h.0", ""};
  AutoWrapPolicy always;
  always.kind = AutoWrapKind::kAlways;
  AutoWrapPolicy none;
  none.kind = AutoWrapKind::kNone;
  AutoWrapPolicy inner;
  inner.kind = AutoWrapKind::kAny;
  inner.policies = {always, none};
  p.auto_wrap.policies = {size, types, paths, inner};
  p.ignored_modules = {"h.1"};
  p.ignored_params = {"lm_head.weight", "wte.weight"};
  p.use_orig_params = true;
  p.sharding_strategy = ShardingStrategy::kHybridShard;
  MixedPrecision mp;
  mp.param_dtype = DType::kBFloat16;
  mp.buffer_dtype = DType::kFloat32;
  mp.module_types_to_ignore = {};
  p.mixed_precision = mp;
  return p;
}

TEST(PolicyTest, ToJsonRoundTrips) {
  std::vector<Policy> policies = {Policy{}, AllFieldsPolicy()};
  for (AutoWrapKind k : {AutoWrapKind::kNone, AutoWrapKind::kAlways, AutoWrapKind::kSizeBased}) {
    Policy p;
    p.auto_wrap.kind = k;
    p.sharding_strategy = ShardingStrategy::kNoShard;
    p.mixed_precision = MixedPrecision{};
    policies.push_back(p);
  }
  for (size_t i = 0; i < policies.size(); ++i) {
    SCOPED_TRACE(i);
    Json j = PolicyToJson(policies[i]);
    EXPECT_EQ(j["format"], "flatshard.policy/1");
    absl::StatusOr<Policy> back = PolicyFromJsonValue(j);
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << j.dump();
    EXPECT_EQ(*back, policies[i]);
    absl::StatusOr<Policy> from_text = PolicyFromJson(j.dump());
    ASSERT_TRUE(from_text.ok()) << from_text.status();
    EXPECT_EQ(*from_text, policies[i]);
  }
}

TEST(PolicyTest, ToJsonWritesEveryFieldExplicitly) {
  Json j = PolicyToJson(Policy{});
  EXPECT_EQ(j, Json::parse(R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "none"},
                              "ignored_modules": [], "ignored_params": [],
                              "use_orig_params": false, "sharding_strategy": "FULL_SHARD"})"));
  Policy p;
  p.auto_wrap.kind = AutoWrapKind::kSizeBased;
  p.mixed_precision = MixedPrecision{};
  p.mixed_precision->reduce_dtype = DType::kFloat16;
  j = PolicyToJson(p);
  EXPECT_EQ(j["auto_wrap"], Json::parse(R"({"kind": "size_based", "min_num_params": 100000000,
      "force_leaf_types": ["MultiheadAttention"], "exclude_wrap_types": ["ModuleList", "ModuleDict"]})"));
  EXPECT_EQ(
      j["mixed_precision"],
      Json::parse(R"({"reduce_dtype": "float16", "module_types_to_ignore": ["_BatchNorm"]})"));
}

}  // namespace
}  // namespace flatshard
