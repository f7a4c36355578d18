// GroupManager's resource lifecycle in-process (issue 11): DeleteGroup (who may, what it
// refuses, what it frees), idle groups reclaimed after group_idle_timeout, the per-uid group
// quota, and per-rank state that does not scale with a world_size nobody joins.

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::server {
namespace {

using ::flatshard::testing::ListSegments;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kManifest[] = R"({
 "format": "flatshard.manifest/1",
 "root": {"id": 0, "type": "Net", "bases": ["Module"], "params": [], "children": [
  {"name": "a", "module": {"id": 1, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 0, "shape": [64, 8], "dtype": "float32",
               "requires_grad": true}]}},
  {"name": "b", "module": {"id": 2, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 1, "shape": [32], "dtype": "float32",
               "requires_grad": true}]}}]}})";
constexpr char kPolicy[] =
    R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})";

class GroupLifecycleTest : public ::testing::Test {
 protected:
  GroupLifecycleTest()
      : prefix_(absl::StrCat("fs_gltest_", getpid(), "_",
                             ::testing::UnitTest::GetInstance()->current_test_info()->name())) {}
  ~GroupLifecycleTest() override {
    groups_.reset();
    store_.reset();
    EXPECT_THAT(ListSegments(prefix_), IsEmpty());
  }

  void Start(GroupManagerOptions options) {
    store_ = std::make_unique<ShardStore>(ShardStoreOptions{.segment_prefix = prefix_});
    groups_ = std::make_unique<GroupManager>(store_.get(), std::move(options));
  }

  // Joins `rank` of `group` and waits for the outcome (or the deadline).
  absl::StatusOr<JoinResult> Join(const std::string& group, int world, int rank, int64_t uid,
                                  absl::Duration wait = absl::Seconds(5)) {
    std::promise<absl::StatusOr<JoinResult>> p;
    JoinArgs args;
    args.group = group;
    args.world_size = world;
    args.rank = rank;
    args.token = "t";
    args.uid = uid;
    groups_->Join(args, absl::Now() + wait,
                  [&p](absl::StatusOr<JoinResult> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }
  // Starts a join that completes only when the other ranks arrive (or at `wait`).
  void JoinLater(const std::string& group, int world, int rank, int64_t uid,
                 absl::Duration wait) {
    JoinArgs args;
    args.group = group;
    args.world_size = world;
    args.rank = rank;
    args.token = "t";
    args.uid = uid;
    groups_->Join(args, absl::Now() + wait, [](absl::StatusOr<JoinResult>) {});
  }
  Caller CallerOf(const std::string& group, uint64_t session, int64_t uid, int rank = 0) {
    Caller c;
    c.group = group;
    c.rank = rank;
    c.token = "t";
    c.session = session;
    c.uid = uid;
    return c;
  }
  // A world-1 group of `uid` with the test model registered (zeros); returns the caller.
  Caller JoinAndRegister(const std::string& group, int64_t uid) {
    absl::StatusOr<JoinResult> j = Join(group, 1, 0, uid);
    EXPECT_TRUE(j.ok()) << j.status();
    Caller c = CallerOf(group, j.ok() ? j->session : 0, uid);
    std::promise<absl::StatusOr<RegisterResult>> p;
    groups_->Register(c, "", ManifestFromJson(kManifest), PolicyFromJson(kPolicy),
                      InitMode::kZeros, absl::Now() + absl::Seconds(5),
                      [&p](absl::StatusOr<RegisterResult> r) { p.set_value(std::move(r)); });
    absl::StatusOr<RegisterResult> r = p.get_future().get();
    EXPECT_TRUE(r.ok()) << r.status();
    return c;
  }
  bool Hosts(const std::string& group) const {
    for (const GroupManager::GroupInfo& g : groups_->ListGroups()) {
      if (g.group == group) return true;
    }
    return false;
  }

  std::string prefix_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<GroupManager> groups_;
};

TEST_F(GroupLifecycleTest, DeleteGroupChecksOwnerAndJoinedRanksAndFreesEverything) {
  Start({});
  const Caller c = JoinAndRegister("g", 1000);
  ASSERT_GT(store_->Usage().buffers, 0);
  // Joined: refused, naming the rank; nothing changes.
  absl::StatusOr<GroupManager::DeletedGroup> d = groups_->DeleteGroup("g", 1000, false);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_EQ(d.status().message(),
            "group g: rank 0 is still joined; every rank must leave before the group can be "
            "deleted");
  ASSERT_TRUE(groups_->Leave(c).ok());
  EXPECT_TRUE(Hosts("g")) << "a group with a registered module outlives its sessions";
  const MemoryUsage held = store_->Usage();
  // Another uid may not; root and the daemon's uid (privileged) may.
  d = groups_->DeleteGroup("g", 1001, false);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kPermissionDenied) << d.status();
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("uid 1001 is not admitted"));
  EXPECT_EQ(store_->Usage().buffers, held.buffers);
  d = groups_->DeleteGroup("g", 1000, false);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->group, "g");
  EXPECT_EQ(d->modules, std::vector<std::string>({""}));
  EXPECT_EQ(d->freed_buffers, held.buffers);
  EXPECT_EQ(d->freed_bytes, held.total_bytes);
  EXPECT_FALSE(Hosts("g"));
  EXPECT_EQ(store_->Usage().buffers, 0);
  EXPECT_EQ(store_->Usage().total_bytes, 0);
  EXPECT_THAT(ListSegments(prefix_), IsEmpty());
  EXPECT_EQ(groups_->DeleteGroup("g", 1000, true).status().code(), absl::StatusCode::kNotFound);
  // The old session is gone with the group.
  EXPECT_EQ(groups_->CheckCaller(c).code(), absl::StatusCode::kNotFound);
}

