// GroupManager's Commit through its public API (GroupManagerHarness): generations, the rollback
// of a re-form to the last commit, a stale rank's commit refused; and the crash-consistency
// rules of writeback Ends and commits when a rank's session ends.

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::Async;
using testing::CommitCall;
using ::testing::ElementsAre;
using testing::Fill;
using testing::FloatCount;
using testing::Floats;
using ::testing::HasSubstr;
using testing::Holds;
using testing::IdsOf;
using testing::kTestPolicy;
using testing::RegisterCall;
using testing::StatusCall;
using testing::SummonCall;
using testing::TestManifest;
using testing::WriteRankPattern;
using testing::WriteStep;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, CommitsCountGenerationsAndAReformRollsBackToTheLast) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  for (uint64_t step = 1; step <= 2; ++step) {
    Fill(regs[0], step);
    Fill(regs[1], step);
    for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(*g, step);
    }
  }
  EXPECT_EQ((*gm_->ListUnits("g", std::nullopt))[0].generation, 2u);
  // Step 3 is half done when rank 1 leaves: rank 0's commit fails at once, naming it.
  Fill(regs[0], 3);
  Fill(regs[1], 3);
  ASSERT_TRUE(gm_->Leave(c[1]).ok());
  CommitCall commit;
  gm_->Commit(c[0], "", Deadline(absl::Seconds(60)), commit.Callback());
  ASSERT_EQ(commit.Wait().status().code(), absl::StatusCode::kUnavailable)
      << commit.Wait().status();
  EXPECT_THAT(commit.Wait().status().message(), HasSubstr("rank 1's session left the group"));
  EXPECT_EQ(gm_->GetShards(c[0], "")->generation, 2u);
  // Rank 1 returns; the group re-forms and every rank is back at generation 2 before the
  // join completes.
  std::vector<std::string> modules;
  c[1] = Rejoin("g", 2, 1, &modules);
  EXPECT_THAT(modules, ElementsAre(""));
  EXPECT_TRUE(GroupStatus("g").ok()) << GroupStatus("g");
  EXPECT_TRUE(Holds(regs[0], 2));
  EXPECT_TRUE(Holds(regs[1], 2));
  // Rank 0 did not read its views since the rollback: its commit is refused on every rank.
  std::vector<absl::StatusOr<uint64_t>> refused = CommitAll(c);
  for (const absl::StatusOr<uint64_t>& g : refused) {
    ASSERT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
    EXPECT_THAT(g.status().message(), HasSubstr("refused by rank 0"));
  }
  // Both read their views (GetShards; rank 1 by re-attaching) and commit step 3.
  RegisterCall reattach;
  gm_->Register(c[1], "", ManifestFromJson(TestManifest()), PolicyFromJson(kTestPolicy),
                InitMode::kZeros, Deadline(), reattach.Callback());
  ASSERT_TRUE(reattach.Wait().ok()) << reattach.Wait().status();
  EXPECT_EQ(reattach.Wait()->generation, 2u);
  EXPECT_EQ(reattach.Wait()->shards[2].shard->segment_name(),
            regs[1].shards[2].shard->segment_name())
      << "re-attaching must hand out the same shards";
  ASSERT_TRUE(gm_->GetShards(c[0], "").ok());
  Fill(regs[0], 3);
  Fill(regs[1], 3);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 3u);
  }
  // Commit refusals that need no collective.
  CommitCall unknown;
  gm_->Commit(c[0], "nope", Deadline(), unknown.Callback());
  EXPECT_EQ(unknown.Wait().status().code(), absl::StatusCode::kNotFound);
}

