// Rules of semantics.md §1–2 as the planner applies them, one behaviour per test.

#include "common/planner.h"

#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Builds manifest JSON tersely: M("Type", {P("w", 1, {4, 4})}, {C("child", M(...))}).
Json P(const std::string& name, int64_t id, std::vector<int64_t> shape,
       const std::string& dtype = "float32", bool requires_grad = true) {
  return {{"name", name},
          {"id", id},
          {"shape", shape},
          {"dtype", dtype},
          {"requires_grad", requires_grad}};
}
int64_t g_next_module_id = 0;
Json M(const std::string& type, std::vector<Json> params = {}, std::vector<Json> children = {},
       std::vector<std::string> bases = {"Module"}) {
  return {{"id", g_next_module_id++},
          {"type", type},
          {"bases", bases},
          {"params", params},
          {"children", children}};
}
Json C(const std::string& name, Json module) { return {{"name", name}, {"module", module}}; }
Json Ref(int64_t id) { return {{"ref", id}}; }

Manifest MakeManifest(Json root) {
  auto m = ManifestFromJsonValue(Json{{"format", "flatshard.manifest/1"}, {"root", root}});
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

Policy MakePolicy(const std::string& json) {
  auto p = PolicyFromJson(json);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

absl::StatusOr<Plan> PlanWith(const Manifest& m, const std::string& policy, int world = 1,
                              int per_node = 0) {
  PlanOptions o;
  o.world_size = world;
  o.ranks_per_node = per_node;
  return BuildPlan(m, MakePolicy(policy), o);
}

std::vector<std::string> UnitModules(const Plan& p) {
  std::vector<std::string> out;
  for (const PlanUnit& u : p.units) out.push_back(u.module.empty() ? "<root>" : u.module);
  return out;
}

std::vector<std::string> Fqns(const PlanUnit& u) {
  std::vector<std::string> out;
  for (const PlanParam& p : u.params) out.push_back(p.fqn);
  return out;
}

// root(w:10) -> a(Linear: w 100, b 10), blk(Block -> x(Linear 200), y(Linear 300)), z(Linear 5)
Manifest SmallTree() {
  return MakeManifest(M("Net", {P("w", 0, {10})},
                        {C("a", M("Linear", {P("weight", 1, {10, 10}), P("bias", 2, {10})})),
                         C("blk", M("Block", {},
                                    {C("x", M("Linear", {P("weight", 3, {200})})),
                                     C("y", M("Linear", {P("weight", 4, {300})}))})),
                         C("z", M("Linear", {P("weight", 5, {5})}))}));
}

TEST(PlannerTest, NoAutoWrapMakesOneRootUnitInParametersOrder) {
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "none"}})");
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->units.size(), 1u);
  EXPECT_EQ(plan->units[0].module, "");
  EXPECT_EQ(plan->units[0].module_type, "Net");
  EXPECT_THAT(Fqns(plan->units[0]),
              ElementsAre("w", "a.weight", "a.bias", "blk.x.weight", "blk.y.weight", "z.weight"));
  EXPECT_EQ(plan->units[0].numel, 10 + 100 + 10 + 200 + 300 + 5);
  EXPECT_EQ(plan->units[0].params[3].offset, 120);
}

TEST(PlannerTest, AlwaysWrapsEveryModuleWithParamsListedInPreOrder) {
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"}})");
  ASSERT_TRUE(plan.ok());
  // blk has no params of its own left once x and y are units: no unit for it.
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "a", "blk.x", "blk.y", "z"));
  EXPECT_THAT(Fqns(plan->units[0]), ElementsAre("w"));
  for (size_t i = 0; i < plan->units.size(); ++i) EXPECT_EQ(plan->units[i].index, (int)i);
}

TEST(PlannerTest, SizeBasedWrapsWhenRemainderReachesThreshold) {
  // blk subtree = 500 >= 300: descend; x (200) < 300 no; y (300) >= 300 wraps; then blk's
  // remainder is 200 < 300, so blk is not a unit. a (110) and z (5) stay in the root.
  auto plan =
      PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "size_based", "min_num_params": 300}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "blk.y"));
  EXPECT_THAT(Fqns(plan->units[0]),
              ElementsAre("w", "a.weight", "a.bias", "blk.x.weight", "z.weight"));
}

