// GroupManager's resource lifecycle in-process (issue 11; GroupManagerHarness): DeleteGroup (who
// may, what it refuses, what it frees), idle groups reclaimed after group_idle_timeout (of the
// FakeClock, and of real time), the per-uid group quota, and per-rank state that does not
// scale with a world_size nobody joins.

#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using ::testing::ElementsAre;
using testing::Eventually;
using ::testing::HasSubstr;
using testing::IdsOf;
using ::testing::IsEmpty;
using testing::kWait;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, IdleGroupIsReclaimedAfterTheTimeoutOfTheClock) {
  GroupManagerOptions o;
  o.group_idle_timeout = absl::Minutes(10);
  Start(std::move(o));
  TickProbe probe(*gm_);
  const int64_t probe_buffers = store_->Usage().buffers;
  std::vector<Caller> busy = JoinAndRegister("busy", 1);
  ASSERT_TRUE(gm_->AttachLease(busy[0]).ok());  // else its session ends after lease_timeout
  const int64_t busy_buffers = store_->Usage().buffers - probe_buffers;
  std::vector<Caller> idle = JoinAndRegister("idle", 2);
  ASSERT_TRUE(gm_->Leave(idle[0]).ok());
  ASSERT_TRUE(gm_->Leave(idle[1]).ok());
  EXPECT_TRUE(Hosts("idle")) << "a group with a registered module outlives its sessions";
  probe.Await();  // the loop saw it unused from now on
  clock_.Advance(absl::Minutes(10) - absl::Milliseconds(1));
  probe.Await();
  EXPECT_TRUE(Hosts("idle")) << "reclaimed before group_idle_timeout";
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_TRUE(Eventually([&] { return !Hosts("idle"); })) << "the idle group was not reclaimed";
  EXPECT_TRUE(Hosts("busy"));
  EXPECT_TRUE(gm_->CheckCaller(busy[0]).ok());
  // Its buffers go right after it (dropped outside the manager's lock).
  EXPECT_TRUE(Eventually([&] { return store_->Usage().buffers - probe_buffers == busy_buffers; }))
      << "the reclaimed group's memory was not freed: " << store_->Usage().buffers << " buffers";
  // A group whose rank is joined is never reclaimed.
  clock_.Advance(absl::Hours(24));
  probe.Await();
  EXPECT_TRUE(Hosts("busy"));
}

TEST_F(GroupManagerTest, DeleteGroupRefusesJoinedRanksThenFreesEverything) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{.writeback = false});
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  absl::StatusOr<GroupManager::DeletedGroup> d = gm_->DeleteGroup("g", -1, false);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("ranks 0, 1 are still joined"));
  ASSERT_TRUE(gm_->Leave(c[0]).ok());
  ASSERT_TRUE(gm_->Leave(c[1]).ok());
  const MemoryUsage held = store_->Usage();
  ASSERT_GT(held.buffers, 0);
  d = gm_->DeleteGroup("g", 1234, false);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kPermissionDenied) << d.status();
  d = gm_->DeleteGroup("g", -1, false);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_THAT(d->modules, ElementsAre(""));
  EXPECT_EQ(d->freed_buffers, held.buffers);
  EXPECT_EQ(d->freed_bytes, held.total_bytes);
  // The views a client still maps stay until it lets them go; the rest is gone now.
  EXPECT_GT(store_->Usage().buffers, 0);
  EXPECT_LT(store_->Usage().buffers, held.buffers);
  s.clear();
  EXPECT_EQ(store_->Usage().buffers, 0);
  EXPECT_FALSE(Hosts("g"));
  EXPECT_EQ(gm_->DeleteGroup("g", -1, false).status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------------------
// DeleteGroup's owner checks, idle reclaim in real time, the per-uid group quota, huge world
// sizes (a small model of two Linear units; world-1 groups of uid 1000 unless said).

constexpr char kLifecycleManifest[] = R"({
 "format": "flatshard.manifest/1",
 "root": {"id": 0, "type": "Net", "bases": ["Module"], "params": [], "children": [
  {"name": "a", "module": {"id": 1, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 0, "shape": [64, 8], "dtype": "float32",
               "requires_grad": true}]}},
  {"name": "b", "module": {"id": 2, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 1, "shape": [32], "dtype": "float32",
               "requires_grad": true}]}}]}})";
