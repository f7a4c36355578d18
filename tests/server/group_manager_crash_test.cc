// GroupManager's crash-consistency rules (spec/semantics.md §3a), in process: two local ranks
// on threads, sessions ended as a lease would end them (EndSession).
//   - a writeback End is atomic across the group and fails fast, naming the dead rank;
//   - a registration whose init did not commit leaves the module uninitialised: refused, and
//     registering it again runs the init again;
//   - Commit makes generations; a re-form after a failure rolls every rank back to the last
//     committed one; a stale rank's Commit is refused and rolls everyone back.

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/testing/async_call.h"
#include "tests/server/group_manager_commit_fixture.h"
#include "tests/testing/files.h"

namespace flatshard::server {
namespace {

using ::flatshard::testing::ExampleModelFile;
using ::testing::HasSubstr;

template <typename T>
using Async = ::flatshard::testing::AsyncCall<T>;

class GroupManagerCrashTest : public testing::GroupManagerCommitFixture {
 protected:
  GroupManagerCrashTest() : GroupManagerCommitFixture("fsgmct") {}
};

TEST_F(GroupManagerCrashTest, WritebackEndIsAtomicAndFailsFastNamingTheDeadRank) {
  std::vector<Caller> c = JoinAll("wb", 2);
  std::vector<absl::StatusOr<RegisterResult>> reg = RegisterAll(c, InitMode::kFromEveryRank);
  ASSERT_TRUE(reg[0].ok()) << reg[0].status();
  ASSERT_TRUE(reg[1].ok()) << reg[1].status();
  ASSERT_TRUE(reg[0]->init_summon.has_value());
  // Rank 0 fills its init views and ends; its End waits for rank 1 (nothing applied yet).
  for (const SummonedUnit& v : reg[0]->init_summon->views) {
    float* data = static_cast<float*>(v.params->data());
    for (int64_t i = 0; i < v.params->bytes() / 4; ++i) data[i] = 5.0f;
  }
  Async<absl::Status> end0;
  gm_.EndSummon(c[0], reg[0]->init_summon->summon, Deadline(absl::Seconds(15)), end0.Callback());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(end0.Done()) << "a writeback End returned before every rank ended";
  EXPECT_TRUE(ShardsHold(*reg[0], 0.0f)) << "rank 0 wrote back before rank 1 ended";
  // Rank 1's client dies: rank 0's End fails at once, naming it, and nothing is applied.
  const absl::Time killed = absl::Now();
  gm_.EndSession("wb", c[1].session);
  absl::Status& s = end0.Wait();
  EXPECT_LT(absl::Now() - killed, absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1's session ended")) << s;
  EXPECT_TRUE(ShardsHold(*reg[0], 0.0f)) << "rank 0's range was written back alone";
  // A repeated End (a client's retry) gets the same cause, not NOT_FOUND.
  Async<absl::Status> again;
  gm_.EndSummon(c[0], reg[0]->init_summon->summon, Deadline(), again.Callback());
  EXPECT_EQ(again.Wait().code(), absl::StatusCode::kUnavailable) << again.Wait();
  // Collectives that need rank 1 fail at once until it joins again.
  Async<absl::StatusOr<SummonResult>> summon;
  gm_.Summon(c[0], "", "", SummonOptions{}, Deadline(), summon.Callback());
  EXPECT_FALSE(summon.Wait().ok());

  // The module was never initialised: no zeros are handed out as the model...
  absl::StatusOr<RegisterResult> views = gm_.GetShards(c[0], "");
  EXPECT_EQ(views.status().code(), absl::StatusCode::kFailedPrecondition) << views.status();
  EXPECT_THAT(views.status().message(), HasSubstr("not initialised"));
  // ... and registering it again on every rank runs the init again.
  c[1] = Rejoin(c, 1);
  reg = RegisterAll(c, InitMode::kFromEveryRank);
  ASSERT_TRUE(reg[0].ok()) << reg[0].status();
  ASSERT_TRUE(reg[1].ok()) << reg[1].status();
  ASSERT_TRUE(reg[0]->init_summon.has_value()) << "the init did not run again";
  std::vector<std::unique_ptr<Async<absl::Status>>> ends;
  for (int r = 0; r < 2; ++r) {
    for (const SummonedUnit& v : reg[r]->init_summon->views) {
      float* data = static_cast<float*>(v.params->data());
      for (int64_t i = 0; i < v.params->bytes() / 4; ++i) data[i] = 3.0f;
    }
    ends.push_back(std::make_unique<Async<absl::Status>>());
    gm_.EndSummon(c[r], reg[r]->init_summon->summon, Deadline(), ends.back()->Callback());
  }
  for (auto& e : ends) EXPECT_TRUE(e->Wait().ok()) << e->Wait();
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_.GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 0u);
  }
}

TEST_F(GroupManagerCrashTest, FailureRollsEveryRankBackToTheLastCommit) {
  std::vector<Caller> c = JoinAll("gen", 2);
  std::vector<absl::StatusOr<RegisterResult>> reg = RegisterAll(c, InitMode::kZeros);
  ASSERT_TRUE(reg[0].ok() && reg[1].ok());
  EXPECT_EQ(reg[0]->generation, 0u);
  // Step 1: in place, committed.
  FillShards(*reg[0], 1.0f);
  FillShards(*reg[1], 1.0f);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 1u);
  }
  // Step 2: rank 0 finishes its update, rank 1 dies halfway through its own.
  FillShards(*reg[0], 2.0f);
  FillShards(*reg[1], 2.0f);
  gm_.EndSession("gen", c[1].session);
  // Rank 0's Commit fails at once, naming rank 1.
  Async<absl::StatusOr<uint64_t>> commit0;
  const absl::Time start = absl::Now();
  gm_.Commit(c[0], "", Deadline(absl::Seconds(15)), commit0.Callback());
  absl::StatusOr<uint64_t>& failed = commit0.Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("rank 1"));
  // Until the group re-forms, rank 0's views still show its uncommitted step (generation 1
  // is what they will roll back to).
  absl::StatusOr<RegisterResult> early = gm_.GetShards(c[0], "");
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_EQ(early->generation, 1u);
  EXPECT_TRUE(ShardsHold(*early, 2.0f));
  // Rank 1 comes back: the re-form rolls both ranks back to generation 1.
  c[1] = Rejoin(c, 1);
  std::vector<absl::StatusOr<RegisterResult>> again = RegisterAll({c[1]}, InitMode::kZeros);
  ASSERT_TRUE(again[0].ok()) << again[0].status();
  EXPECT_EQ(again[0]->generation, 1u);
  EXPECT_TRUE(ShardsHold(*again[0], 1.0f));
  EXPECT_TRUE(ShardsHold(*reg[0], 1.0f)) << "the survivor's uncommitted step was not rolled back";
  // The survivor did not read its views since the rollback: its Commit is refused on every
  // rank (naming it), and whatever it wrote in the meantime is rolled back too.
  FillShards(*reg[0], 7.0f);
  std::vector<absl::StatusOr<uint64_t>> refused = CommitAll(c);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(refused[r].status().code(), absl::StatusCode::kFailedPrecondition)
        << refused[r].status();
    EXPECT_THAT(refused[r].status().message(), HasSubstr("refused by rank 0"));
  }
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(ShardsHold(*reg[0], 1.0f));
  // Both read their views again, redo step 2 and commit.
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_.GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 1u);
    FillShards(*v, 2.0f);
  }
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 2u);
  }
  std::vector<GroupManager::ModuleUnits> units = *gm_.ListUnits("gen", std::nullopt);
  ASSERT_EQ(units.size(), 1u);
  EXPECT_TRUE(units[0].initialized);
  EXPECT_EQ(units[0].generation, 2u);
}

}  // namespace
}  // namespace flatshard::server