TEST(PlannerTest, SizeBasedWrapsParentOnItsRemainder) {
  auto plan =
      PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "size_based", "min_num_params": 200}})");
  ASSERT_TRUE(plan.ok());
  // x (200) and y (300) wrap; blk's remainder is 0 < 200.
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "blk.x", "blk.y"));
}

TEST(PlannerTest, SizeBasedForceLeafIsNeitherDescendedNorWrapped) {
  // As FSDP's _recursive_wrap: recurse=True is false for a force-leaf module, so it returns 0
  // at once; its params fall to the nearest wrapped ancestor.
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "size_based", "min_num_params": 200,
                                       "force_leaf_types": ["Block"]}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>"));
  EXPECT_THAT(Fqns(plan->units[0]),
              ElementsAre("w", "a.weight", "a.bias", "blk.x.weight", "blk.y.weight", "z.weight"));
}

TEST(PlannerTest, SizeBasedExcludeWrapTypesAreNeverUnits) {
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "size_based", "min_num_params": 1,
                                       "exclude_wrap_types": ["Linear"]}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "blk"));
}

TEST(PlannerTest, SizeBasedDefaultsExcludeModuleListAndLeafMultiheadAttention) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(
      M("Net", {},
        {C("layers", M("ModuleList", {},
                       {C("0", M("MultiheadAttention", {P("in_proj_weight", 0, {30})},
                                 {C("out_proj", M("Linear", {P("weight", 1, {20})}))}))})),
         C("head", M("Linear", {P("weight", 2, {5})}))}));
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "size_based", "min_num_params": 1}})");
  ASSERT_TRUE(plan.ok());
  // MHA is a force leaf (neither it nor out_proj becomes a unit) and ModuleList is excluded,
  // so the attention params stay in the root unit.
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "head"));
  ASSERT_EQ(plan->units.size(), 2u);
  EXPECT_THAT(Fqns(plan->units[0]),
              ElementsAre("layers.0.in_proj_weight", "layers.0.out_proj.weight"));
}

TEST(PlannerTest, ModuleTypesMatchBasesLikeIsinstance) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(M("Net", {},
                              {C("conv", M("Conv2d", {P("weight", 0, {8})})),
                               C("bn", M("BatchNorm2d", {P("weight", 1, {4}), P("bias", 2, {4})},
                                         {}, {"_BatchNorm", "_NormBase", "Module"}))}));
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "module_types", "types": ["_BatchNorm"]}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "bn"));
  EXPECT_EQ(plan->units[1].module_type, "BatchNorm2d");
}

TEST(PlannerTest, ExplicitPathsAndAnyCombine) {
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "any", "policies": [
      {"kind": "explicit", "paths": ["z"]},
      {"kind": "module_types", "types": ["Block"]}]}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "blk", "z"));
}

TEST(PlannerTest, UnknownPolicyPathsAreRefusedNamingThePath) {
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "explicit", "paths": ["blk.q"]}})");
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("$.auto_wrap.paths[0]: no module at path \"blk.q\""));
  plan = PlanWith(SmallTree(), R"({"ignored_modules": ["a", "nope"]})");
  EXPECT_THAT(plan.status().message(),
              HasSubstr("$.ignored_modules[1]: no module at path \"nope\""));
  plan = PlanWith(SmallTree(), R"({"ignored_params": ["a.gamma"]})");
  EXPECT_THAT(plan.status().message(), HasSubstr("$.ignored_params[0]: no parameter \"a.gamma\""));
}

TEST(PlannerTest, IgnoredModulesAndParamsBelongToNoUnit) {
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"},
                                       "ignored_modules": ["blk"], "ignored_params": ["a.bias"]})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "a", "z"));
  EXPECT_THAT(Fqns(plan->units[1]), ElementsAre("a.weight"));
  EXPECT_THAT(plan->ignored_params, ElementsAre("a.bias", "blk.x.weight", "blk.y.weight"));
}

