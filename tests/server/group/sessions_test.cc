// GroupManager's sessions through its public API (GroupManagerHarness): an ended session fails
// the group's collectives fast until the rank joins again, a departed rank's submitted ops
// complete first (bounded on the clock), shutdown and the destructor answer every wait once.

#include <memory>
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

using testing::CommitCall;
using ::testing::ElementsAre;
using testing::Eventually;
using testing::Fill;
using ::testing::HasSubstr;
using testing::IdsOf;
using testing::JoinCall;
using testing::kTestPolicy;
using testing::kWait;
using testing::RegisterCall;
using testing::StatusCall;
using testing::SummonCall;
using testing::TestManifest;
using testing::WriteRankPattern;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, EndedSessionFailsCollectivesFastUntilTheRankJoinsAgain) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  // Rank 0 waits in a summon rank 1 never makes; rank 1's lease ends.
  SummonCall waiting;
  gm_->Summon(c[0], "", "", SummonOptions{}, Deadline(absl::Seconds(60)), waiting.Callback());
  EXPECT_GT(gm_->GetStats().pending_collectives, 0);
  const std::vector<GroupManager::GroupCollectives> pending = gm_->ListCollectives("g");
  ASSERT_EQ(pending.size(), 1u);
  ASSERT_FALSE(pending[0].pending.empty());
  EXPECT_THAT(pending[0].pending[0].arrived_ranks, ElementsAre(0));
  EXPECT_THAT(pending[0].pending[0].missing_ranks, ElementsAre(1));
  const absl::Time start = absl::Now();
  gm_->EndSession("g", c[1].session);
  absl::StatusOr<SummonResult>& failed = waiting.Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "not fail fast";
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_EQ(failed.status().message(),
            "group g: rank 1's session ended (its lease closed: the client is gone)");
  EXPECT_EQ(GroupStatus("g"), failed.status());
  EXPECT_EQ(gm_->CheckCaller(c[1]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gm_->Leave(c[1]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gm_->AttachLease(c[1]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gm_->GetStats().open_summons, 0) << "the failed summon stayed open";
  // Later collectives fail at once with the same cause, without waiting for their deadline.
  for (int i = 0; i < 2; ++i) {
    CommitCall commit;
    gm_->Commit(c[0], "", Deadline(absl::Seconds(60)), commit.Callback());
    EXPECT_EQ(commit.Wait().status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(commit.Wait().status().message(), HasSubstr("rank 1's session ended"));
  }
  // Ending an unknown session changes nothing.
  gm_->EndSession("g", 999999);
  gm_->EndSession("nope", c[0].session);
  EXPECT_TRUE(gm_->CheckCaller(c[0]).ok());
  // Rank 1 joins again, re-attaches, and the group works.
  std::vector<std::string> modules;
  c[1] = Rejoin("g", 2, 1, &modules);
  EXPECT_THAT(modules, ElementsAre(""));
  EXPECT_TRUE(GroupStatus("g").ok()) << GroupStatus("g");
  RegisterCall reattach;
  gm_->Register(c[1], "", ManifestFromJson(TestManifest()), PolicyFromJson(kTestPolicy),
                InitMode::kZeros, Deadline(), reattach.Callback());
  ASSERT_TRUE(reattach.Wait().ok()) << reattach.Wait().status();
  ASSERT_TRUE(gm_->GetShards(c[0], "").ok());
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{});
  WriteRankPattern(*s[0], 0);
  WriteRankPattern(*s[1], 1);
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  EXPECT_EQ(ReadAll(c)[4][7], 1007.0f);
}

TEST_F(GroupManagerTest, DepartedRanksAgreementCompletesBeforeTheGroupFails) {
  Start();
  TickProbe probe(*gm_);
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  Fill(regs[0], 4);
  Fill(regs[1], 4);
  // Rank 1 commits, then its client dies before rank 0 arrives. The agreement rank 1 joined
  // still completes (on a multi-daemon group, another daemon may already have applied it).
  CommitCall commit1;
  gm_->Commit(c[1], "", Deadline(absl::Seconds(60)), commit1.Callback());
  gm_->EndSession("g", c[1].session);
  probe.Await();
  EXPECT_TRUE(GroupStatus("g").ok()) << "failed before the departed rank's op completed";
  EXPECT_FALSE(commit1.Done());
  CommitCall commit0;
  gm_->Commit(c[0], "", Deadline(absl::Seconds(60)), commit0.Callback());
  ASSERT_TRUE(commit0.Wait().ok()) << commit0.Wait().status();
  EXPECT_EQ(*commit0.Wait(), 1u);
  ASSERT_TRUE(commit1.Wait().ok()) << commit1.Wait().status();
  // Then the group fails, naming rank 1.
  EXPECT_TRUE(Eventually([&] { return !GroupStatus("g").ok(); }));
  EXPECT_THAT(GroupStatus("g").message(), HasSubstr("rank 1's session ended"));
  EXPECT_EQ(gm_->GetShards(c[0], "")->generation, 1u);
}

TEST_F(GroupManagerTest, DepartedRanksStuckOpFailsTheGroupOnceTheClockPassesTheBound) {
  Start();
  TickProbe probe(*gm_);
  std::vector<Caller> c = JoinAndRegister("g", 2);
  CommitCall commit1;
  gm_->Commit(c[1], "", Deadline(absl::Seconds(60)), commit1.Callback());
  gm_->EndSession("g", c[1].session);
  // Rank 0 never commits: the op cannot complete. The failure waits for it at most the
  // deferred bound (2 s) of the manager's clock, not of real time.
  probe.Await();
  EXPECT_TRUE(GroupStatus("g").ok());
  EXPECT_FALSE(commit1.Done());
  clock_.Advance(absl::Milliseconds(1999));
  probe.Await();
  EXPECT_TRUE(GroupStatus("g").ok()) << "failed before the deferred bound";
  clock_.Advance(absl::Milliseconds(1));
  absl::StatusOr<uint64_t>& failed = commit1.Wait();
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("rank 1's session ended"));
  EXPECT_THAT(GroupStatus("g").message(), HasSubstr("rank 1's session ended"));
  // A collective of rank 0 now fails at once.
  SummonCall summon;
  gm_->Summon(c[0], "", "", SummonOptions{}, Deadline(absl::Seconds(60)), summon.Callback());
  EXPECT_EQ(summon.Wait().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(GroupManagerTest, ReturningRankEndsTheDeferralAtOnce) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  CommitCall commit1;
  gm_->Commit(c[1], "", Deadline(absl::Seconds(60)), commit1.Callback());
  gm_->EndSession("g", c[1].session);
  // Rank 1 joins again before the bound: the failure happens now and the group re-forms.
  c[1] = Rejoin("g", 2, 1);
  EXPECT_EQ(commit1.Wait().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(GroupStatus("g").ok()) << GroupStatus("g");
  ASSERT_TRUE(gm_->GetShards(c[0], "").ok());
  ASSERT_TRUE(gm_->GetShards(c[1], "").ok());
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) EXPECT_TRUE(g.ok()) << g.status();
}

// ---------------------------------------------------------------------------------------------
// Shutdown, idle groups, DeleteGroup

TEST_F(GroupManagerTest, ShutdownFailsEveryPendingWaitOnceAndRefusesNewWork) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  std::vector<Caller> c2 = JoinAndRegister("g2", 2);
  JoinCall join;
  gm_->Join(Args("h", 2, 0), Deadline(absl::Seconds(60)), join.Callback());
  SummonCall summon;
  gm_->Summon(c[0], "", "", SummonOptions{}, Deadline(absl::Seconds(60)), summon.Callback());
  CommitCall commit;
  gm_->Commit(c2[1], "", Deadline(absl::Seconds(60)), commit.Callback());
  EXPECT_GT(gm_->GetStats().pending_collectives, 1);
  gm_->Shutdown();
  EXPECT_EQ(join.Wait().status(), absl::UnavailableError("flatshardd is shutting down"));
  EXPECT_EQ(summon.Wait().status().code(), absl::StatusCode::kUnavailable)
      << summon.Wait().status();
  EXPECT_EQ(commit.Wait().status().code(), absl::StatusCode::kUnavailable)
      << commit.Wait().status();
  EXPECT_TRUE(gm_->GetStats().shutting_down);
  gm_->Shutdown();  // idempotent
  JoinCall late;
  gm_->Join(Args("i", 1, 0), Deadline(), late.Callback());
  EXPECT_EQ(late.Wait().status(), absl::UnavailableError("flatshardd is shutting down"));
  RegisterCall reg;
  gm_->Register(c[0], "x", ManifestFromJson(TestManifest()), PolicyFromJson(kTestPolicy),
                InitMode::kZeros, Deadline(), reg.Callback());
  EXPECT_EQ(reg.Wait().status().code(), absl::StatusCode::kUnavailable);
  SummonCall late_summon;
  gm_->Summon(c[0], "", "", SummonOptions{}, Deadline(), late_summon.Callback());
  EXPECT_EQ(late_summon.Wait().status().code(), absl::StatusCode::kUnavailable);
  // The destructor does not hang, and no callback ran twice.
  const absl::Time start = absl::Now();
  gm_.reset();
  EXPECT_LT(absl::Now() - start, kWait);
  for (int calls : {join.calls(), summon.calls(), commit.calls(), late.calls(), reg.calls(),
                    late_summon.calls()}) {
    EXPECT_EQ(calls, 1);
  }
}

TEST_F(GroupManagerTest, DestructorFailsPendingWaits) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  JoinCall join;
  gm_->Join(Args("h", 3, 1), Deadline(absl::Seconds(60)), join.Callback());
  StatusCall end;
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{});
  gm_->EndSummon(c[0], s[0]->summon, Deadline(absl::Seconds(60)), end.Callback());
  gm_.reset();
  EXPECT_EQ(join.Wait().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(end.Wait().code(), absl::StatusCode::kUnavailable) << end.Wait();
  EXPECT_EQ(join.calls(), 1);
  EXPECT_EQ(end.calls(), 1);
}

}  // namespace
}  // namespace flatshard::server
