// Tests for common/proto_convert: domain <-> protobuf round trips for manifest, policy and plan,
// and that FromProto refuses what the JSON readers refuse.

#include "common/proto_convert.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// root(0, params: scale [] bf16; buffers: every dtype)
//   a(1, Block): lin(2, Linear: weight id 0 [4,3] bf16, bias id 1 [4] bf16), act(3, ReLU)
//   b -> ref a (index 1)
//   head(4, Linear: weight id 0 tied to a.lin.weight), also -> ref lin (index 2)
Manifest RichManifest() {
  absl::StatusOr<Manifest> m = ManifestFromJson(R"({
    "format": "flatshard.manifest/1",
    "root": {"id": 0, "type": "Net", "bases": ["Module"],
      "params": [{"name": "scale", "id": 10, "shape": [], "dtype": "bfloat16"}],
      "buffers": [
        {"name": "f32", "id": 20, "shape": [2], "dtype": "float32", "requires_grad": false},
        {"name": "f16", "id": 21, "shape": [2], "dtype": "float16", "requires_grad": false},
        {"name": "bf16", "id": 22, "shape": [2], "dtype": "bfloat16", "requires_grad": false},
        {"name": "f64", "id": 23, "shape": [2], "dtype": "float64", "requires_grad": false},
        {"name": "i8", "id": 24, "shape": [2], "dtype": "int8", "requires_grad": false},
        {"name": "i32", "id": 25, "shape": [2], "dtype": "int32", "requires_grad": false},
        {"name": "i64", "id": 26, "shape": [], "dtype": "int64", "requires_grad": false},
        {"name": "u8", "id": 27, "shape": [0, 3], "dtype": "uint8", "requires_grad": false},
        {"name": "flag", "id": 28, "shape": [1], "dtype": "bool", "requires_grad": false}],
      "children": [
        {"name": "a", "module": {"id": 1, "type": "Block", "bases": ["Module"], "children": [
          {"name": "lin", "module": {"id": 2, "type": "Linear", "bases": ["Module"], "params": [
            {"name": "weight", "id": 0, "shape": [4, 3], "dtype": "bfloat16"},
            {"name": "bias", "id": 1, "shape": [4], "dtype": "bfloat16"}]}},
          {"name": "act", "module": {"id": 3, "type": "ReLU", "bases": ["Module"]}}]}},
        {"name": "b", "module": {"ref": 1}},
        {"name": "head", "module": {"id": 4, "type": "Linear", "bases": ["Module"], "params": [
          {"name": "weight", "id": 0, "shape": [4, 3], "dtype": "bfloat16"}]}},
        {"name": "also", "module": {"ref": 2}}
      ]}
  })");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : Manifest{};
}

TEST(ManifestProtoTest, RoundTripsSharedModulesBuffersAndEveryDType) {
  Manifest m = RichManifest();
  ASSERT_EQ(m.modules.size(), 5u);
  v1::Manifest proto = ToProto(m);
  EXPECT_EQ(proto.format(), "flatshard.manifest/1");
  ASSERT_EQ(proto.modules_size(), 5);
  // A shared instance is named by index from every parent.
  ASSERT_EQ(proto.modules(0).children_size(), 4);
  EXPECT_EQ(proto.modules(0).children(0).module(), 1);
  EXPECT_EQ(proto.modules(0).children(1).module(), 1);
  EXPECT_EQ(proto.modules(0).children(3).module(), 2);
  EXPECT_EQ(proto.modules(0).buffers_size(), 9);
  EXPECT_EQ(proto.modules(0).buffers(0).dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(proto.modules(0).buffers(8).dtype(), v1::DTYPE_BOOL);
  EXPECT_EQ(proto.modules(2).params(0).dtype(), v1::DTYPE_BFLOAT16);
  absl::StatusOr<Manifest> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
  // Through the wire format too.
  v1::Manifest parsed;
  ASSERT_TRUE(parsed.ParseFromString(proto.SerializeAsString()));
  back = FromProto(parsed);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
}

TEST(ManifestProtoTest, EveryDTypeMapsToItsProtoValue) {
  const std::vector<std::pair<DType, v1::DType>> pairs = {
      {DType::kFloat32, v1::DTYPE_FLOAT32},   {DType::kFloat16, v1::DTYPE_FLOAT16},
      {DType::kBFloat16, v1::DTYPE_BFLOAT16}, {DType::kFloat64, v1::DTYPE_FLOAT64},
      {DType::kInt8, v1::DTYPE_INT8},         {DType::kInt32, v1::DTYPE_INT32},
      {DType::kInt64, v1::DTYPE_INT64},       {DType::kUInt8, v1::DTYPE_UINT8},
      {DType::kBool, v1::DTYPE_BOOL}};
  for (const auto& [dtype, proto_dtype] : pairs) {
    Manifest m;
    ModuleDecl root;
    root.type = "Net";
    root.params.push_back(TensorDecl{"p", 0, {2}, dtype, true, 2});
    m.modules.push_back(root);
    v1::Manifest proto = ToProto(m);
    EXPECT_EQ(proto.modules(0).params(0).dtype(), proto_dtype) << DTypeName(dtype);
    absl::StatusOr<Manifest> back = FromProto(proto);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, m);
  }
}