TEST(PlannerTest, IgnoringTheRootWarnsAndLeavesNoUnits) {
  auto plan = PlanWith(SmallTree(), R"({"ignored_modules": [""]})");
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->units.empty());
  EXPECT_EQ(plan->ignored_params.size(), 6u);
  EXPECT_THAT(plan->warnings, ElementsAre(HasSubstr("ignore the top-level module")));
}

// GPT-like: wte.weight (id 0) tied to lm_head.weight.
Manifest TiedGpt() {
  g_next_module_id = 0;
  return MakeManifest(
      M("GPT", {},
        {C("wte", M("Embedding", {P("weight", 0, {50, 8})})),
         C("h", M("ModuleList", {},
                  {C("0", M("Block", {P("w", 1, {64})})), C("1", M("Block", {P("w", 2, {64})}))})),
         C("lm_head", M("Linear", {P("weight", 0, {50, 8})}))}));
}

TEST(PlannerTest, TiedParamInOneUnitIsListedAsShared) {
  auto plan = PlanWith(TiedGpt(), R"({"auto_wrap": {"kind": "module_types", "types": ["Block"]}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "h.0", "h.1"));
  EXPECT_THAT(Fqns(plan->units[0]), ElementsAre("wte.weight"));
  ASSERT_EQ(plan->units[0].shared.size(), 1u);
  EXPECT_EQ(plan->units[0].shared[0], (SharedParam{"lm_head.weight", "wte.weight"}));
  EXPECT_EQ(plan->units[0].numel, 400);  // counted once
}

TEST(PlannerTest, TiedParamAcrossUnitsBelongsToTheFirstUnitFormed) {
  auto plan = PlanWith(TiedGpt(), R"({"auto_wrap": {"kind": "always"}})");
  ASSERT_TRUE(plan.ok());
  // wte is formed first and takes the tensor; lm_head has nothing left and gets no unit.
  EXPECT_THAT(UnitModules(*plan), ElementsAre("wte", "h.0", "h.1"));
}

TEST(PlannerTest, TiedParamCountsZeroForLaterSizeDecisions) {
  // lm_head's only param is already in wte's unit, so its numel is 0 < 1: not wrapped.
  auto plan = PlanWith(TiedGpt(), R"({"auto_wrap": {"kind": "size_based", "min_num_params": 1}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("wte", "h.0", "h.1"));
}

// A module instance registered at two paths.
Manifest SharedModule() {
  g_next_module_id = 0;
  Json shared = M("Linear", {P("weight", 0, {16})});
  const int64_t shared_id = shared["id"];
  return MakeManifest(M("Net", {},
                        {C("a", M("Branch", {P("w", 1, {4})}, {C("s", shared)})),
                         C("b", M("Branch", {P("w", 2, {4})}, {C("s", Ref(shared_id))}))}));
}

TEST(PlannerTest, SharedModuleLaterPathsAreSharedWithinTheUnit) {
  auto plan = PlanWith(SharedModule(), R"({"auto_wrap": {"kind": "none"}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(Fqns(plan->units[0]), ElementsAre("a.w", "a.s.weight", "b.w"));
  ASSERT_EQ(plan->units[0].shared.size(), 1u);
  EXPECT_EQ(plan->units[0].shared[0], (SharedParam{"b.s.weight", "a.s.weight"}));
}

TEST(PlannerTest, SharedModuleWrappedOnceAndCountsZeroWhenRevisited) {
  auto plan = PlanWith(SharedModule(), R"({"auto_wrap": {"kind": "always"}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("a", "a.s", "b"));
  EXPECT_THAT(Fqns(plan->units[2]), ElementsAre("b.w"));
}

TEST(PlannerTest, IgnoringASharedModuleIgnoresItAtEveryPath) {
  auto plan = PlanWith(SharedModule(), R"({"ignored_modules": ["b.s"]})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(Fqns(plan->units[0]), ElementsAre("a.w", "b.w"));
  EXPECT_THAT(plan->ignored_params, ElementsAre("a.s.weight", "b.s.weight"));
}

TEST(PlannerTest, ExpandedSharedModulesAreBounded) {
  // Each level registers the previous one twice: 2^40 paths from 40 modules.
  g_next_module_id = 0;
  Json level = M("Leaf", {P("w", 0, {1})});
  Json root;
  std::vector<Json> defs;
  Json current = level;
  for (int i = 0; i < 40; ++i) {
    const int64_t child_id = current["id"];
    current = M("Pair", {}, {C("l", current), C("r", Ref(child_id))});
  }
  Manifest m = MakeManifest(current);
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "module_types", "types": ["Nothing"]}})");
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("module paths once shared modules"));
}

TEST(PlannerTest, FrozenAndTrainableInOneUnitIsAnErrorWithoutOrigParams) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(
      M("Net", {},
        {C("enc", M("Linear", {P("weight", 0, {6}, "float32", false), P("bias", 1, {2})}))}));
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "always"}})");
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(),
              HasSubstr("\"enc\" has both parameters with requires_grad=True and False. FSDP does "
                        "not support wrapping such modules when use_orig_params=False."));
  EXPECT_THAT(plan.status().message(),
              HasSubstr("requires_grad=True: ['enc.bias'] The following parameters have "
                        "requires_grad=False: ['enc.weight']"));
  plan = PlanWith(m, R"({"auto_wrap": {"kind": "always"}, "use_orig_params": true})");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->units[0].requires_grad);
  EXPECT_THAT(plan->warnings,
              ElementsAre(HasSubstr("(8 numel instead of 2 numel before sharding via "
                                    "reduce-scatter; 6 extra gradient numel)")));
}