constexpr char kLifecyclePolicy[] =
    R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})";

class GroupLifecycleTest : public testing::GroupManagerHarness {
 protected:
  GroupLifecycleTest() { model_ = {kLifecycleManifest, kLifecyclePolicy}; }

  // A world-1 group of `uid` with the model registered (zeros); returns the caller.
  Caller JoinAndRegisterOne(const std::string& group, int64_t uid) {
    return JoinAndRegister(group, 1, nullptr, uid)[0];
  }
};

TEST_F(GroupLifecycleTest, DeleteGroupChecksOwnerAndJoinedRanksAndFreesEverything) {
  Start();
  const Caller c = JoinAndRegisterOne("g", 1000);
  ASSERT_GT(store_->Usage().buffers, 0);
  // Joined: refused, naming the rank; nothing changes.
  absl::StatusOr<GroupManager::DeletedGroup> d = gm_->DeleteGroup("g", 1000, false);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_EQ(d.status().message(),
            "group g: rank 0 is still joined; every rank must leave before the group can be "
            "deleted");
  ASSERT_TRUE(gm_->Leave(c).ok());
  EXPECT_TRUE(Hosts("g")) << "a group with a registered module outlives its sessions";
  const MemoryUsage held = store_->Usage();
  // Another uid may not; root and the daemon's uid (privileged) may.
  d = gm_->DeleteGroup("g", 1001, false);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kPermissionDenied) << d.status();
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("uid 1001 is not admitted"));
  EXPECT_EQ(store_->Usage().buffers, held.buffers);
  d = gm_->DeleteGroup("g", 1000, false);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->group, "g");
  EXPECT_EQ(d->modules, std::vector<std::string>({""}));
  EXPECT_EQ(d->freed_buffers, held.buffers);
  EXPECT_EQ(d->freed_bytes, held.total_bytes);
  EXPECT_FALSE(Hosts("g"));
  EXPECT_EQ(store_->Usage().buffers, 0);
  EXPECT_EQ(store_->Usage().total_bytes, 0);
  EXPECT_THAT(Segments(), IsEmpty());
  EXPECT_EQ(gm_->DeleteGroup("g", 1000, true).status().code(), absl::StatusCode::kNotFound);
  // The old session is gone with the group.
  EXPECT_EQ(gm_->CheckCaller(c).code(), absl::StatusCode::kNotFound);
}

TEST_F(GroupLifecycleTest, PendingJoinBlocksDeleteAndPrivilegedDeleteIgnoresTheOwner) {
  Start();
  JoinLater(Args("g", 3, 2, testing::kToken, 1000), absl::Seconds(30));
  absl::StatusOr<GroupManager::DeletedGroup> d = gm_->DeleteGroup("g", 0, true);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("rank 2 is still joined"));
  const Caller c = JoinAndRegisterOne("h", 1000);
  ASSERT_TRUE(gm_->Leave(c).ok());
  EXPECT_TRUE(gm_->DeleteGroup("h", 0, /*privileged=*/true).ok());
}