TEST(ManifestProtoTest, UnspecifiedOrUnknownDTypeIsRefused) {
  v1::Manifest proto = ToProto(RichManifest());
  proto.mutable_modules(2)->mutable_params(1)->set_dtype(v1::DTYPE_UNSPECIFIED);
  absl::StatusOr<Manifest> m = FromProto(proto);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(m.status()), "manifest: module 2 bias: dtype is unspecified or unknown (0)");
  proto = ToProto(RichManifest());
  proto.mutable_modules(0)->mutable_buffers(3)->set_dtype(static_cast<v1::DType>(42));
  m = FromProto(proto);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(Msg(m.status()), "manifest: module 0 f64: dtype is unspecified or unknown (42)");
}

TEST(ManifestProtoTest, WrongFormatIsRefused) {
  v1::Manifest proto = ToProto(RichManifest());
  proto.set_format("flatshard.manifest/0");
  absl::StatusOr<Manifest> m = FromProto(proto);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(m.status()),
            "manifest: unknown format \"flatshard.manifest/0\", expected \"flatshard.manifest/1\"");
  proto.clear_format();
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "manifest: unknown format \"\", expected \"flatshard.manifest/1\"");
}

TEST(ManifestProtoTest, CyclicOrOutOfRangeChildIndicesAreRefused) {
  v1::Manifest proto = ToProto(RichManifest());
  v1::ModuleChild* up = proto.mutable_modules(2)->add_children();
  up->set_name("up");
  up->set_module(1);  // lin -> its parent a
  absl::StatusOr<Manifest> m = FromProto(proto);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(m.status()), "manifest: cyclic module graph through module id 1");

  proto = ToProto(RichManifest());
  v1::ModuleChild* self = proto.mutable_modules(3)->add_children();
  self->set_name("self");
  self->set_module(3);
  EXPECT_EQ(Msg(FromProto(proto).status()), "manifest: cyclic module graph through module id 3");

  proto = ToProto(RichManifest());
  proto.mutable_modules(0)->mutable_children(2)->set_module(5);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "manifest: module 0 child \"head\" refers to a missing module");
  proto.mutable_modules(0)->mutable_children(2)->set_module(-1);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "manifest: module 0 child \"head\" refers to a missing module");

  proto.clear_modules();
  EXPECT_EQ(Msg(FromProto(proto).status()), "manifest: no root module");
}