TEST(PlannerTest, IntegerAndMixedDtypesAreRefusedNamingUnitAndParams) {
  g_next_module_id = 0;
  Manifest ints = MakeManifest(M("Net", {P("steps", 0, {}, "int64", false)}));
  auto plan = PlanWith(ints, "{}");
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(),
              HasSubstr("Cannot flatten integer dtype tensors: parameter steps has dtype int64"));
  // Ignored, the integer parameter is fine.
  EXPECT_TRUE(PlanWith(ints, R"({"ignored_params": ["steps"]})").ok());

  g_next_module_id = 0;
  Manifest mixed = MakeManifest(
      M("Net", {}, {C("l", M("Linear", {P("weight", 0, {4}), P("bias", 1, {4}, "float16")}))}));
  plan = PlanWith(mixed, R"({"auto_wrap": {"kind": "always"}})");
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(),
              HasSubstr("unit of module \"l\": Must flatten tensors with uniform dtype but got "
                        "float32 (l.weight) and float16 (l.bias)"));
}

TEST(PlannerTest, MixedPrecisionWrapsIgnoredTypesSeparatelyWithAWarning) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(M("Net", {},
                              {C("conv", M("Conv2d", {P("weight", 0, {8})})),
                               C("bn", M("BatchNorm2d", {P("weight", 1, {4})}, {},
                                         {"_BatchNorm", "_NormBase", "Module"}))}));
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "size_based", "min_num_params": 1000},
                             "mixed_precision": {"param_dtype": "bfloat16"}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "bn"));
  EXPECT_THAT(plan->warnings, ElementsAre(HasSubstr("submodules of type: {BatchNorm2d}")));
  // FSDP applies the override only together with an auto-wrap policy.
  plan = PlanWith(m, R"({"mixed_precision": {"param_dtype": "bfloat16"}})");
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>"));
  EXPECT_TRUE(plan->warnings.empty());
  plan = PlanWith(m, R"({"auto_wrap": {"kind": "size_based", "min_num_params": 1000},
                         "mixed_precision": {"module_types_to_ignore": []}})");
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>"));
}

