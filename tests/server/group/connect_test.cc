// GroupManager (GroupManagerHarness) connects a group's communicator without its lock (StartConnect
// / FinishConnect): an "inproc" backend whose Connect waits at a gate stands in for a slow UCX or
// NCCL connect.
//   - while a connect is under way the manager answers other calls (nothing waits on mu_);
//   - a shutdown during the connect answers the join once, and the late communicator is
//     dropped, not installed;
//   - a join withdrawn during the connect keeps the others waiting; the connect's result is
//     dropped and the next complete join connects afresh.

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/backend_registry.h"
#include "server/collective/inproc/inproc_backend.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

// Counts connects and holds each one at a gate until the test opens it.
struct Gate {
  absl::Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = false;
  int entered ABSL_GUARDED_BY(mu) = 0;

  void Open() {
    absl::MutexLock lock(&mu);
    open = true;
  }
  // Waits until `n` connects have entered; false after 10 s.
  bool AwaitEntered(int n) {
    absl::MutexLock lock(&mu);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return entered >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(10));
  }
  int Entered() {
    absl::MutexLock lock(&mu);
    return entered;
  }
};

class GatedInproc : public collective::CollectiveBackend {
 public:
  explicit GatedInproc(Gate* gate)
      : gate_(gate), inner_(collective::CreateInprocBackend().value()) {}
  absl::string_view Name() const override { return "inproc"; }
  bool IsViable() const override { return true; }
  bool Supports(collective::MemoryKind kind) const override { return inner_->Supports(kind); }
  absl::StatusOr<std::unique_ptr<collective::Communicator>> Connect(
      const collective::GroupSpec& group) override {
    {
      absl::MutexLock lock(&gate_->mu);
      ++gate_->entered;
      auto open = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) { return gate_->open; };
      if (!gate_->mu.AwaitWithTimeout(absl::Condition(&open), absl::Seconds(20))) {
        return absl::DeadlineExceededError("test: the gate never opened");
      }
    }
    return inner_->Connect(group);
  }

 private:
  Gate* const gate_;
  std::unique_ptr<collective::CollectiveBackend> inner_;
};

// The answer of one Join.
struct Answer {
  absl::Notification done;
  std::optional<absl::StatusOr<JoinResult>> result;
  std::atomic<int> calls{0};
  JoinCallback Callback() {
    return [this](absl::StatusOr<JoinResult> r) {
      ++calls;
      result.emplace(std::move(r));
      done.Notify();
    };
  }
  const absl::StatusOr<JoinResult>& Wait() {
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20))) << "no answer in 20 s";
    if (!result) result.emplace(absl::DeadlineExceededError("test: no answer"));
    return *result;
  }
};

class GroupManagerConnectTest : public testing::GroupManagerHarness {
 protected:
  GroupManagerConnectTest() {
    EXPECT_TRUE(
        registry_
            .Register("inproc",
                      [this](const collective::BackendParams&)
                          -> absl::StatusOr<std::unique_ptr<collective::CollectiveBackend>> {
                        return std::make_unique<GatedInproc>(&gate_);
                      })
            .ok());
    GroupManagerOptions options;
    options.backend_registry = &registry_;
    Start(std::move(options));
  }
  // The manager goes before the gate and the registry its backends use.
  ~GroupManagerConnectTest() override {
    gate_.Open();
    Stop();
  }

  static JoinArgs Args(const std::string& group, int world, int rank,
                       std::function<bool()> gone = {}) {
    JoinArgs a = GroupManagerHarness::Args(group, world, rank);
    a.caller_gone = std::move(gone);
    return a;
  }
  absl::Time Deadline() const { return GroupManagerHarness::Deadline(absl::Seconds(20)); }

  Gate gate_;
  collective::BackendRegistry registry_;
};