TEST(ManifestProtoTest, AppliesTheJsonRules) {
  v1::Manifest proto = ToProto(RichManifest());
  proto.mutable_modules(2)->mutable_params(0)->set_shape(1, -3);
  absl::StatusOr<Manifest> m = FromProto(proto);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(m.status()), HasSubstr("shape[1]: must be at least 0, got -3"));

  proto = ToProto(RichManifest());
  proto.mutable_modules(2)->mutable_params(0)->clear_shape();
  proto.mutable_modules(2)->mutable_params(0)->add_shape(3037000500);
  proto.mutable_modules(2)->mutable_params(0)->add_shape(3037000500);
  m = FromProto(proto);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(Msg(m.status()), HasSubstr("has more than 2^63 elements"));

  proto = ToProto(RichManifest());
  proto.mutable_modules(0)->mutable_children(1)->set_name("a");
  EXPECT_THAT(Msg(FromProto(proto).status()),
              HasSubstr("name \"a\" is already used on this module"));

  proto = ToProto(RichManifest());
  proto.mutable_modules(4)->mutable_params(0)->set_requires_grad(false);
  EXPECT_THAT(
      Msg(FromProto(proto).status()),
      HasSubstr("conflicting declarations of tied parameter id 0: requires_grad false vs true"));

  proto = ToProto(RichManifest());
  proto.mutable_modules(3)->set_id(1);
  EXPECT_THAT(Msg(FromProto(proto).status()), HasSubstr("module id 1 is defined twice"));

  // Not in pre-order: swap lin and act.
  proto = ToProto(RichManifest());
  std::swap(*proto.mutable_modules(2), *proto.mutable_modules(3));
  proto.mutable_modules(1)->mutable_children(0)->set_module(3);
  proto.mutable_modules(1)->mutable_children(1)->set_module(2);
  proto.mutable_modules(0)->mutable_children(3)->set_module(3);
  EXPECT_THAT(Msg(FromProto(proto).status()), HasSubstr("pre-order"));
}

// A chain of `depth` modules, each the only child of the previous one.
Manifest Chain(int depth) {
  Manifest m;
  for (int i = 0; i < depth; ++i) {
    ModuleDecl d;
    d.id = i;
    d.type = "Seq";
    if (i + 1 < depth) d.children.push_back({"c", i + 1});
    m.modules.push_back(std::move(d));
  }
  return m;
}

TEST(ManifestProtoTest, DeepChainIsRefusedLikeJson) {
  // A chain 300 modules deep: its JSON form nests ~900 levels and ManifestFromJson refuses it;
  // proto_convert.h: "a message that would be refused as JSON is refused here".
  constexpr int kDepth = 300;
  const Manifest m = Chain(kDepth);
  absl::StatusOr<Manifest> from_json = ManifestFromJson(ManifestToJson(m).dump());
  ASSERT_FALSE(from_json.ok());
  EXPECT_EQ(Msg(from_json.status()), "manifest: JSON nests deeper than 512 levels");
  absl::StatusOr<Manifest> from_proto = FromProto(ToProto(m));
  ASSERT_FALSE(from_proto.ok());
  EXPECT_EQ(from_proto.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(from_proto.status()), HasSubstr("module tree is deeper than"));
}

TEST(ManifestProtoTest, VeryDeepChainDoesNotCrash) {
  // 10000 modules in a chain is a ~100 KB message a client can send to RegisterModule. It must
  // be refused (or accepted), never crash the process. Run in a child to survive a crash.
  constexpr int kDepth = 10000;
  const v1::Manifest proto = ToProto(Chain(kDepth));
  fflush(nullptr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    absl::StatusOr<Manifest> m = FromProto(proto);
    _exit(m.ok() ? 0 : (m.status().code() == absl::StatusCode::kInvalidArgument ? 1 : 3));
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 1) << "want INVALID_ARGUMENT (too deep)";
}

