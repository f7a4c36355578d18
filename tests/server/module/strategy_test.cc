// Sharding strategies at run time through GroupManager's public API (GroupManagerHarness):
// NO_SHARD gradients are all-reduced over the world into every rank's whole-unit gradient
// shard (sum, avg, accumulate; float32 and bfloat16 reduce dtypes; host ranks and simulated
// GPUs; world sizes whose padding differs), with_grads summons see them, and a commit keeps
// every rank's copy identical. Values are small integers: every partial sum is exact, so the
// checks are element-exact against the reference computed here.

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/reduce.h"
#include "server/group_manager.h"
#include "server/module/strategy_collectives.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::FloatCount;
using testing::Floats;
using testing::IdsOf;
using testing::RunTogether;
using testing::StatusCall;

// The units of TestModel under a Block/Linear wrap: 0 "" (Net), 1 "enc", 2 "enc.l1",
// 3 "enc.l2", 4 "head".
constexpr int32_t kUnit = 2;  // enc.l1: weight[5, 3], 15 elements

std::string NoShardPolicy(const std::string& mixed_precision) {
  return absl::StrCat(R"({"format": "flatshard.policy/1", "sharding_strategy": "NO_SHARD",
 "auto_wrap": {"kind": "module_types", "types": ["Block", "Linear"]})",
                      mixed_precision, "}");
}

float RoundTo(DType dtype, float v) {
  if (dtype == DType::kBFloat16) return collective::BFloat16ToFloat(collective::FloatToBFloat16(v));
  return v;
}

// (world size, simulated GPUs: 0 = host ranks, reduce dtype).
class NoShardTest : public testing::GroupManagerHarness,
                    public ::testing::WithParamInterface<std::tuple<int, bool, DType>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  DType reduce_dtype() const { return std::get<2>(GetParam()); }
  void SetUp() override {
    // bfloat16 reduce: FSDP's MixedPrecision(param_dtype=bf16, reduce_dtype=bf16); float32
    // reduce with bfloat16 compute: param_dtype=bf16, reduce_dtype=fp32.
    model_.policy = NoShardPolicy(
        reduce_dtype() == DType::kBFloat16
            ? R"(, "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"})"
            : R"(, "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"})");
    if (std::get<1>(GetParam())) AddSimulatedGpus(world());
    Start();
  }
  // Rank r's full gradient element k: (r + 1) * (k + 1) in the reduce dtype.
  static float Given(int r, int64_t k) { return static_cast<float>((r + 1) * (k + 1)); }
  std::vector<absl::Status> ReduceAll(const std::vector<Caller>& c, ReduceOp op, bool accumulate) {
    std::vector<StatusCall> calls(c.size());
    RunTogether(static_cast<int>(c.size()), [&](int i) {
      absl::StatusOr<std::shared_ptr<Buffer>> full = gm_->BeginReduceScatter(c[i], "", kUnit);
      if (!full.ok()) {
        calls[i].Callback()(full.status());
        return;
      }
      const int64_t n = (*full)->bytes() / ItemSize(reduce_dtype());
      for (int64_t k = 0; k < n; ++k) {
        if (reduce_dtype() == DType::kBFloat16) {
          static_cast<uint16_t*>((*full)->data())[k] =
              collective::FloatToBFloat16(Given(c[i].rank, k));
        } else {
          static_cast<float*>((*full)->data())[k] = Given(c[i].rank, k);
        }
      }
      gm_->FinishReduceScatter(c[i], "", kUnit, op, accumulate, Deadline(), calls[i].Callback());
    });
    std::vector<absl::Status> out;
    for (StatusCall& x : calls) out.push_back(x.Wait());
    return out;
  }
  // Every rank's gradient shard of kUnit is the whole unit and holds want(k).
  ::testing::AssertionResult GradsHold(const std::vector<Caller>& c,
                                       const std::function<float(int64_t)>& want) {
    for (const Caller& caller : c) {
      absl::StatusOr<RegisterResult> v = gm_->GetShards(caller, "");
      if (!v.ok()) return ::testing::AssertionFailure() << v.status();
      const PlanUnit& unit = v->plan.units[kUnit];
      const std::shared_ptr<Buffer>& g = v->shards[kUnit].grad;
      if (g == nullptr) return ::testing::AssertionFailure() << "rank " << caller.rank;
      if (FloatCount(*g) != unit.padded_numel) {
        return ::testing::AssertionFailure() << "rank " << caller.rank << " holds "
                                             << FloatCount(*g) << " of " << unit.padded_numel;
      }
      for (int64_t k = 0; k < unit.numel; ++k) {
        if (Floats(*g)[k] != want(k)) {
          return ::testing::AssertionFailure() << "rank " << caller.rank << " element " << k << ": "
                                               << Floats(*g)[k] << " != " << want(k);
        }
      }
    }
    return ::testing::AssertionSuccess();
  }
};