TEST_F(GroupManagerConnectTest, TheManagerAnswersWhileAConnectIsUnderWay) {
  Answer a;
  // The last (only) joiner's thread runs the connect, after the manager's lock is released.
  std::thread joiner([&] { gm_->Join(Args("a", 1, 0), Deadline(), a.Callback()); });
  ASSERT_TRUE(gate_.AwaitEntered(1));
  // Each of these takes the manager's lock: with the connect under it they would hang.
  std::vector<GroupManager::GroupInfo> groups = gm_->ListGroups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].group, "a");
  EXPECT_EQ(groups[0].joined_ranks, std::vector<int32_t>{0});
  // Another group forms meanwhile: its connect starts too (neither waits for the other's).
  Answer b;
  std::thread joiner_b([&] { gm_->Join(Args("b", 1, 0), Deadline(), b.Callback()); });
  ASSERT_TRUE(gate_.AwaitEntered(2));
  EXPECT_FALSE(a.done.HasBeenNotified()) << "the join completes only once connected";
  EXPECT_EQ(gm_->GetStats().pending_joins, 2);
  EXPECT_EQ(gm_->CheckCaller(Caller{"a", 0, "tok", 1, -1}).code(),
            absl::StatusCode::kFailedPrecondition);

  gate_.Open();
  joiner.join();
  joiner_b.join();
  ASSERT_TRUE(a.Wait().ok()) << a.Wait().status();
  ASSERT_TRUE(b.Wait().ok()) << b.Wait().status();
  const Caller caller{"a", 0, "tok", a.Wait()->session, -1};
  EXPECT_TRUE(gm_->CheckCaller(caller).ok()) << "the group formed";
  EXPECT_EQ(gate_.Entered(), 2);
}

TEST_F(GroupManagerConnectTest, AShutdownDuringTheConnectAnswersOnceAndDropsTheCommunicator) {
  Answer a;
  std::thread joiner([&] { gm_->Join(Args("a", 1, 0), Deadline(), a.Callback()); });
  ASSERT_TRUE(gate_.AwaitEntered(1));
  gm_->Shutdown();
  const absl::StatusOr<JoinResult>& r = a.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("shutting down"));
  gate_.Open();
  joiner.join();  // FinishConnect found the daemon shutting down: nothing installed
  EXPECT_EQ(a.calls.load(), 1);
  std::vector<GroupManager::GroupInfo> groups = gm_->ListGroups();
  for (const GroupManager::GroupInfo& g : groups) {
    EXPECT_TRUE(g.local_ranks.empty()) << "group " << g.group << " formed after the shutdown";
  }
}

TEST_F(GroupManagerConnectTest, AJoinWithdrawnDuringTheConnectKeepsTheOthersWaiting) {
  std::atomic<bool> gone{false};
  Answer first0;
  Answer r1;
  gm_->Join(Args("w", 2, 0, [&] { return gone.load(); }), Deadline(), first0.Callback());
  std::thread joiner([&] { gm_->Join(Args("w", 2, 1), Deadline(), r1.Callback()); });
  ASSERT_TRUE(gate_.AwaitEntered(1));
  // Rank 0's caller goes away while the communicator is being connected: the deadline loop
  // withdraws its join.
  gone = true;
  const absl::StatusOr<JoinResult>& withdrawn = first0.Wait();
  EXPECT_EQ(withdrawn.status().code(), absl::StatusCode::kCancelled) << withdrawn.status();
  gate_.Open();
  joiner.join();  // the connect finished for a group no longer complete: dropped
  EXPECT_FALSE(r1.done.HasBeenNotified()) << "rank 1 must wait for rank 0 to join again";

  Answer again0;
  gm_->Join(Args("w", 2, 0), Deadline(), again0.Callback());
  ASSERT_TRUE(again0.Wait().ok()) << again0.Wait().status();
  ASSERT_TRUE(r1.Wait().ok()) << r1.Wait().status();
  EXPECT_EQ(gate_.Entered(), 2) << "the complete join connected afresh";
  EXPECT_TRUE(gm_->CheckCaller(Caller{"w", 1, "tok", r1.Wait()->session, -1}).ok());
}

}  // namespace
}  // namespace flatshard::server