std::vector<Policy> EveryKindPolicies() {
  std::vector<Policy> out;
  Policy none;
  out.push_back(none);
  Policy always;
  always.auto_wrap.kind = AutoWrapKind::kAlways;
  always.sharding_strategy = ShardingStrategy::kShardGradOp;
  out.push_back(always);
  Policy size;
  size.auto_wrap.kind = AutoWrapKind::kSizeBased;
  size.auto_wrap.min_num_params = 0;
  size.auto_wrap.force_leaf_types = {};
  size.auto_wrap.exclude_wrap_types = {"A", "B", "C"};
  size.sharding_strategy = ShardingStrategy::kNoShard;
  out.push_back(size);
  Policy types;
  types.auto_wrap.kind = AutoWrapKind::kModuleTypes;
  types.auto_wrap.types = {"Block"};
  types.sharding_strategy = ShardingStrategy::kHybridShard;
  types.use_orig_params = true;
  out.push_back(types);
  Policy zero2 = types;
  zero2.sharding_strategy = ShardingStrategy::kHybridShardZero2;
  out.push_back(zero2);
  Policy paths;
  paths.auto_wrap.kind = AutoWrapKind::kExplicit;
  paths.auto_wrap.paths = {"h.0", "h.1.mlp"};
  paths.ignored_modules = {"h.2"};
  paths.ignored_params = {"wte.weight"};
  out.push_back(paths);
  Policy any;
  any.auto_wrap.kind = AutoWrapKind::kAny;
  any.auto_wrap.policies = {types.auto_wrap, paths.auto_wrap, size.auto_wrap};
  AutoWrapPolicy nested;
  nested.kind = AutoWrapKind::kAny;
  nested.policies = {always.auto_wrap};
  any.auto_wrap.policies.push_back(nested);
  out.push_back(any);
  // Mixed precision with and without dtypes.
  Policy mp_none = size;
  mp_none.mixed_precision = MixedPrecision{};
  out.push_back(mp_none);
  Policy mp_all = types;
  MixedPrecision mp;
  mp.param_dtype = DType::kBFloat16;
  mp.reduce_dtype = DType::kFloat32;
  mp.buffer_dtype = DType::kFloat16;
  mp.module_types_to_ignore = {};
  mp_all.mixed_precision = mp;
  out.push_back(mp_all);
  Policy mp_some = any;
  MixedPrecision mp2;
  mp2.reduce_dtype = DType::kFloat64;
  mp2.module_types_to_ignore = {"LayerNorm", "_BatchNorm"};
  mp_some.mixed_precision = mp2;
  out.push_back(mp_some);
  return out;
}

TEST(PolicyProtoTest, RoundTripsEveryKindAndMixedPrecision) {
  std::vector<Policy> policies = EveryKindPolicies();
  for (size_t i = 0; i < policies.size(); ++i) {
    SCOPED_TRACE(i);
    v1::Policy proto = ToProto(policies[i]);
    EXPECT_EQ(proto.format(), "flatshard.policy/1");
    EXPECT_EQ(proto.has_mixed_precision(), policies[i].mixed_precision.has_value());
    v1::Policy parsed;
    ASSERT_TRUE(parsed.ParseFromString(proto.SerializeAsString()));
    absl::StatusOr<Policy> back = FromProto(parsed);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, policies[i]);
  }
}

TEST(PolicyProtoTest, MixedPrecisionDTypePresenceSurvives) {
  Policy p;
  MixedPrecision mp;
  mp.reduce_dtype = DType::kFloat32;  // float32 is proto value 1; unset must stay unset
  p.mixed_precision = mp;
  v1::Policy proto = ToProto(p);
  EXPECT_FALSE(proto.mixed_precision().has_param_dtype());
  EXPECT_TRUE(proto.mixed_precision().has_reduce_dtype());
  EXPECT_FALSE(proto.mixed_precision().has_buffer_dtype());
  absl::StatusOr<Policy> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->mixed_precision->param_dtype.has_value());
  EXPECT_EQ(back->mixed_precision->reduce_dtype, DType::kFloat32);
  EXPECT_THAT(back->mixed_precision->module_types_to_ignore, ::testing::ElementsAre("_BatchNorm"));
}