TEST_P(NoShardTest, GradientsAreAllReducedIntoEveryRanksWholeUnit) {
  const int w = world();
  const DType rd = reduce_dtype();
  std::vector<Caller> c = JoinAndRegister("g", w);
  auto sum = [&](int64_t k) {
    float s = 0;
    for (int r = 0; r < w; ++r) s += Given(r, k);
    return s;
  };
  for (const absl::Status& s : ReduceAll(c, ReduceOp::kSum, false)) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(GradsHold(c, [&](int64_t k) { return RoundTo(rd, sum(k)); }));
  // avg: the float32 sum divided by the world size, rounded once to the reduce dtype; the
  // float32 gradient shard accumulates it in float32.
  auto avg = [&](int64_t k) { return RoundTo(rd, sum(k) / static_cast<float>(w)); };
  for (const absl::Status& s : ReduceAll(c, ReduceOp::kAvg, true)) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(GradsHold(c, [&](int64_t k) { return RoundTo(rd, sum(k)) + avg(k); }));
  for (const absl::Status& s : ReduceAll(c, ReduceOp::kAvg, false)) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(GradsHold(c, avg));
  // with_grads: every rank's view of the unit's gradient is its whole, reduced copy.
  std::vector<absl::StatusOr<SummonResult>> s =
      SummonAll(c, "enc.l1", SummonOptions{.writeback = false, .with_grads = true});
  for (int r = 0; r < w; ++r) {
    ASSERT_TRUE(s[r].ok()) << s[r].status();
    ASSERT_EQ(s[r]->views.size(), 1u);
    ASSERT_NE(s[r]->views[0].grads, nullptr);
    for (int64_t k = 0; k < 15; ++k) ASSERT_EQ(Floats(*s[r]->views[0].grads)[k], avg(k));
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  for (const absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsDevicesDTypes, NoShardTest,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool, DType>>& info) {
                           return absl::StrCat(
                               "world", std::get<0>(info.param),
                               std::get<1>(info.param) ? "_simulated_gpus" : "_host", "_reduce_",
                               DTypeName(std::get<2>(info.param)));
                         });

// HYBRID_*'s ranks per node: a daemon's ranks, uniform and consecutive (FSDP's device mesh).
TEST(RanksPerNodeTest, IsTheRunOfEachNodeOrANamedRefusal) {
  using strategy::RanksPerNode;
  const ShardingStrategy hybrid = ShardingStrategy::kHybridShard;
  EXPECT_EQ(*RanksPerNode("g", hybrid, 4, {}), 0);  // a local group: one node (the world)
  EXPECT_EQ(*RanksPerNode("g", ShardingStrategy::kFullShard, 4, {"a", "b", "a", "b"}), 0);
  EXPECT_EQ(*RanksPerNode("g", hybrid, 4, {"a", "a", "b", "b"}), 2);
  EXPECT_EQ(*RanksPerNode("g", ShardingStrategy::kHybridShardZero2, 4, {"a", "a", "b", "b"}), 2);
  EXPECT_EQ(*RanksPerNode("g", hybrid, 3, {"a", "b", "c"}), 1);
  EXPECT_EQ(*RanksPerNode("g", hybrid, 2, {"a", "a"}), 2);
  struct Refused {
    std::vector<std::string> nodes;
    std::string names;
  };
  for (const Refused& c : std::vector<Refused>{
           {{"a", "b", "a", "b"}, "a: ranks 0, 2; b: ranks 1, 3"},
           {{"a", "a", "a", "b"}, "a: ranks 0, 1, 2; b: ranks 3"},
           {{"a", "b", "b", "a"}, "a: ranks 0, 3; b: ranks 1, 2"},
           {{"a", "a", "b", "b", "a", "a"}, "a: ranks 0, 1, 4, 5; b: ranks 2, 3"},
       }) {
    absl::StatusOr<int32_t> got =
        RanksPerNode("g", hybrid, static_cast<int32_t>(c.nodes.size()), c.nodes);
    ASSERT_FALSE(got.ok()) << c.names;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(got.status().message(), ::testing::HasSubstr("group g: HYBRID_SHARD"));
    EXPECT_THAT(got.status().message(), ::testing::HasSubstr(c.names));
  }
}

// Which unshard each plan runs: HYBRID_* over part of the world gathers within the daemon for
// a node copy and regroups a world all-gather otherwise.
TEST(UnshardOfTest, HybridAcrossDaemonsGathersTheShardGroupForANodeCopy) {
  using strategy::Unshard;
  using strategy::UnshardOf;
  Plan p;
  p.world_size = 4;
  p.shard_world_size = 2;  // 2 daemons x 2 ranks
  EXPECT_EQ(UnshardOf(p, /*node_copy=*/true), Unshard::kShardGroupGather);
  EXPECT_EQ(UnshardOf(p, /*node_copy=*/false), Unshard::kRegroup);
  EXPECT_EQ(strategy::GradReductionOf(p), strategy::GradReduction::kAllReduce);
  p.shard_world_size = 4;  // one node
  EXPECT_EQ(UnshardOf(p, true), Unshard::kAllGather);
  EXPECT_EQ(UnshardOf(p, false), Unshard::kAllGather);
  p.shard_world_size = 1;  // one rank per node, or NO_SHARD
  EXPECT_EQ(UnshardOf(p, true), Unshard::kCopy);
}

}  // namespace
}  // namespace flatshard::server