// Mixed precision at run time: every unit computes in param_dtype and reduces in reduce_dtype
// (param_dtype when unset), except a unit rooted at an ignored type; set only where it differs.
TEST(PlannerTest, MixedPrecisionGivesUnitsComputeAndReduceDTypesButNotIgnoredTypes) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(M("Net", {},
                              {C("conv", M("Conv2d", {P("weight", 0, {8})})),
                               C("bn", M("BatchNorm2d", {P("weight", 1, {4})}, {},
                                         {"_BatchNorm", "_NormBase", "Module"}))}));
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "module_types", "types": ["Conv2d"]},
                             "mixed_precision": {"param_dtype": "bfloat16"}})");
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_THAT(UnitModules(*plan), ElementsAre("conv", "bn"));
  EXPECT_EQ(plan->units[0].compute_dtype, DType::kBFloat16);
  EXPECT_EQ(plan->units[0].reduce_dtype, DType::kBFloat16);  // as FSDP: param_dtype's grads
  EXPECT_EQ(plan->units[1].compute_dtype, std::nullopt);
  EXPECT_EQ(plan->units[1].ComputeDType(), DType::kFloat32);
  EXPECT_EQ(plan->units[1].ReduceDType(), DType::kFloat32);
  plan = PlanWith(m, R"({"auto_wrap": {"kind": "module_types", "types": ["Conv2d"]},
                         "mixed_precision": {"param_dtype": "float16", "reduce_dtype": "float32",
                                             "module_types_to_ignore": []}})");
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const PlanUnit& u : plan->units) {
    EXPECT_EQ(u.ComputeDType(), DType::kFloat16) << u.module;
    EXPECT_EQ(u.reduce_dtype, std::nullopt) << u.module;  // float32 = the shards' dtype
  }
  // Without mixed precision nothing is set (and the fingerprint is what it always was).
  plan = PlanWith(m, R"({"auto_wrap": {"kind": "module_types", "types": ["Conv2d"]}})");
  ASSERT_TRUE(plan.ok());
  for (const PlanUnit& u : plan->units) EXPECT_FALSE(u.compute_dtype || u.reduce_dtype);
}

TEST(PlannerTest, OrigParamsAlignsEachParamAndPadsToWorldSize) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(
      M("Net", {P("a", 0, {3}, "float16"), P("b", 1, {5}, "float16"), P("c", 2, {1}, "float16")}));
  auto plan = PlanWith(m, R"({"use_orig_params": true})", 3);
  ASSERT_TRUE(plan.ok());
  const PlanUnit& u = plan->units[0];
  // float16: 16-byte alignment = 8 elements.
  EXPECT_EQ(u.params[0].offset, 0);
  EXPECT_EQ(u.params[1].offset, 8);
  EXPECT_EQ(u.params[2].offset, 16);
  EXPECT_EQ(u.numel, 9);
  EXPECT_EQ(u.padded_numel, 18);  // 17 rounded up to a multiple of 3
  EXPECT_EQ(u.shard_numel, 6);
  plan = PlanWith(m, R"({"use_orig_params": false})", 4);
  EXPECT_EQ(plan->units[0].params[1].offset, 3);
  EXPECT_EQ(plan->units[0].padded_numel, 12);
  EXPECT_EQ(plan->units[0].shard_numel, 3);
}

TEST(PlannerTest, ShardSizesFollowTorchChunkForEveryWorldSize) {
  for (int world = 1; world <= 8; ++world) {
    auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"}})", world);
    ASSERT_TRUE(plan.ok());
    for (const PlanUnit& u : plan->units) {
      EXPECT_EQ(u.shard_numel, (u.numel + world - 1) / world) << u.module << " W=" << world;
      EXPECT_EQ(u.padded_numel, u.shard_numel * world);
    }
  }
  // z has 5 elements: with 8 ranks, ranks 5..7 hold only padding.
  auto plan = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"}})", 8);
  auto layout = UnitLayout(*plan, plan->units.back());
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->UnpaddedShardRange(4).size(), 1);
  EXPECT_TRUE(layout->UnpaddedShardRange(5).empty());
  EXPECT_TRUE(layout->UnpaddedShardRange(7).empty());
}