TEST(PolicyProtoTest, UnspecifiedKindOrStrategyIsRefused) {
  const std::vector<Policy> policies = EveryKindPolicies();
  auto any = std::find_if(policies.begin(), policies.end(),
                          [](const Policy& p) { return p.auto_wrap.kind == AutoWrapKind::kAny; });
  ASSERT_NE(any, policies.end());
  v1::Policy proto = ToProto(*any);
  proto.mutable_auto_wrap()->mutable_policies(1)->set_kind(v1::AUTO_WRAP_KIND_UNSPECIFIED);
  absl::StatusOr<Policy> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(p.status()), "policy: auto_wrap.kind is unspecified or unknown");

  proto = ToProto(Policy{});
  proto.mutable_auto_wrap()->set_kind(static_cast<v1::AutoWrapKind>(99));
  EXPECT_EQ(Msg(FromProto(proto).status()), "policy: auto_wrap.kind is unspecified or unknown");

  proto = ToProto(Policy{});
  proto.clear_auto_wrap();
  EXPECT_EQ(Msg(FromProto(proto).status()), "policy: auto_wrap.kind is unspecified or unknown");

  proto = ToProto(Policy{});
  proto.set_sharding_strategy(v1::SHARDING_STRATEGY_UNSPECIFIED);
  p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(Msg(p.status()), "policy: sharding_strategy is unspecified or unknown");
  proto.set_sharding_strategy(static_cast<v1::ShardingStrategy>(6));
  EXPECT_EQ(Msg(FromProto(proto).status()), "policy: sharding_strategy is unspecified or unknown");
}

TEST(PolicyProtoTest, WrongFormatIsRefused) {
  v1::Policy proto = ToProto(Policy{});
  proto.set_format("flatshard.plan/1");
  absl::StatusOr<Policy> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(Msg(p.status()),
            "policy: unknown format \"flatshard.plan/1\", expected \"flatshard.policy/1\"");
}

TEST(PolicyProtoTest, AppliesTheJsonRules) {
  Policy size;
  size.auto_wrap.kind = AutoWrapKind::kSizeBased;
  v1::Policy proto = ToProto(size);
  proto.mutable_auto_wrap()->set_min_num_params(-1);
  absl::StatusOr<Policy> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(Msg(p.status()), "policy: $.auto_wrap.min_num_params: must be at least 0, got -1");

  proto = ToProto(Policy{});
  proto.mutable_mixed_precision()->set_param_dtype(v1::DTYPE_INT8);
  p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(Msg(p.status()),
            "policy: $.mixed_precision.param_dtype: unknown floating dtype \"int8\" (one of "
            "float32 float16 bfloat16 float64)");

  proto = ToProto(Policy{});
  proto.mutable_mixed_precision()->set_reduce_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "policy: reduce_dtype: dtype is unspecified or unknown (0)");

  Policy any;
  any.auto_wrap.kind = AutoWrapKind::kAny;
  proto = ToProto(any);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "policy: $.auto_wrap.policies: must list at least one policy");
}

TEST(PolicyProtoTest, NestedAnyRefusedAsJsonIsRefusedAsProto) {
  // 300 nested `any` policies: the JSON form nests ~600 levels and PolicyFromJson refuses it.
  v1::Policy proto = ToProto(Policy{});
  v1::AutoWrapPolicy* a = proto.mutable_auto_wrap();
  for (int i = 0; i < 300; ++i) {
    a->set_kind(v1::AUTO_WRAP_KIND_ANY);
    a = a->add_policies();
  }
  a->set_kind(v1::AUTO_WRAP_KIND_ALWAYS);
  absl::StatusOr<Policy> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PolicyProtoTest, DeeplyNestedAnyIsRefusedWithoutCrashing) {
  v1::Policy proto = ToProto(Policy{});
  v1::AutoWrapPolicy* a = proto.mutable_auto_wrap();
  for (int i = 0; i < 2000; ++i) {
    a->set_kind(v1::AUTO_WRAP_KIND_ANY);
    a = a->add_policies();
  }
  a->set_kind(v1::AUTO_WRAP_KIND_ALWAYS);
  absl::StatusOr<Policy> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(p.status()), "policy: auto_wrap policies nest too deep");
}

