// GroupManager's joins through its public API (GroupManagerHarness: a real ShardStore, the
// in-process backend, a FakeClock): sessions, refusals, deadlines of the clock, withdrawn
// joins, leases that were never opened, drain.

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using ::testing::ElementsAre;
using testing::Eventually;
using ::testing::HasSubstr;
using testing::JoinCall;
using testing::kWait;
using testing::SummonCall;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, AllRanksJoinAndGetDistinctSessions) {
  Start();
  std::vector<Caller> c = JoinAll("g", 3);
  EXPECT_NE(c[0].session, c[1].session);
  EXPECT_NE(c[1].session, c[2].session);
  EXPECT_NE(c[0].session, c[2].session);
  for (const Caller& x : c) EXPECT_TRUE(gm_->CheckCaller(x).ok()) << gm_->CheckCaller(x);
  const std::vector<GroupManager::GroupInfo> groups = gm_->ListGroups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].world_size, 3);
  EXPECT_THAT(groups[0].joined_ranks, ElementsAre(0, 1, 2));
  EXPECT_THAT(groups[0].local_ranks, ElementsAre(0, 1, 2));
  EXPECT_TRUE(groups[0].coordinator.empty());
  EXPECT_EQ(gm_->GetStats().sessions, 3);
  EXPECT_EQ(gm_->GetStats().pending_joins, 0);
  // CheckCaller's refusals.
  Caller bad = c[1];
  bad.token = "nope";
  EXPECT_EQ(gm_->CheckCaller(bad).code(), absl::StatusCode::kPermissionDenied);
  bad = c[1];
  bad.session = c[0].session;
  EXPECT_EQ(gm_->CheckCaller(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad = c[1];
  bad.rank = 3;
  EXPECT_EQ(gm_->CheckCaller(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = c[1];
  bad.group = "other";
  EXPECT_EQ(gm_->CheckCaller(bad).code(), absl::StatusCode::kNotFound);
}

TEST_F(GroupManagerTest, JoinRefusesDisagreementAndDoubleJoin) {
  Start();
  JoinCall first;
  gm_->Join(Args("g", 2, 0), Deadline(), first.Callback());
  // world_size disagreement.
  JoinCall world;
  gm_->Join(Args("g", 3, 1), Deadline(), world.Callback());
  ASSERT_EQ(world.Wait().status().code(), absl::StatusCode::kInvalidArgument)
      << world.Wait().status();
  EXPECT_EQ(world.Wait().status().message(),
            "group g has world_size 2, rank 1 joined with world_size 3");
  // Token disagreement.
  JoinCall token;
  gm_->Join(Args("g", 2, 1, "other"), Deadline(), token.Callback());
  ASSERT_EQ(token.Wait().status().code(), absl::StatusCode::kPermissionDenied)
      << token.Wait().status();
  EXPECT_EQ(token.Wait().status().message(), "group g: wrong token");
  // A rank already joined (here: still joining) cannot join twice.
  JoinCall twice;
  gm_->Join(Args("g", 2, 0), Deadline(), twice.Callback());
  ASSERT_EQ(twice.Wait().status().code(), absl::StatusCode::kAlreadyExists)
      << twice.Wait().status();
  EXPECT_THAT(twice.Wait().status().message(), HasSubstr("group g: rank 0 is already joined"));
  // Another uid's group.
  JoinArgs other_uid = Args("g", 2, 1);
  other_uid.uid = 1000;
  JoinCall uid;
  gm_->Join(other_uid, Deadline(), uid.Callback());
  ASSERT_EQ(uid.Wait().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(uid.Wait().status().message(),
            "group g: uid 1000 is not admitted (the group belongs to uid (remote))");
  // Out-of-range rank, empty group.
  JoinCall range;
  gm_->Join(Args("g", 2, 2), Deadline(), range.Callback());
  EXPECT_EQ(range.Wait().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(range.Wait().status().message(), "group g: rank 2 is out of range [0, 2)");
  JoinCall empty;
  gm_->Join(Args("", 2, 0), Deadline(), empty.Callback());
  EXPECT_EQ(empty.Wait().status().code(), absl::StatusCode::kInvalidArgument);
  // The refusals left no trace: rank 1 joins and both complete.
  EXPECT_FALSE(first.Done());
  JoinCall second;
  gm_->Join(Args("g", 2, 1), Deadline(), second.Callback());
  ASSERT_TRUE(first.Wait().ok()) << first.Wait().status();
  ASSERT_TRUE(second.Wait().ok()) << second.Wait().status();
  // Joined: a second join of the same rank is refused, naming its session.
  JoinCall again;
  gm_->Join(Args("g", 2, 1), Deadline(), again.Callback());
  ASSERT_EQ(again.Wait().status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(
      again.Wait().status().message(),
      absl::StrCat("group g: rank 1 is already joined (session ", second.Wait()->session, ")"));
  EXPECT_EQ(first.calls(), 1);
  EXPECT_EQ(second.calls(), 1);
}

TEST_F(GroupManagerTest, MissingRankFailsTheJoinAtTheDeadlineOfTheClock) {
  Start();
  TickProbe probe(*gm_);
  JoinCall r0, r2;
  gm_->Join(Args("g", 3, 0), clock_.Now() + absl::Seconds(30), r0.Callback());
  gm_->Join(Args("g", 3, 2), clock_.Now() + absl::Seconds(30), r2.Callback());
  // Real time passes, the clock does not: nothing expires.
  probe.Await();
  EXPECT_FALSE(r0.Done());
  clock_.Advance(absl::Seconds(29));
  probe.Await();
  EXPECT_FALSE(r0.Done()) << "expired before its deadline";
  EXPECT_EQ(gm_->GetStats().pending_joins, 3);  // two here, one the probe's
  clock_.Advance(absl::Seconds(1));
  for (JoinCall* j : {&r0, &r2}) {
    absl::StatusOr<JoinResult>& r = j->Wait();
    ASSERT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    EXPECT_EQ(r.status().message(), "group g: rank 1 of 3 did not join before the deadline");
  }
  // A failed join leaves no trace: the ranks join again and the group forms.
  std::vector<Caller> c = JoinAll("g", 3);
  EXPECT_TRUE(gm_->CheckCaller(c[2]).ok());
  EXPECT_EQ(r0.calls(), 1);
  EXPECT_EQ(r2.calls(), 1);
}

TEST_F(GroupManagerTest, JoinWhoseCallerWentAwayIsWithdrawnAndFreesTheRank) {
  Start();
  auto gone = std::make_shared<std::atomic<bool>>(false);
  JoinArgs a = Args("g", 2, 1);
  a.caller_gone = [gone] { return gone->load(); };
  JoinCall withdrawn;
  gm_->Join(a, Deadline(absl::Seconds(60)), withdrawn.Callback());
  gone->store(true);  // the JoinGroup call was cancelled
  absl::StatusOr<JoinResult>& w = withdrawn.Wait();
  ASSERT_EQ(w.status().code(), absl::StatusCode::kCancelled) << w.status();
  EXPECT_EQ(w.status().message(), "group g: rank 1's JoinGroup was cancelled by its caller");
  // The rank is free: a new join of it is no double join, and the group forms without the
  // withdrawn one.
  std::vector<Caller> c = JoinAll("g", 2);
  EXPECT_TRUE(gm_->CheckCaller(c[1]).ok());
  EXPECT_EQ(withdrawn.calls(), 1);
}

TEST_F(GroupManagerTest, JoinCompletingWhenTheCallerIsGoneIsWithdrawnNotCompleted) {
  Start();
  auto gone = std::make_shared<std::atomic<bool>>(false);
  JoinArgs a = Args("g", 2, 0);
  a.caller_gone = [gone] { return gone->load(); };
  JoinCall withdrawn;
  TickProbe probe(*gm_);
  gm_->Join(a, Deadline(absl::Seconds(60)), withdrawn.Callback());
  probe.Await();
  EXPECT_FALSE(withdrawn.Done());
  gone->store(true);
  // Rank 1 arrives at once: rank 0's join must not complete for a caller that is gone.
  JoinCall r1;
  gm_->Join(Args("g", 2, 1), Deadline(), r1.Callback());
  EXPECT_EQ(withdrawn.Wait().status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(r1.Done()) << "the group formed without rank 0";
  JoinCall r0;
  gm_->Join(Args("g", 2, 0), Deadline(), r0.Callback());
  EXPECT_TRUE(r0.Wait().ok()) << r0.Wait().status();
  EXPECT_TRUE(r1.Wait().ok()) << r1.Wait().status();
}

TEST_F(GroupManagerTest, UnleasedSessionExpiresAfterLeaseTimeoutOfTheClock) {
  GroupManagerOptions o;
  o.lease_timeout = absl::Seconds(10);
  Start(std::move(o));
  TickProbe probe(*gm_);
  std::vector<Caller> c = JoinAndRegister("g", 2);
  ASSERT_TRUE(gm_->AttachLease(c[0]).ok());
  EXPECT_EQ(gm_->AttachLease(c[0]).code(), absl::StatusCode::kAlreadyExists);
  clock_.Advance(absl::Seconds(9));
  probe.Await();
  EXPECT_TRUE(gm_->CheckCaller(c[1]).ok()) << "expired before lease_timeout";
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(Eventually([&] { return !gm_->CheckCaller(c[1]).ok(); }))
      << "rank 1 opened no lease but its session did not end";
  EXPECT_EQ(gm_->CheckCaller(c[1]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(gm_->CheckCaller(c[0]).ok()) << "the leased session ended too";
  // As when a lease closes: the group's collectives fail at once, naming the rank.
  SummonCall summon;
  const absl::Time start = absl::Now();
  gm_->Summon(c[0], "", "", SummonOptions{}, Deadline(absl::Seconds(60)), summon.Callback());
  ASSERT_EQ(summon.Wait().status().code(), absl::StatusCode::kUnavailable)
      << summon.Wait().status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "not fail fast";
  EXPECT_THAT(summon.Wait().status().message(),
              HasSubstr("group g: rank 1's session opened no lease within 10s of its join"));
  // The rank is free to join again.
  c[1] = Rejoin("g", 2, 1);
  EXPECT_TRUE(gm_->AttachLease(c[1]).ok());
  clock_.Advance(absl::Seconds(20));
  probe.Await();
  EXPECT_TRUE(gm_->CheckCaller(c[1]).ok()) << "a leased session expired";
}

TEST_F(GroupManagerTest, DrainRefusesJoinsAndLetsTheRestGoOn) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  gm_->StartDrain();
  gm_->StartDrain();  // idempotent
  EXPECT_TRUE(gm_->GetStats().draining);
  JoinCall j;
  gm_->Join(Args("h", 1, 0), Deadline(), j.Callback());
  ASSERT_EQ(j.Wait().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(j.Wait().status().message(), "flatshardd is draining");
  EXPECT_FALSE(Hosts("h"));
  // The joined group works on.
  EXPECT_EQ(ReadAll(c).size(), 5u);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) EXPECT_TRUE(g.ok()) << g.status();
}

}  // namespace
}  // namespace flatshard::server