// As IdleGroupIsReclaimedAfterTheTimeoutOfTheClock, on the real clock.
TEST_F(GroupLifecycleTest, IdleGroupsAreReclaimedAfterTheTimeoutAndBusyOnesAreNot) {
  GroupManagerOptions o;
  o.group_idle_timeout = absl::Milliseconds(300);
  o.clock = Clock::Real();
  Start(std::move(o));
  // What the busy group holds (its shards and their committed copies), before the idle one.
  const Caller busy = JoinAndRegisterOne("busy", 1000);
  AttachLeases({busy});  // else its session ends after lease_timeout of real time
  const int64_t busy_buffers = store_->Usage().buffers;
  ASSERT_GT(busy_buffers, 0);
  const Caller idle = JoinAndRegisterOne("idle", 1000);
  ASSERT_TRUE(gm_->Leave(idle).ok());
  const absl::Time left = absl::Now();
  while (Hosts("idle") && absl::Now() - left < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(Hosts("idle")) << "the idle group was not reclaimed";
  EXPECT_GE(absl::Now() - left, absl::Milliseconds(250)) << "reclaimed before the timeout";
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(Hosts("busy")) << "a group with a session was reclaimed";
  EXPECT_EQ(store_->Usage().buffers, busy_buffers);
  ASSERT_TRUE(gm_->CheckCaller(busy).ok());
}

TEST_F(GroupLifecycleTest, ZeroIdleTimeoutKeepsGroups) {
  GroupManagerOptions o;
  o.group_idle_timeout = absl::ZeroDuration();
  Start(std::move(o));
  TickProbe probe(*gm_);
  ASSERT_TRUE(gm_->Leave(JoinAndRegisterOne("g", 1000)).ok());
  clock_.Advance(absl::Hours(24 * 365));
  probe.Await();
  EXPECT_TRUE(Hosts("g"));
}

TEST_F(GroupLifecycleTest, GroupQuotaPerUidRefusesNamingUidQuotaAndGroups) {
  GroupManagerOptions o;
  o.max_groups_per_uid = 2;
  Start(std::move(o));
  JoinLater(Args("a", 2, 0, testing::kToken, 1000), absl::Seconds(30));
  JoinLater(Args("b", 2, 0, testing::kToken, 1000), absl::Seconds(30));
  absl::StatusOr<JoinResult> j = JoinAndWait(Args("c", 2, 0, testing::kToken, 1000));
  ASSERT_EQ(j.status().code(), absl::StatusCode::kResourceExhausted) << j.status();
  EXPECT_EQ(j.status().message(),
            "uid 1000 cannot create group c: its group quota is 2 (--max_groups_per_uid) and it "
            "has 2 groups on this daemon (a, b); delete one (flatshardctl delete-group) or let "
            "idle ones be reclaimed");
  EXPECT_FALSE(Hosts("c"));
  // Joining an existing group is no new group; another uid has its own quota.
  JoinLater(Args("a", 2, 1, testing::kToken, 1000), absl::Seconds(30));
  EXPECT_TRUE(JoinAndWait(Args("d", 1, 0, testing::kToken, 1001)).ok());
}

// Resident memory of this process in bytes (/proc/self/statm).
int64_t ResidentBytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

// Before: one JoinGroup of world_size 2^20 cost ~700 MB (a queue per rank in the engine, a
// slot per rank in several tables), four 3 GB. Now per-rank state exists only for ranks that
// join; what is left per rank up front is the local group's rank list.
TEST_F(GroupLifecycleTest, HugeWorldSizeNobodyJoinsCostsLittleMemory) {
  Start();
  // First-use allocations not counted.
  JoinLater(Args("warmup", 2, 0, testing::kToken, 1000), absl::Seconds(30));
  const int64_t before = ResidentBytes();
  for (int i = 0; i < 4; ++i) {
    JoinLater(Args(absl::StrCat("huge", i), 1 << 20, 7, testing::kToken, 1000), absl::Seconds(30));
  }
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, int64_t{64} << 20)
      << "4 joins of world_size 2^20 grew the process by " << (grown >> 20) << " MiB";
  // The groups exist and are usable as views.
  for (const GroupManager::GroupInfo& g : gm_->ListGroups()) {
    if (g.group.rfind("huge", 0) == 0) {
      EXPECT_EQ(g.world_size, 1 << 20);
      EXPECT_EQ(g.joined_ranks, std::vector<int32_t>({7}));
    }
  }
  EXPECT_EQ(gm_->GetStats().sessions, 5);
}

}  // namespace
}  // namespace flatshard::server