Plan MakePlan(AutoWrapKind kind, ShardingStrategy s = ShardingStrategy::kFullShard,
              bool use_orig_params = false) {
  Policy p;
  p.auto_wrap.kind = kind;
  p.sharding_strategy = s;
  p.use_orig_params = use_orig_params;
  PlanOptions o;
  o.world_size = 6;
  o.ranks_per_node = IsHybrid(s) ? 3 : 0;
  absl::StatusOr<Plan> plan = BuildPlan(RichManifest(), p, o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : Plan{};
}

// `none`: one root unit holding every param, with the shared paths b.lin.*, head.weight and
// also.*;
// `always`: a root unit (scale) and a unit at a.lin.
Plan NonePlan() { return MakePlan(AutoWrapKind::kNone); }
Plan AlwaysPlan() { return MakePlan(AutoWrapKind::kAlways); }

std::vector<Plan> SamplePlans() {
  std::vector<Plan> plans;
  for (AutoWrapKind kind : {AutoWrapKind::kNone, AutoWrapKind::kAlways}) {
    for (ShardingStrategy s :
         {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
          ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      for (bool orig : {false, true}) plans.push_back(MakePlan(kind, s, orig));
    }
  }
  return plans;
}

TEST(PlanProtoTest, RoundTrips) {
  std::vector<Plan> plans = SamplePlans();
  ASSERT_EQ(plans.size(), 20u);  // 2 wrap kinds x 5 strategies x use_orig_params
  for (Plan& plan : plans) {
    plan.warnings.push_back("kept across the wire");
    v1::Plan proto = ToProto(plan);
    EXPECT_EQ(proto.format(), "flatshard.plan/1");
    EXPECT_EQ(proto.fingerprint(), plan.fingerprint);
    v1::Plan parsed;
    ASSERT_TRUE(parsed.ParseFromString(proto.SerializeAsString()));
    absl::StatusOr<Plan> back = FromProto(parsed);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, plan);
  }
}

TEST(PlanProtoTest, SharedParamsSurvive) {
  Plan plan = NonePlan();
  ASSERT_EQ(plan.units.size(), 1u) << PlanToJson(plan).dump(2);
  EXPECT_EQ(plan.units[0].shared, (std::vector<SharedParam>{{"b.lin.weight", "a.lin.weight"},
                                                            {"b.lin.bias", "a.lin.bias"},
                                                            {"head.weight", "a.lin.weight"},
                                                            {"also.weight", "a.lin.weight"},
                                                            {"also.bias", "a.lin.bias"}}))
      << PlanToJson(plan).dump(2);
  absl::StatusOr<Plan> back = FromProto(ToProto(plan));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
}

TEST(PlanProtoTest, MixedPrecisionDTypesSurvive) {
  Plan plan = NonePlan();
  plan.units[0].compute_dtype = DType::kBFloat16;
  plan.units[0].reduce_dtype = DType::kFloat16;
  plan.fingerprint = Fingerprint(plan);
  v1::Plan proto = ToProto(plan);
  EXPECT_EQ(proto.units(0).compute_dtype(), v1::DTYPE_BFLOAT16);
  absl::StatusOr<Plan> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
  // Unset on the wire (DTYPE_UNSPECIFIED) is unset in the plan.
  EXPECT_EQ(ToProto(NonePlan()).units(0).compute_dtype(), v1::DTYPE_UNSPECIFIED);
}

TEST(PlanProtoTest, TamperedFingerprintIsRefused) {
  Plan plan = NonePlan();
  v1::Plan proto = ToProto(plan);
  proto.set_fingerprint(std::string(64, '0'));
  absl::StatusOr<Plan> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(p.status()), "plan: $.fingerprint: fingerprint \"" + std::string(64, '0') +
                                 "\" does not match the plan's content (" + plan.fingerprint + ")");
  // Content changed under the old fingerprint.
  proto = ToProto(plan);
  proto.mutable_units(0)->mutable_params(0)->set_fqn("renamed");
  p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.fingerprint: "));
}

TEST(PlanProtoTest, TamperedLayoutIsRefused) {
  Plan plan = AlwaysPlan();
  ASSERT_GE(plan.units[1].params.size(), 2u) << PlanToJson(plan).dump(2);
  v1::Plan proto = ToProto(plan);
  proto.mutable_units(1)->mutable_params(1)->set_offset(plan.units[1].params[1].offset + 1);
  absl::StatusOr<Plan> p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.units[1].params[1].offset: offset "));
  proto = ToProto(plan);
  proto.mutable_units(1)->set_shard_numel(plan.units[1].shard_numel + 1);
  p = FromProto(proto);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.units[1]: numel/padded_numel/shard_numel "));
}