// A writeback End commits what it wrote back (the own ranges, written into the shard and its
// committed copy in one pass without records) and the shard's other bytes (its padding, as the
// optimizer left them): a re-form after a later uncommitted step restores exactly that shard.
TEST_F(GroupManagerTest, AReformRollsBackToWhatTheLastWritebackEndWrote) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  for (int r = 0; r < 2; ++r) WriteStep(regs[r].shards, 1, r);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) ASSERT_TRUE(g.ok()) << g.status();
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(s[r].ok()) << s[r].status();
    WriteRankPattern(*s[r], r);
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  s.clear();
  std::vector<std::vector<std::vector<float>>> ended(2);  // [rank][unit]: the shard after End
  for (int r = 0; r < 2; ++r) {
    for (const UnitShard& u : regs[r].shards) {
      ended[r].emplace_back(Floats(*u.shard), Floats(*u.shard) + FloatCount(*u.shard));
    }
    WriteStep(regs[r].shards, 3, r);  // the next step, never committed
  }
  ASSERT_TRUE(gm_->Leave(c[1]).ok());
  std::vector<std::string> modules;
  c[1] = Rejoin("g", 2, 1, &modules);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(gm_->GetShards(c[r], "")->generation, 2u);
    for (size_t u = 0; u < regs[r].shards.size(); ++u) {
      const UnitShard& shard = regs[r].shards[u];
      EXPECT_TRUE(std::equal(ended[r][u].begin(), ended[r][u].end(), Floats(*shard.shard)))
          << "rank " << r << " unit " << u << " was not rolled back to its writeback End";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Crash consistency (spec/semantics.md §3a), two local ranks of the example model gpt_tied,
// sessions ended as a lease would end them (EndSession):
//   - a writeback End is atomic across the group and fails fast, naming the dead rank;
//   - a registration whose init did not commit leaves the module uninitialised: refused, and
//     registering it again runs the init again;
//   - Commit makes generations; a re-form after a failure rolls every rank back to the last
//     committed one; a stale rank's Commit is refused and rolls everyone back.

class GroupManagerCrashTest : public testing::GroupManagerHarness {
 protected:
  void SetUp() override {
    model_ = testing::ExampleModel("gpt_tied");
    Start();
  }
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
  gm_->EndSummon(c[0], reg[0]->init_summon->summon, Deadline(absl::Seconds(15)), end0.Callback());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(end0.Done()) << "a writeback End returned before every rank ended";
  EXPECT_TRUE(Holds(*reg[0], 0.0f)) << "rank 0 wrote back before rank 1 ended";
  // Rank 1's client dies: rank 0's End fails at once, naming it, and nothing is applied.
  const absl::Time killed = absl::Now();
  gm_->EndSession("wb", c[1].session);
  absl::Status& s = end0.Wait();
  EXPECT_LT(absl::Now() - killed, absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1's session ended")) << s;
  EXPECT_TRUE(Holds(*reg[0], 0.0f)) << "rank 0's range was written back alone";
  // A repeated End (a client's retry) gets the same cause, not NOT_FOUND.
  Async<absl::Status> again;
  gm_->EndSummon(c[0], reg[0]->init_summon->summon, Deadline(), again.Callback());
  EXPECT_EQ(again.Wait().code(), absl::StatusCode::kUnavailable) << again.Wait();
  // Collectives that need rank 1 fail at once until it joins again.
  Async<absl::StatusOr<SummonResult>> summon;
  gm_->Summon(c[0], "", "", SummonOptions{}, Deadline(), summon.Callback());
  EXPECT_FALSE(summon.Wait().ok());

  // The module was never initialised: no zeros are handed out as the model...
  absl::StatusOr<RegisterResult> views = gm_->GetShards(c[0], "");
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
    gm_->EndSummon(c[r], reg[r]->init_summon->summon, Deadline(), ends.back()->Callback());
  }
  for (auto& e : ends) EXPECT_TRUE(e->Wait().ok()) << e->Wait();
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[r], "");
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
  Fill(*reg[0], 1.0f);
  Fill(*reg[1], 1.0f);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 1u);
  }
  // Step 2: rank 0 finishes its update, rank 1 dies halfway through its own.
  Fill(*reg[0], 2.0f);
  Fill(*reg[1], 2.0f);
  gm_->EndSession("gen", c[1].session);
  // Rank 0's Commit fails at once, naming rank 1.
  Async<absl::StatusOr<uint64_t>> commit0;
  const absl::Time start = absl::Now();
  gm_->Commit(c[0], "", Deadline(absl::Seconds(15)), commit0.Callback());
  absl::StatusOr<uint64_t>& failed = commit0.Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("rank 1"));
  // Until the group re-forms, rank 0's views still show its uncommitted step (generation 1
  // is what they will roll back to).
  absl::StatusOr<RegisterResult> early = gm_->GetShards(c[0], "");
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_EQ(early->generation, 1u);
  EXPECT_TRUE(Holds(*early, 2.0f));
  // Rank 1 comes back: the re-form rolls both ranks back to generation 1.
  c[1] = Rejoin(c, 1);
  std::vector<absl::StatusOr<RegisterResult>> again = RegisterAll({c[1]}, InitMode::kZeros);
  ASSERT_TRUE(again[0].ok()) << again[0].status();
  EXPECT_EQ(again[0]->generation, 1u);
  EXPECT_TRUE(Holds(*again[0], 1.0f));
  EXPECT_TRUE(Holds(*reg[0], 1.0f)) << "the survivor's uncommitted step was not rolled back";
  // The survivor did not read its views since the rollback: its Commit is refused on every
  // rank (naming it), and whatever it wrote in the meantime is rolled back too.
  Fill(*reg[0], 7.0f);
  std::vector<absl::StatusOr<uint64_t>> refused = CommitAll(c);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(refused[r].status().code(), absl::StatusCode::kFailedPrecondition)
        << refused[r].status();
    EXPECT_THAT(refused[r].status().message(), HasSubstr("refused by rank 0"));
  }
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(Holds(*reg[0], 1.0f));
  // Both read their views again, redo step 2 and commit.
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 1u);
    Fill(*v, 2.0f);
  }
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 2u);
  }
  std::vector<GroupManager::ModuleUnits> units = *gm_->ListUnits("gen", std::nullopt);
  ASSERT_EQ(units.size(), 1u);
  EXPECT_TRUE(units[0].initialized);
  EXPECT_EQ(units[0].generation, 2u);
}

}  // namespace
}  // namespace flatshard::server
