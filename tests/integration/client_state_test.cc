// Optimizer state buffers (Client::RegisterState) end to end: the C++ client against real
// flatshardd processes (one daemon, or one per rank with daemon 0 as the coordinator).
//   - specs are checked before any RPC (INVALID_ARGUMENT naming the field); the first spec is
//     fixed, another one is refused naming the state and field;
//   - the buffers are zeros, sized per shape, in shared memory of their own next to the shard;
//     GetShardViews and a re-attaching Register return them with the spec;
//   - they are committed with the shards, and a trainer that went away before a commit comes
//     back to the committed values (the survivor's views are rolled back too).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/shm_mappings.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::JoinRanks;
using ::flatshard::testing::Layout;
using ::flatshard::testing::OnCluster;
using ::flatshard::testing::Rank;
using ::flatshard::testing::RegisterExample;
using ::flatshard::testing::SegmentOf;
using ::testing::HasSubstr;

constexpr char kToken[] = "st4te";

const std::vector<StateSpec> kAdam = {{"exp_avg", DType::kFloat32, StateShape::kShard},
                                      {"exp_avg_sq", DType::kFloat32, StateShape::kShard},
                                      {"step", DType::kInt64, StateShape::kScalar}};

class ClientStateTest : public ::testing::TestWithParam<Layout> {
 protected:
  static ::flatshard::testing::ClusterOptions Options() {
    ::flatshard::testing::ClusterOptions o;
    o.tag_prefix = "fsst";
    return o;
  }
};

absl::StatusOr<RegisteredModule> RegisterModel(Client& c) {
  return c.Register("", ExampleModelFile("gpt_tied", "manifest"),
                    ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
}

// Fills every state of every unit: exp_avg = v, exp_avg_sq = v + 0.5, step = v as int64.
void Fill(const ShardViews& views, float v) {
  for (const UnitShardView& u : views) {
    std::fill_n(static_cast<float*>(u.state("exp_avg")->data), u.shard_numel, v);
    std::fill_n(static_cast<float*>(u.state("exp_avg_sq")->data), u.shard_numel, v + 0.5f);
    *static_cast<int64_t*>(u.state("step")->data) = static_cast<int64_t>(v);
  }
}

bool Holds(const ShardViews& views, float v) {
  for (const UnitShardView& u : views) {
    if (u.states.size() != 3) return false;
    const float* m = static_cast<const float*>(u.state("exp_avg")->data);
    const float* s = static_cast<const float*>(u.state("exp_avg_sq")->data);
    for (int64_t i = 0; i < u.shard_numel; ++i) {
      if (m[i] != v || s[i] != v + 0.5f) return false;
    }
    if (*static_cast<const int64_t*>(u.state("step")->data) != static_cast<int64_t>(v)) {
      return false;
    }
  }
  return true;
}

bool Zeros(const ShardViews& views) {
  for (const UnitShardView& u : views) {
    if (u.states.empty()) return false;
    for (const StateView& s : u.states) {
      const unsigned char* b = static_cast<const unsigned char*>(s.data);
      if (std::any_of(b, b + s.numel * ItemSize(s.dtype), [](unsigned char x) { return x; })) {
        return false;
      }
    }
  }
  return true;
}

TEST_P(ClientStateTest, StateBuffersAreCheckedZeroedAndReturnedWithTheViews) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> c = JoinRanks(2, OnCluster(d, "views", kToken));
  RegisterExample(c);
  absl::StatusOr<ShardViews> bad = c[0].client->RegisterState("", {{"bad name", DType::kFloat32}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("specs[0].name"));
  bad = c[0].client->RegisterState("not.registered", kAdam);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();

  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<ShardViews> views = c[r].client->RegisterState("", kAdam);
    ASSERT_TRUE(views.ok()) << views.status();
    ASSERT_EQ(views->state_specs().size(), 3u);
    EXPECT_EQ(views->state_specs()[2].name, "step");
    EXPECT_EQ(views->state_specs()[2].shape, StateShape::kScalar);
    EXPECT_TRUE(Zeros(*views)) << "new state buffers must be zeros";
    for (const UnitShardView& u : *views) {
      ASSERT_EQ(u.states.size(), 3u);
      EXPECT_EQ(u.state("exp_avg")->numel, u.shard_numel);
      EXPECT_EQ(u.state("step")->numel, 1);
      EXPECT_EQ(u.state("step")->dtype, DType::kInt64);
      EXPECT_EQ(u.state("momentum_buffer"), nullptr);
      EXPECT_EQ(u.state("exp_avg")->device, -1);
      // Shared memory of the daemon's, not the shard's segment.
      const std::string seg = SegmentOf(u.state("exp_avg")->data);
      EXPECT_FALSE(seg.empty());
      EXPECT_NE(seg, SegmentOf(u.data));
    }
    Fill(*views, 2.0f + r);
  }
  // Another spec on rank 1's daemon names the differing state and field.
  std::vector<StateSpec> other = kAdam;
  other[0].shape = StateShape::kScalar;
  absl::StatusOr<ShardViews> differs = c[1].client->RegisterState("", other);
  EXPECT_EQ(differs.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(differs.status().message(), HasSubstr("\"exp_avg\": shape scalar"));
  // GetShardViews returns the same buffers with the spec.
  absl::StatusOr<ShardViews> again = c[0].client->GetShardViews("");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state_specs().size(), 3u);
  EXPECT_TRUE(Holds(*again, 2.0f));
}

