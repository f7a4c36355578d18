// GroupManager's Summon allocates its views without holding the manager's lock; these tests
// check what that must not change: the local ranks of a read-only summon share one node copy
// made once (also when they all arrive together), an allocation that fails leaves no trace
// (the units are not summoned, a later summon succeeds), and kept buffers are reused across
// summons.

#include <unistd.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/group_manager_testing.h"
#include "tests/testing/async_call.h"
#include "tests/testing/files.h"

namespace flatshard::server {
namespace {

using ::flatshard::testing::ExampleModelFile;

template <typename T>
using Async = ::flatshard::testing::AsyncCall<T>;

class GroupManagerSummonTest : public ::testing::Test {
 protected:
  void Start(int64_t memory_limit = std::numeric_limits<int64_t>::max()) {
    ShardStoreOptions o;
    o.segment_prefix = absl::StrCat("fsgmst", getpid());
    o.memory_limit_bytes = memory_limit;
    store_ = std::make_unique<ShardStore>(o);
    gm_ = std::make_unique<GroupManager>(store_.get());
  }

  absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

  std::vector<Caller> JoinAndRegister(int world) {
    return testing::JoinAndRegisterExample(*gm_, world, Deadline()).callers;
  }

  // Every caller summons the whole model at once (one thread each); returns their answers.
  std::vector<absl::StatusOr<SummonResult>> SummonAll(const std::vector<Caller>& callers,
                                                      const SummonOptions& options) {
    std::vector<std::unique_ptr<Async<absl::StatusOr<SummonResult>>>> calls;
    std::vector<std::thread> threads;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    for (const Caller& c : callers) {
      calls.push_back(std::make_unique<Async<absl::StatusOr<SummonResult>>>());
      threads.emplace_back([&, c, call = calls.back().get()] {
        ++ready;
        while (!go.load()) std::this_thread::yield();  // all call at once
        gm_->Summon(c, "", "", options, Deadline(), call->Callback());
      });
    }
    while (ready.load() < static_cast<int>(callers.size())) std::this_thread::yield();
    go = true;
    for (auto& t : threads) t.join();
    std::vector<absl::StatusOr<SummonResult>> out;
    for (auto& c : calls) out.push_back(std::move(c->Wait()));
    return out;
  }

  void EndAll(const std::vector<Caller>& callers,
              const std::vector<absl::StatusOr<SummonResult>>& summons) {
    for (size_t i = 0; i < callers.size(); ++i) {
      ASSERT_TRUE(summons[i].ok());
      Async<absl::Status> end;
      gm_->EndSummon(callers[i], summons[i]->summon, Deadline(), end.Callback());
      ASSERT_TRUE(end.Wait().ok()) << end.Wait();
    }
  }

  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<GroupManager> gm_;
};

TEST_F(GroupManagerSummonTest, LocalRanksArrivingTogetherShareOneNodeCopyMadeOnce) {
  Start();
  const std::vector<Caller> c = JoinAndRegister(4);
  const int64_t before = store_->Usage().buffers;
  SummonOptions read_only;
  read_only.writeback = false;
  for (int round = 0; round < 5; ++round) {
    std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, read_only);
    for (size_t r = 0; r < c.size(); ++r) {
      ASSERT_TRUE(s[r].ok()) << "round " << round << " rank " << r << ": " << s[r].status();
      ASSERT_EQ(s[r]->views.size(), s[0]->views.size());
      for (size_t u = 0; u < s[r]->views.size(); ++u) {
        EXPECT_EQ(s[r]->views[u].params.get(), s[0]->views[u].params.get())
            << "round " << round << ": rank " << r << " got its own copy of unit " << u;
      }
    }
    const int64_t units = static_cast<int64_t>(s[0]->views.size());
    // One node copy per unit, made once: no second copy was allocated and dropped, and the
    // same ones are reused every round (all ranks end before the next round).
    EXPECT_EQ(store_->Usage().buffers - before, units) << "round " << round;
    EndAll(c, s);
  }
}

TEST_F(GroupManagerSummonTest, AFailedAllocationLeavesNoTrace) {
  // What the shards and their committed copies take, measured on a first manager.
  Start();
  (void)JoinAndRegister(1);
  const int64_t held = store_->Usage().total_bytes;
  gm_.reset();
  store_.reset();
  // A store with room for exactly that: the views of a summon cannot be allocated.
  Start(held);
  const std::vector<Caller> c2 = JoinAndRegister(1);
  ASSERT_EQ(store_->Usage().total_bytes, held);
  SummonOptions options;
  options.writeback = true;
  Async<absl::StatusOr<SummonResult>> refused;
  gm_->Summon(c2[0], "", "", options, Deadline(), refused.Callback());
  ASSERT_EQ(refused.Wait().status().code(), absl::StatusCode::kResourceExhausted)
      << refused.Wait().status();
  // Nothing changed: no open summon, the units are not summoned (a second refusal says the
  // same, not "already unsharding"), no buffer stays allocated.
  EXPECT_EQ(gm_->GetStats().open_summons, 0);
  EXPECT_EQ(store_->Usage().total_bytes, held);
  Async<absl::StatusOr<SummonResult>> again;
  gm_->Summon(c2[0], "", "", options, Deadline(), again.Callback());
  EXPECT_EQ(again.Wait().status().code(), absl::StatusCode::kResourceExhausted)
      << again.Wait().status();
}

}  // namespace
}  // namespace flatshard::server
