// GroupManager's optimizer state buffers (RegisterState), in process (GroupManagerHarness, the
// example model gpt_tied):
//   - specs are validated (INVALID_ARGUMENT naming the field) and the first call fixes the
//     module's spec (another one: FAILED_PRECONDITION naming the state and the field);
//   - new buffers are zeros, sized per shape, next to the shard; the same spec re-attaches to
//     the same buffers, and GetShards and a re-attaching Register return them too;
//   - Commit commits them with the shards and a re-form rolls them back with the shards;
//     state registered after the last commit rolls back to zeros.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::Fill;
using ::testing::HasSubstr;
using testing::Holds;

const std::vector<StateSpec> kAdam = {{"exp_avg", DType::kFloat32, StateShape::kShard},
                                      {"exp_avg_sq", DType::kFloat32, StateShape::kShard},
                                      {"step", DType::kFloat64, StateShape::kScalar}};

class GroupManagerStateTest : public testing::GroupManagerHarness {
 protected:
  void SetUp() override {
    model_ = testing::ExampleModel("gpt_tied");
    Start();
  }

  // Fills state `i` of every unit of `r` with `value` (float32 / float64 by its spec).
  static void FillState(const std::vector<UnitShard>& shards, size_t i, double value) {
    for (const UnitShard& s : shards) {
      ASSERT_GT(s.state.size(), i);
      Buffer& b = *s.state[i];
      if (kAdam[i].dtype == DType::kFloat64) {
        for (int64_t k = 0; k < b.bytes() / 8; ++k) static_cast<double*>(b.data())[k] = value;
      } else {
        for (int64_t k = 0; k < b.bytes() / 4; ++k) {
          static_cast<float*>(b.data())[k] = static_cast<float>(value);
        }
      }
    }
  }
  static bool StateHolds(const std::vector<UnitShard>& shards, size_t i, double value) {
    for (const UnitShard& s : shards) {
      if (s.state.size() <= i) return false;
      const Buffer& b = *s.state[i];
      for (int64_t k = 0; k < b.bytes() / ItemSize(kAdam[i].dtype); ++k) {
        const double got = kAdam[i].dtype == DType::kFloat64
                               ? static_cast<const double*>(b.data())[k]
                               : static_cast<const float*>(b.data())[k];
        if (got != value) return false;
      }
    }
    return true;
  }
};