TEST(PlanProtoTest, NonUtf8StringsAreRefusedWithoutThrowing) {
  // Protobuf refuses such strings on the wire, but an in-process caller can set them; the
  // contract is a Status (no exceptions anywhere in flatshard, STYLE.md §3).
  Plan plan = AlwaysPlan();
  v1::Plan proto = ToProto(plan);
  proto.add_ignored_params("\xff");
  absl::StatusOr<Plan> p = FromProto(proto);  // must not throw
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
}

TEST(PlanProtoTest, UnspecifiedValuesAndWrongFormatAreRefused) {
  Plan plan = AlwaysPlan();
  v1::Plan proto = ToProto(plan);
  proto.set_sharding_strategy(v1::SHARDING_STRATEGY_UNSPECIFIED);
  EXPECT_EQ(Msg(FromProto(proto).status()), "plan: sharding_strategy is unspecified or unknown");

  proto = ToProto(plan);
  proto.mutable_units(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(Msg(FromProto(proto).status()), "plan: unit 0: dtype is unspecified or unknown (0)");

  proto = ToProto(plan);
  proto.mutable_units(0)->set_dtype(v1::DTYPE_INT32);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "plan: $.units[0].dtype: unknown floating dtype \"int32\"");

  proto = ToProto(plan);
  proto.set_format("flatshard.plan/2");
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "plan: unknown format \"flatshard.plan/2\", expected \"flatshard.plan/1\"");

  proto = ToProto(plan);
  proto.set_world_size(0);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "plan: $.world_size: must be in [1, 2147483647], got 0");

  proto = ToProto(plan);
  proto.set_shard_world_size(0);
  EXPECT_EQ(Msg(FromProto(proto).status()), "plan: $.shard_world_size: must be in [1, 6], got 0");

  proto = ToProto(plan);
  proto.mutable_units(1)->set_index(0);
  EXPECT_EQ(Msg(FromProto(proto).status()), "plan: $.units[1].index: must be 1, got 0");

  proto = ToProto(plan);
  proto.mutable_units(1)->mutable_params(0)->set_numel(-1);
  EXPECT_EQ(Msg(FromProto(proto).status()),
            "plan: $.units[1].params[0].numel: must be at least 0, got -1");
}

TEST(ManifestProtoTest, TooManyModulesAreRefusedBeforeConversion) {
  v1::Manifest proto;
  proto.set_format("flatshard.manifest/1");
  for (int64_t i = 0; i <= kMaxManifestModules; ++i) proto.add_modules()->set_id(i);
  absl::StatusOr<Manifest> m = FromProto(proto);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(),
              HasSubstr(absl::StrCat(kMaxManifestModules + 1, " module instances, the limit is ",
                                     kMaxManifestModules)));
}

}  // namespace

}  // namespace flatshard

namespace flatshard {
namespace {

// ---- ShardService's values (common/rpc_types.h) ----

TEST(RpcTypesProtoTest, InitModesMapBothWaysAndUnknownOnesAreRefused) {
  for (InitMode m : {InitMode::kZeros, InitMode::kFromEveryRank, InitMode::kFromRank0}) {
    absl::StatusOr<InitMode> back = FromProto(ToProto(m));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, m);
  }
  EXPECT_EQ(ToProto(InitMode::kZeros), v1::INIT_MODE_ZEROS);
  EXPECT_EQ(ToProto(InitMode::kFromEveryRank), v1::INIT_MODE_FROM_EVERY_RANK);
  EXPECT_EQ(ToProto(InitMode::kFromRank0), v1::INIT_MODE_FROM_RANK0);
  for (v1::InitMode bad : {v1::INIT_MODE_UNSPECIFIED, static_cast<v1::InitMode>(42)}) {
    absl::StatusOr<InitMode> refused = FromProto(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.status().message(), "init mode is unspecified or unknown");
  }
}

TEST(RpcTypesProtoTest, ReduceOpsMapBothWaysAndUnknownOnesAreRefusedNamingTheValue) {
  EXPECT_EQ(ToProto(ReduceOp::kSum), v1::REDUCE_OP_SUM);
  EXPECT_EQ(ToProto(ReduceOp::kAvg), v1::REDUCE_OP_AVG);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    absl::StatusOr<ReduceOp> back = FromProto(ToProto(op));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, op);
  }
  absl::StatusOr<ReduceOp> unspecified = FromProto(v1::REDUCE_OP_UNSPECIFIED);
  EXPECT_EQ(unspecified.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unspecified.status().message(),
            "op must be REDUCE_OP_SUM (1) or REDUCE_OP_AVG (2), got 0");
  EXPECT_THAT(FromProto(static_cast<v1::ReduceOp>(7)).status().message(), HasSubstr("got 7"));
}

