// The public header compiles as C++17 and stands alone (this file is built with
// CXX_STANDARD 17 and includes nothing else of the project).
#include "flatshard/client.h"

#if __cplusplus >= 202002L
#error "this test must be compiled as C++17"
#endif

#include "gtest/gtest.h"

namespace {

using flatshard::client::Client;
using flatshard::client::ClientOptions;
using flatshard::client::ParamViews;
using flatshard::client::PlanLayout;
using flatshard::client::ShardViews;
using flatshard::client::SummonOptions;

TEST(ClientCxx17Test, DefaultsAreThoseOfTheSpec) {
  const ClientOptions o;
  EXPECT_EQ(o.call_timeout, absl::Seconds(30));
  EXPECT_EQ(o.join_timeout, absl::Seconds(60));
  const SummonOptions s;
  EXPECT_TRUE(s.recurse);
  EXPECT_TRUE(s.writeback);
  EXPECT_FALSE(s.rank0_only);
  EXPECT_FALSE(s.offload_to_cpu);
  EXPECT_FALSE(s.with_grads);
}

TEST(ClientCxx17Test, EmptyViewsFindNothing) {
  const ParamViews views;
  EXPECT_TRUE(views.empty());
  EXPECT_EQ(views.Find("w"), nullptr);
  const ShardViews shards;
  EXPECT_EQ(shards.Find(0), nullptr);
}

TEST(ClientCxx17Test, ConnectValidatesOptions) {
  ClientOptions o;  // no address
  const absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
}

// <flatshard/plan.h> (through client.h) is plain C++17 values a trainer can walk.
TEST(ClientCxx17Test, PlanLayoutFindsParamsAliasesAndThisRanksSlice) {
  PlanLayout layout;
  PlanLayout::Unit unit;
  unit.index = 3;
  unit.params = {{"a", {2, 3}, flatshard::DType::kFloat32, 0, 6},
                 {"b", {}, flatshard::DType::kFloat32, 6, 1}};
  unit.shared = {{"tied.a", "a"}};
  unit.numel = 7;
  unit.padded_numel = 8;
  unit.shard_numel = 4;
  unit.shard_ranges = {{0, 4}, {4, 8}};
  unit.local_shard = unit.shard_ranges[1];
  layout.units.push_back(unit);
  ASSERT_NE(layout.FindUnit(3), nullptr);
  EXPECT_EQ(layout.FindUnit(0), nullptr);
  EXPECT_EQ(layout.FindUnitOf("tied.a"), &layout.units[0]);
  EXPECT_EQ(layout.units[0].FindParam("tied.a"), &layout.units[0].params[0]);
  const PlanLayout::Range mine = layout.units[0].params[0].range().Intersect(unit.local_shard);
  EXPECT_EQ(mine, (PlanLayout::Range{4, 6}));
  EXPECT_EQ(mine.size(), 2);
  EXPECT_TRUE(layout.units[0].params[1].range().Intersect(unit.shard_ranges[0]).empty());
}

}  // namespace
