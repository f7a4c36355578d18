// The public PlanLayout as the client builds it from the daemon's plan (client/plan_layout.h).

#include "client/plan_layout.h"

#include <string>
#include <vector>

#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::client::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Range = PlanLayout::Range;

// GPT-like: wte.weight tied to lm_head.weight (one root unit holds both), two blocks of 65
// and 3 elements (odd sizes, so shards carry padding).
constexpr char kManifest[] = R"({"format": "flatshard.manifest/1", "root":
 {"id": 0, "type": "GPT", "bases": ["Module"], "params": [], "children": [
  {"name": "wte", "module": {"id": 1, "type": "Embedding", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 0, "shape": [5, 2], "dtype": "bfloat16", "requires_grad": true}]}},
  {"name": "h0", "module": {"id": 2, "type": "Block", "bases": ["Module"], "children": [],
   "params": [{"name": "w", "id": 1, "shape": [13, 5], "dtype": "bfloat16", "requires_grad": true},
              {"name": "b", "id": 2, "shape": [], "dtype": "bfloat16", "requires_grad": true}]}},
  {"name": "h1", "module": {"id": 3, "type": "Block", "bases": ["Module"], "children": [],
   "params": [{"name": "w", "id": 3, "shape": [3], "dtype": "bfloat16", "requires_grad": true}]}},
  {"name": "lm_head", "module": {"id": 4, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 0, "shape": [5, 2], "dtype": "bfloat16", "requires_grad": true}]}}
 ]}})";