TEST_F(GroupLifecycleTest, PendingJoinBlocksDeleteAndPrivilegedDeleteIgnoresTheOwner) {
  Start({});
  JoinLater("g", 3, 2, 1000, absl::Seconds(30));
  absl::StatusOr<GroupManager::DeletedGroup> d = groups_->DeleteGroup("g", 0, true);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("rank 2 is still joined"));
  const Caller c = JoinAndRegister("h", 1000);
  ASSERT_TRUE(groups_->Leave(c).ok());
  EXPECT_TRUE(groups_->DeleteGroup("h", 0, /*privileged=*/true).ok());
}

TEST_F(GroupLifecycleTest, IdleGroupsAreReclaimedAfterTheTimeoutAndBusyOnesAreNot) {
  GroupManagerOptions o;
  o.group_idle_timeout = absl::Milliseconds(300);
  Start(std::move(o));
  // What the busy group holds (its shards and their committed copies), before the idle one.
  const Caller busy = JoinAndRegister("busy", 1000);
  const int64_t busy_buffers = store_->Usage().buffers;
  ASSERT_GT(busy_buffers, 0);
  const Caller idle = JoinAndRegister("idle", 1000);
  ASSERT_TRUE(groups_->Leave(idle).ok());
  const absl::Time left = absl::Now();
  while (Hosts("idle") && absl::Now() - left < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(Hosts("idle")) << "the idle group was not reclaimed";
  EXPECT_GE(absl::Now() - left, absl::Milliseconds(250)) << "reclaimed before the timeout";
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(Hosts("busy")) << "a group with a session was reclaimed";
  EXPECT_EQ(store_->Usage().buffers, busy_buffers);
  ASSERT_TRUE(groups_->CheckCaller(busy).ok());
}

TEST_F(GroupLifecycleTest, ZeroIdleTimeoutKeepsGroups) {
  GroupManagerOptions o;
  o.group_idle_timeout = absl::ZeroDuration();
  Start(std::move(o));
  ASSERT_TRUE(groups_->Leave(JoinAndRegister("g", 1000)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(Hosts("g"));
}

TEST_F(GroupLifecycleTest, GroupQuotaPerUidRefusesNamingUidQuotaAndGroups) {
  GroupManagerOptions o;
  o.max_groups_per_uid = 2;
  Start(std::move(o));
  JoinLater("a", 2, 0, 1000, absl::Seconds(30));
  JoinLater("b", 2, 0, 1000, absl::Seconds(30));
  absl::StatusOr<JoinResult> j = Join("c", 2, 0, 1000);
  ASSERT_EQ(j.status().code(), absl::StatusCode::kResourceExhausted) << j.status();
  EXPECT_EQ(j.status().message(),
            "uid 1000 cannot create group c: its group quota is 2 (--max_groups_per_uid) and it "
            "has 2 groups on this daemon (a, b); delete one (flatshardctl delete-group) or let "
            "idle ones be reclaimed");
  EXPECT_FALSE(Hosts("c"));
  // Joining an existing group is no new group; another uid has its own quota.
  JoinLater("a", 2, 1, 1000, absl::Seconds(30));
  EXPECT_TRUE(Join("d", 1, 0, 1001).ok());
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
  Start({});
  JoinLater("warmup", 2, 0, 1000, absl::Seconds(30));  // first-use allocations not counted
  const int64_t before = ResidentBytes();
  for (int i = 0; i < 4; ++i) {
    JoinLater(absl::StrCat("huge", i), 1 << 20, 7, 1000, absl::Seconds(30));
  }
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, int64_t{64} << 20) << "4 joins of world_size 2^20 grew the process by "
                                      << (grown >> 20) << " MiB";
  // The groups exist and are usable as views.
  for (const GroupManager::GroupInfo& g : groups_->ListGroups()) {
    if (g.group.rfind("huge", 0) == 0) {
      EXPECT_EQ(g.world_size, 1 << 20);
      EXPECT_EQ(g.joined_ranks, std::vector<int32_t>({7}));
    }
  }
  EXPECT_EQ(groups_->GetStats().sessions, 5);
}

}  // namespace
}  // namespace flatshard::server