TEST_F(GroupManagerStateTest, SpecIsValidatedFixedByTheFirstCallAndReattaches) {
  std::vector<Caller> c = JoinAll("spec", 2);
  std::vector<absl::StatusOr<RegisterResult>> reg = RegisterAll(c, InitMode::kZeros);
  ASSERT_TRUE(reg[0].ok() && reg[1].ok());

  absl::StatusOr<RegisterStateResult> bad =
      gm_->RegisterState(c[0], "", {{"exp avg", DType::kFloat32, StateShape::kShard}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("specs[0].name"));
  bad = gm_->RegisterState(
      c[0], "",
      {{"m", DType::kFloat32, StateShape::kShard}, {"m", DType::kFloat32, StateShape::kScalar}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("specs[1].name"));
  bad = gm_->RegisterState(c[0], "", {});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  bad = gm_->RegisterState(c[0], "no.such.module", kAdam);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();

  absl::StatusOr<RegisterStateResult> first = gm_->RegisterState(c[0], "", kAdam);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->created);
  EXPECT_EQ(first->specs, kAdam);
  ASSERT_EQ(first->shards.size(), reg[0]->shards.size());
  for (const UnitShard& s : first->shards) {
    ASSERT_EQ(s.state.size(), 3u);
    EXPECT_EQ(s.state[0]->bytes(), s.shard->bytes());  // float32 like the example's shards
    EXPECT_EQ(s.state[1]->bytes(), s.shard->bytes());
    EXPECT_EQ(s.state[2]->bytes(), 8);  // one float64
    EXPECT_NE(s.state[0]->data(), s.state[1]->data());
  }
  EXPECT_TRUE(StateHolds(first->shards, 0, 0.0) && StateHolds(first->shards, 2, 0.0));

  // Another spec on any rank names the differing state and field.
  std::vector<StateSpec> other = kAdam;
  other[1].dtype = DType::kFloat16;
  absl::StatusOr<RegisterStateResult> differs = gm_->RegisterState(c[1], "", other);
  EXPECT_EQ(differs.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(differs.status().message(), HasSubstr("\"exp_avg_sq\": dtype float16"));
  other = kAdam;
  other[2].shape = StateShape::kShard;
  differs = gm_->RegisterState(c[0], "", other);
  EXPECT_THAT(differs.status().message(), HasSubstr("\"step\": shape shard"));
  differs = gm_->RegisterState(c[0], "", {kAdam[0]});
  EXPECT_EQ(differs.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(differs.status().message(), HasSubstr("missing state \"exp_avg_sq\""));

  // Rank 1 gets its own buffers; rank 0 asking again re-attaches to the same ones.
  absl::StatusOr<RegisterStateResult> second = gm_->RegisterState(c[1], "", kAdam);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->created);
  EXPECT_NE(second->shards[0].state[0].get(), first->shards[0].state[0].get());
  FillState(first->shards, 0, 3.0);
  absl::StatusOr<RegisterStateResult> again = gm_->RegisterState(c[0], "", kAdam);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->shards[0].state[0].get(), first->shards[0].state[0].get());
  EXPECT_TRUE(StateHolds(again->shards, 0, 3.0));

  // GetShards and a restarted trainer's Register return the state and the spec too.
  absl::StatusOr<RegisterResult> views = gm_->GetShards(c[0], "");
  ASSERT_TRUE(views.ok()) << views.status();
  EXPECT_EQ(views->state_specs, kAdam);
  EXPECT_EQ(views->shards[0].state[0].get(), first->shards[0].state[0].get());
  gm_->EndSession("spec", c[0].session);
  c[0] = Rejoin(c, 0);
  std::vector<absl::StatusOr<RegisterResult>> reattach = RegisterAll({c[0]}, InitMode::kZeros);
  ASSERT_TRUE(reattach[0].ok()) << reattach[0].status();
  EXPECT_EQ(reattach[0]->state_specs, kAdam);
  ASSERT_EQ(reattach[0]->shards[0].state.size(), 3u);
  EXPECT_EQ(reattach[0]->shards[0].state[0].get(), first->shards[0].state[0].get());

  // `flatshardctl units` counts the live state bytes per unit and rank.
  std::vector<GroupManager::ModuleUnits> units = *gm_->ListUnits("spec", std::nullopt);
  ASSERT_EQ(units.size(), 1u);
  const GroupManager::UnitRankInfo& info = units[0].units[0].ranks[0];
  EXPECT_EQ(info.state_bytes, 2 * info.shard_bytes + 8);
}

TEST_F(GroupManagerStateTest, UninitialisedModuleIsRefusedAsByGetShards) {
  std::vector<Caller> c = JoinAll("uninit", 2);
  // Initial values from every rank: the init summons stay open, nothing committed yet.
  std::vector<absl::StatusOr<RegisterResult>> reg = RegisterAll(c, InitMode::kFromEveryRank);
  ASSERT_TRUE(reg[0].ok() && reg[1].ok());
  absl::StatusOr<RegisterStateResult> s = gm_->RegisterState(c[0], "", kAdam);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("not initialised"));
  EXPECT_EQ(gm_->GetShards(c[0], "").status().code(), s.status().code());
  std::vector<GroupManager::ModuleUnits> units = *gm_->ListUnits("uninit", std::nullopt);
  EXPECT_EQ(units[0].units[0].ranks[0].state_bytes, 0);
}