TEST(RpcTypesProtoTest, SummonOptionsRoundTripFieldByField) {
  // Each field alone, so a swapped pair of fields cannot pass.
  for (int field = 0; field < 5; ++field) {
    SummonOptions o{false, false, false, false, false};
    bool* fields[] = {&o.recurse, &o.writeback, &o.rank0_only, &o.offload_to_cpu, &o.with_grads};
    *fields[field] = true;
    const v1::SummonOptions p = ToProto(o);
    EXPECT_EQ(p.recurse(), field == 0);
    EXPECT_EQ(p.writeback(), field == 1);
    EXPECT_EQ(p.rank0_only(), field == 2);
    EXPECT_EQ(p.offload_to_cpu(), field == 3);
    EXPECT_EQ(p.with_grads(), field == 4);
    const SummonOptions back = FromProto(p);
    EXPECT_EQ(back.recurse, o.recurse);
    EXPECT_EQ(back.writeback, o.writeback);
    EXPECT_EQ(back.rank0_only, o.rank0_only);
    EXPECT_EQ(back.offload_to_cpu, o.offload_to_cpu);
    EXPECT_EQ(back.with_grads, o.with_grads);
  }
}

TEST(RpcTypesProtoTest, CallerEventAndMemoryHandleRoundTrip) {
  const Caller c{"job", 3, "secret", 99, 1000};
  const Caller back = FromProto(ToProto(c));
  EXPECT_EQ(back.group, "job");
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.token, "secret");
  EXPECT_EQ(back.session, 99u);
  EXPECT_EQ(back.uid, -1) << "the uid is never taken from the wire";

  const IpcEvent e{7, std::string("\x01\x00\x02", 3), "GPU-abc"};
  const IpcEvent e2 = FromProto(ToProto(e));
  EXPECT_EQ(e2.id, 7u);
  EXPECT_EQ(e2.ipc_handle, e.ipc_handle);
  EXPECT_EQ(e2.device_uuid, "GPU-abc");

  MemoryHandle host;
  host.segment = "/flatshard.1.2";
  host.segment_bytes = 4096;
  host.offset = 128;
  host.bytes = 64;
  const v1::MemoryHandle hp = ToProto(host);
  EXPECT_FALSE(hp.has_cuda()) << "host memory carries no cuda part";
  const MemoryHandle host2 = FromProto(hp);
  EXPECT_EQ(host2.segment, "/flatshard.1.2");
  EXPECT_EQ(host2.segment_bytes, 4096u);
  EXPECT_EQ(host2.offset, 128u);
  EXPECT_EQ(host2.bytes, 64u);
  EXPECT_FALSE(host2.cuda);

  MemoryHandle dev = host;
  dev.cuda = true;
  dev.cuda_ipc_handle = std::string(64, 'h');
  dev.device_uuid = "GPU-1";
  dev.device = 2;
  const MemoryHandle dev2 = FromProto(ToProto(dev));
  EXPECT_TRUE(dev2.cuda);
  EXPECT_EQ(dev2.cuda_ipc_handle, std::string(64, 'h'));
  EXPECT_EQ(dev2.device_uuid, "GPU-1");
  EXPECT_EQ(dev2.device, 2);
}

}  // namespace
}  // namespace flatshard