TEST_P(ClientStateTest, RestartedTrainerGetsTheCommittedState) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> c = JoinRanks(2, OnCluster(d, "restart", kToken));
  RegisterExample(c);
  std::vector<ShardViews> views(2);
  ::flatshard::testing::RunRanks(2, [&](int r) {
    absl::StatusOr<ShardViews> v = c[r].client->RegisterState("", kAdam);
    ASSERT_TRUE(v.ok()) << v.status();
    Fill(*v, 1.0f);
    absl::StatusOr<uint64_t> g = c[r].client->Commit("");
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 1u);
    Fill(*v, 5.0f);  // in place, never committed
    views[r] = *std::move(v);
  });
  c[1] = Rank();  // rank 1's trainer is gone
  absl::StatusOr<uint64_t> failed = c[0].client->Commit("");
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();

  // As the README asks of a survivor: leave, then join again (join is what waits until the
  // replacement is back and the group re-formed; only views read after that are rolled back).
  ASSERT_TRUE(c[0].client->Leave().ok());
  ::flatshard::testing::RunRanks(2, [&](int r) {
    if (r == 1) {
      c[1].client = ConnectClient(d.AddressFor(1));
      ASSERT_NE(c[1].client, nullptr);
    }
    absl::Status joined;
    const absl::Time start = absl::Now();
    do {
      joined = c[r].client->Join("restart", 2, r, kToken, d.coordinator());
      if (!joined.ok()) absl::SleepFor(absl::Milliseconds(20));
    } while (!joined.ok() && absl::Now() - start < absl::Seconds(5));
    ASSERT_TRUE(joined.ok()) << "rank " << r << ": " << joined;
  });
  absl::StatusOr<RegisteredModule> back = RegisterModel(*c[1].client);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->generation, 1u);
  EXPECT_EQ(back->shards.state_specs().size(), 3u);
  EXPECT_TRUE(Holds(back->shards, 1.0f)) << "the restarted rank's state is not generation 1's";
  // The survivor's state was rolled back in place (its old views show it) once the group
  // re-formed.
  absl::StatusOr<RegisteredModule> survivor = RegisterModel(*c[0].client);  // re-attaches
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  EXPECT_EQ(survivor->generation, 1u);
  EXPECT_TRUE(Holds(survivor->shards, 1.0f));
  EXPECT_TRUE(Holds(views[0], 1.0f));
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClientStateTest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());

}  // namespace
}  // namespace flatshard::client