TEST_F(GroupManagerStateTest, StateCommitsAndRollsBackWithTheShards) {
  std::vector<Caller> c = JoinAll("roll", 2);
  std::vector<absl::StatusOr<RegisterResult>> reg = RegisterAll(c, InitMode::kZeros);
  ASSERT_TRUE(reg[0].ok() && reg[1].ok());
  // Generation 1 commits before any state exists: none is committed.
  Fill(*reg[0], 1.0f);
  Fill(*reg[1], 1.0f);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) ASSERT_TRUE(g.ok()) << g.status();
  std::vector<std::vector<UnitShard>> st;
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterStateResult> s = gm_->RegisterState(c[r], "", kAdam);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->generation, 1u);
    st.push_back(s->shards);
  }
  // Step 2 writes state after the last commit; a failure rolls it back to zeros.
  for (int r = 0; r < 2; ++r) {
    Fill(*reg[r], 2.0f);
    FillState(st[r], 0, 5.0);
    FillState(st[r], 2, 1.0);
  }
  gm_->EndSession("roll", c[1].session);
  c[1] = Rejoin(c, 1);
  std::vector<absl::StatusOr<RegisterResult>> back = RegisterAll({c[1]}, InitMode::kZeros);
  ASSERT_TRUE(back[0].ok()) << back[0].status();
  EXPECT_EQ(back[0]->generation, 1u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(Holds(*reg[r], 1.0f)) << "rank " << r;
    EXPECT_TRUE(StateHolds(st[r], 0, 0.0)) << "rank " << r << ": uncommitted state kept";
    EXPECT_TRUE(StateHolds(st[r], 2, 0.0)) << "rank " << r;
  }
  // Step 2 again, committed with its state.
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(gm_->GetShards(c[r], "").ok());
    Fill(*reg[r], 2.0f);
    FillState(st[r], 0, 5.0);
    FillState(st[r], 1, 6.0);
    FillState(st[r], 2, 2.0);
  }
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 2u);
  }
  // Step 3 dies half-way (rank 0 updated its state, rank 1 part of it): back to step 2's.
  FillState(st[0], 0, 9.0);
  FillState(st[0], 2, 3.0);
  FillState(st[1], 1, 9.0);
  gm_->EndSession("roll", c[0].session);
  c[0] = Rejoin(c, 0);
  back = RegisterAll({c[0]}, InitMode::kZeros);
  ASSERT_TRUE(back[0].ok()) << back[0].status();
  EXPECT_EQ(back[0]->generation, 2u);
  ASSERT_EQ(back[0]->shards[0].state.size(), 3u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(StateHolds(st[r], 0, 5.0)) << "rank " << r;
    EXPECT_TRUE(StateHolds(st[r], 1, 6.0)) << "rank " << r;
    EXPECT_TRUE(StateHolds(st[r], 2, 2.0)) << "rank " << r;
    EXPECT_TRUE(Holds(*reg[r], 2.0f)) << "rank " << r;
  }
  // Deleting the group frees shards, state and every committed copy.
  for (const Caller& x : c) ASSERT_TRUE(gm_->Leave(x).ok());
  absl::StatusOr<GroupManager::DeletedGroup> deleted = gm_->DeleteGroup("roll", -1, true);
  if (deleted.ok()) {
    int64_t state_bytes = 0;
    for (const auto& shards : st) {
      for (const UnitShard& s : shards) {
        for (const auto& b : s.state) state_bytes += b->bytes();
      }
    }
    int64_t shard_bytes = 0;
    for (const auto& r : reg) {
      for (const UnitShard& s : r->shards) shard_bytes += s.shard->bytes();
    }
    EXPECT_GE(deleted->freed_bytes, 2 * (state_bytes + shard_bytes));
  } else {
    EXPECT_EQ(deleted.status().code(), absl::StatusCode::kNotFound) << deleted.status();
  }
}

}  // namespace
}  // namespace flatshard::server