TEST(PlannerTest, NoShardAndHybridShardSizes) {
  auto plan = PlanWith(SmallTree(), R"({"sharding_strategy": "NO_SHARD"})", 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->shard_world_size, 1);
  EXPECT_EQ(plan->units[0].shard_numel, 625);
  EXPECT_EQ(plan->units[0].padded_numel, 625);
  plan = PlanWith(SmallTree(), R"({"sharding_strategy": "HYBRID_SHARD"})", 8, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->shard_world_size, 4);
  EXPECT_EQ(plan->units[0].shard_numel, 157);  // ceil(625 / 4)
  EXPECT_EQ(plan->ShardRank(5), 1);
  plan = PlanWith(SmallTree(), R"({"sharding_strategy": "HYBRID_SHARD"})", 8, 3);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(),
              HasSubstr("HYBRID_SHARD: ranks per node 3 must be >= 1 and divide world size 8"));
  // _HYBRID_SHARD_ZERO2 plans exactly as HYBRID_SHARD.
  plan = PlanWith(SmallTree(), R"({"sharding_strategy": "_HYBRID_SHARD_ZERO2"})", 8, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->sharding_strategy, ShardingStrategy::kHybridShardZero2);
  EXPECT_EQ(plan->shard_world_size, 4);
  EXPECT_EQ(plan->units[0].shard_numel, 157);
  EXPECT_EQ(plan->ShardRank(5), 1);
  plan = PlanWith(SmallTree(), R"({"sharding_strategy": "_HYBRID_SHARD_ZERO2"})", 8, 3);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("_HYBRID_SHARD_ZERO2: ranks per node 3"));
}

TEST(PlannerTest, WorldSizeMustBePositive) {
  auto plan = PlanWith(SmallTree(), "{}", 0);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("world size must be at least 1, got 0"));
  plan = PlanWith(SmallTree(), "{}", kMaxWorldSize + 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(),
              HasSubstr("world size must be at most 1048576, got 1048577"));
}

TEST(PlannerTest, FingerprintIsStableAndSensitive) {
  auto a = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"}})", 4);
  auto b = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"}})", 4);
  auto c = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "always"}})", 5);
  auto d = PlanWith(SmallTree(), R"({"auto_wrap": {"kind": "none"}})", 4);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  EXPECT_EQ(a->fingerprint, b->fingerprint);
  EXPECT_EQ(a->fingerprint.size(), 64u);
  EXPECT_NE(a->fingerprint, c->fingerprint);
  EXPECT_NE(a->fingerprint, d->fingerprint);
  EXPECT_EQ(*a, *b);
}

TEST(PlannerTest, ZeroSizeParamsStillFormAUnit) {
  g_next_module_id = 0;
  Manifest m = MakeManifest(M("Net", {P("s", 0, {})}, {C("z", M("Holder", {P("e", 1, {0, 3})}))}));
  auto plan = PlanWith(m, R"({"auto_wrap": {"kind": "always"}})", 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(UnitModules(*plan), ElementsAre("<root>", "z"));
  EXPECT_EQ(plan->units[1].numel, 0);
  EXPECT_EQ(plan->units[1].shard_numel, 0);
  EXPECT_EQ(plan->units[0].numel, 1);  // a scalar has one element
}

// A shape whose element count fits in int64 but whose bytes do not: refused naming the
// parameter, never an allocation of a negative size.
TEST(PlannerTest, FlatBufferWhoseBytesOverflowIsRefusedNamingTheParameter) {
  Manifest m = MakeManifest(
      M("Big", {P("small", 1, {4}), P("huge", 2, {std::numeric_limits<int64_t>::max() / 2})}));
  absl::StatusOr<Plan> plan = PlanWith(m, R"({"format": "flatshard.policy/1"})");
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_THAT(plan.status().message(), HasSubstr("exceeds 2^63 bytes"));
  EXPECT_THAT(plan.status().message(), HasSubstr("largest parameter huge has shape ["));
}

}  // namespace

}  // namespace flatshard