Plan MakePlan(const std::string& policy_json, int world, int per_node = 0) {
  absl::StatusOr<Manifest> manifest = ManifestFromJson(kManifest);
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  absl::StatusOr<Policy> policy = PolicyFromJson(policy_json);
  EXPECT_TRUE(policy.ok()) << policy.status();
  PlanOptions options;
  options.world_size = world;
  options.ranks_per_node = per_node;
  absl::StatusOr<Plan> plan = BuildPlan(*manifest, *policy, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

constexpr char kBlocks[] = R"({"auto_wrap": {"kind": "module_types", "types": ["Block"]}})";

TEST(PlanLayoutTest, CopiesUnitsParamsAndAliasesOfThePlan) {
  const Plan plan = MakePlan(kBlocks, 3);
  absl::StatusOr<PlanLayout> layout = MakePlanLayout(plan, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->world_size, 3);
  EXPECT_EQ(layout->shard_world_size, 3);
  EXPECT_EQ(layout->sharding_strategy, "FULL_SHARD");
  EXPECT_EQ(layout->rank, 1);
  EXPECT_EQ(layout->shard_rank, 1);
  EXPECT_EQ(layout->fingerprint, plan.fingerprint);
  EXPECT_FALSE(layout->fingerprint.empty());
  ASSERT_EQ(layout->units.size(), plan.units.size());
  for (size_t i = 0; i < plan.units.size(); ++i) {
    const PlanUnit& want = plan.units[i];
    const PlanLayout::Unit& got = layout->units[i];
    EXPECT_EQ(got.index, want.index);
    EXPECT_EQ(got.module, want.module);
    EXPECT_EQ(got.module_type, want.module_type);
    EXPECT_EQ(got.numel, want.numel);
    EXPECT_EQ(got.padded_numel, want.padded_numel);
    EXPECT_EQ(got.shard_numel, want.shard_numel);
    ASSERT_EQ(got.params.size(), want.params.size());
    for (size_t p = 0; p < want.params.size(); ++p) {
      EXPECT_EQ(got.params[p].fqn, want.params[p].fqn);
      EXPECT_EQ(got.params[p].shape, want.params[p].shape);
      EXPECT_EQ(got.params[p].offset, want.params[p].offset);
      EXPECT_EQ(got.params[p].numel, want.params[p].numel);
      EXPECT_EQ(got.params[p].dtype, DType::kBFloat16);
    }
  }
  // The root unit holds wte.weight once; lm_head.weight aliases it.
  const PlanLayout::Unit* root = layout->FindUnitOf("lm_head.weight");
  ASSERT_NE(root, nullptr);
  EXPECT_EQ(root->module, "");
  ASSERT_EQ(root->shared.size(), 1u);
  EXPECT_EQ(root->shared[0].fqn, "lm_head.weight");
  EXPECT_EQ(root->shared[0].same_as, "wte.weight");
  ASSERT_NE(root->FindParam("lm_head.weight"), nullptr);
  EXPECT_EQ(root->FindParam("lm_head.weight")->fqn, "wte.weight");
  const PlanLayout::Unit* h0 = layout->FindUnitOf("h0.b");
  ASSERT_NE(h0, nullptr);
  EXPECT_EQ(layout->FindUnit(h0->index), h0);
  EXPECT_EQ(h0->module_type, "Block");
  EXPECT_THAT(h0->FindParam("h0.b")->shape, ElementsAre());
  EXPECT_EQ(h0->FindParam("h0.b")->range(), (Range{65, 66}));
  EXPECT_EQ(layout->FindUnitOf("nope"), nullptr);
  EXPECT_EQ(layout->FindUnit(99), nullptr);
}

TEST(PlanLayoutTest, ShardRangesCoverEachUnitOnceAndLocalIsThisRanks) {
  const Plan plan = MakePlan(kBlocks, 4);
  for (int rank = 0; rank < 4; ++rank) {
    absl::StatusOr<PlanLayout> layout = MakePlanLayout(plan, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    for (const PlanLayout::Unit& u : layout->units) {
      ASSERT_EQ(u.shard_ranges.size(), 4u);
      int64_t next = 0;
      for (const Range& r : u.shard_ranges) {
        EXPECT_EQ(r.begin, next);
        EXPECT_EQ(r.size(), u.shard_numel);
        next = r.end;
      }
      EXPECT_EQ(next, u.padded_numel);
      EXPECT_EQ(u.local_shard, u.shard_ranges[rank]);
    }
  }
  // h0: 66 elements over 4 ranks: shards of 17, the last holds 15 elements and 2 of padding.
  absl::StatusOr<PlanLayout> last = MakePlanLayout(plan, 3);
  ASSERT_TRUE(last.ok());
  const PlanLayout::Unit* h0 = last->FindUnitOf("h0.w");
  ASSERT_NE(h0, nullptr);
  EXPECT_EQ(h0->local_shard, (Range{51, 68}));
  EXPECT_EQ(h0->FindParam("h0.w")->range().Intersect(h0->local_shard), (Range{51, 65}));
  EXPECT_EQ(h0->FindParam("h0.b")->range().Intersect(h0->local_shard), (Range{65, 66}));
  EXPECT_TRUE(h0->FindParam("h0.w")->range().Intersect(h0->shard_ranges[0]).size() == 17);
  EXPECT_TRUE(h0->FindParam("h0.b")->range().Intersect(h0->shard_ranges[0]).empty());
}

TEST(PlanLayoutTest, HybridShardSplitsWithinANodeAndNoShardKeepsEverything) {
  const Plan hybrid = MakePlan(
      R"({"sharding_strategy": "HYBRID_SHARD", "auto_wrap": {"kind": "module_types", "types": ["Block"]}})",
      4, /*per_node=*/2);
  absl::StatusOr<PlanLayout> rank3 = MakePlanLayout(hybrid, 3);
  ASSERT_TRUE(rank3.ok()) << rank3.status();
  EXPECT_EQ(rank3->sharding_strategy, "HYBRID_SHARD");
  EXPECT_EQ(rank3->shard_world_size, 2);
  EXPECT_EQ(rank3->shard_rank, 1);
  for (const PlanLayout::Unit& u : rank3->units) {
    ASSERT_EQ(u.shard_ranges.size(), 2u);
    EXPECT_EQ(u.local_shard, u.shard_ranges[1]);
  }

  const Plan none = MakePlan(R"({"sharding_strategy": "NO_SHARD"})", 2);
  absl::StatusOr<PlanLayout> rank1 = MakePlanLayout(none, 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  EXPECT_EQ(rank1->shard_rank, 0);
  for (const PlanLayout::Unit& u : rank1->units) {
    ASSERT_EQ(u.shard_ranges.size(), 1u);
    EXPECT_EQ(u.local_shard, (Range{0, u.padded_numel}));
  }
}

TEST(PlanLayoutTest, RefusesARankOutsideTheWorld) {
  const Plan plan = MakePlan(kBlocks, 2);
  for (int rank : {-1, 2}) {
    absl::StatusOr<PlanLayout> layout = MakePlanLayout(plan, rank);
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(layout.status().message(), HasSubstr("outside the plan's world of 2"));
  }
}

TEST(PlanLayoutTest, RangeIntersectIsEmptyWhenDisjoint) {
  EXPECT_EQ((Range{0, 4}).Intersect({2, 9}), (Range{2, 4}));
  const Range none = (Range{0, 4}).Intersect({6, 9});
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.size(), 0);
}

}  // namespace
}  // namespace flatshard::client::internal
