// Overlap in the C++ client against real flatshardd processes: started phase twos of gradient
// reduce-scatters (Client::StartFinish) and summons (Client::StartSummon) run while the
// trainer goes on, keep one collective order on every rank, and a unit's phase one
// (BeginReduceScatter) waits for its own unit's started phase two only. Every test runs in
// each Layout of tests/testing/cluster.h.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/integration/client_e2e_testing.h"
#include "tests/testing/cluster.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using e2e::JoinAndRegister;
using e2e::Rank;
using e2e::ReadOnly;
using ::flatshard::testing::Cluster;
using ::flatshard::testing::Layout;

class ClientOverlapTest : public ::testing::TestWithParam<Layout> {
 protected:
  static ::flatshard::testing::ClusterOptions Options() {
    ::flatshard::testing::ClusterOptions o;
    o.tag_prefix = "fsov";
    return o;
  }
};

// Element i of rank `rank`'s full gradient in round `round`: exact in float32, and so are the
// sums of two ranks'.
float GradValue(int round, int rank, int64_t i) {
  return static_cast<float>(round * 1000 + (rank + 1) * 100 + i % 89);
}

void FillGrad(PendingReduceScatter& p, int round, int rank) {
  float* data = static_cast<float*>(p.data());
  for (int64_t i = 0; i < p.numel(); ++i) data[i] = GradValue(round, rank, i);
}

// Every element of this rank's gradient shard of `unit` is the two ranks' sum of `round`.
void ExpectGradShard(Client& c, int rank, int32_t unit, int round) {
  absl::StatusOr<ShardViews> views = c.GetShardViews("");
  ASSERT_TRUE(views.ok()) << views.status();
  for (const UnitShardView& u : *views) {
    if (u.unit != unit) continue;
    ASSERT_NE(u.grad, nullptr) << "rank " << rank << " unit " << unit;
    const float* g = static_cast<const float*>(u.grad);
    for (int64_t j = 0; j < u.shard_numel; ++j) {
      const int64_t i = u.shard_offset + j;
      ASSERT_EQ(g[j], GradValue(round, 0, i) + GradValue(round, 1, i))
          << "rank " << rank << " unit " << unit << " round " << round << " element " << i;
    }
    return;
  }
  ADD_FAILURE() << "rank " << rank << ": no shard of unit " << unit;
}

TEST_P(ClientOverlapTest, StartedReduceScattersSumLikeFinishAndKeepTheOrder) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "started-rs", 2);
  const Plan& plan = *ranks[0].model.plan;
  absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> none =
      ranks[0].client->StartFinish(nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // Every unit's phase two started, none waited for; each next Begin (another unit) does
    // not wait for them, yet the phase twos reach the daemon in order (rank 1 late, so that
    // an overtaking call would pair different units).
    std::vector<std::unique_ptr<FinishingReduceScatter>> started;
    for (const PlanUnit& u : plan.units) {
      absl::StatusOr<std::unique_ptr<PendingReduceScatter>> p =
          c.BeginReduceScatter("", u.index, ReduceOp::kSum, false);
      ASSERT_TRUE(p.ok()) << p.status();
      float* data = static_cast<float*>((*p)->data());
      for (int64_t i = 0; i < (*p)->numel(); ++i) data[i] = 1.0f + r;
      if (r == 1) absl::SleepFor(absl::Milliseconds(20));
      absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> f = c.StartFinish(*std::move(p));
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ((*f)->unit(), u.index);
      started.push_back(*std::move(f));
    }
    for (std::unique_ptr<FinishingReduceScatter>& f : started) {
      const absl::Status s = f->Wait();
      EXPECT_TRUE(s.ok()) << "rank " << r << " unit " << f->unit() << ": " << s;
      EXPECT_TRUE(f->ready());
      EXPECT_EQ(f->Wait(), s);
    }
    absl::StatusOr<ShardViews> views = c.GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    for (const UnitShardView& u : *views) {
      ASSERT_NE(u.grad, nullptr) << "unit " << u.unit;
      EXPECT_EQ(static_cast<const float*>(u.grad)[0], 3.0f) << "rank " << r << " unit " << u.unit;
    }
  });
}

TEST_P(ClientOverlapTest, BeginWaitsForItsOwnUnitsStartedFinishOnly) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "begin-order", 2);
  const Plan& plan = *ranks[0].model.plan;
  ASSERT_GE(plan.units.size(), 3u);
  // Units 1 and 2 (h.0, h.1) have one size, so the daemon's kept buffers could serve either.
  const int32_t u = plan.units[1].index, v = plan.units[2].index;
  // Rank 1 starts its calls only once rank 0 checked what did not wait: until then rank 0's
  // started phase two of `u` (a collective) cannot complete, nor the summon started after it.
  absl::Notification rank0_checked;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    struct NotifyOnExit {  // rank 1 must not wait forever when rank 0 fails an assertion
      absl::Notification* n;
      ~NotifyOnExit() {
        if (n != nullptr && !n->HasBeenNotified()) n->Notify();
      }
    } notify_on_exit{r == 0 ? &rank0_checked : nullptr};
    if (r == 1) rank0_checked.WaitForNotification();
    // Round 1 of `u` handed to the client's thread, then the prefetch of the next unit.
    absl::StatusOr<std::unique_ptr<PendingReduceScatter>> p1 =
        c.BeginReduceScatter("", u, ReduceOp::kSum, false);
    ASSERT_TRUE(p1.ok()) << p1.status();
    FillGrad(**p1, 1, r);
    absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> f1 = c.StartFinish(*std::move(p1));
    ASSERT_TRUE(f1.ok()) << f1.status();
    absl::StatusOr<std::unique_ptr<PendingSummon>> next =
        c.StartSummon("", plan.units[v].module, ReadOnly());
    ASSERT_TRUE(next.ok()) << next.status();
    // Another unit's phase one does not wait for either.
    absl::StatusOr<std::unique_ptr<PendingReduceScatter>> pv =
        c.BeginReduceScatter("", v, ReduceOp::kSum, false);
    ASSERT_TRUE(pv.ok()) << "rank " << r << ": " << pv.status();
    if (r == 0) {
      EXPECT_FALSE((*f1)->ready()) << "rank 1 has not started its phase two";
      EXPECT_FALSE((*next)->ready()) << "rank 1 has not started its summon";
      rank0_checked.Notify();
    }
    FillGrad(**pv, 1, r);
    // Round 2 of `u`: its phase one returns only once round 1's phase two is complete, so
    // round 2's gradient never lands in the buffer round 1 reduces.
    absl::StatusOr<std::unique_ptr<PendingReduceScatter>> p2 =
        c.BeginReduceScatter("", u, ReduceOp::kSum, false);
    ASSERT_TRUE(p2.ok()) << p2.status();
    EXPECT_TRUE((*f1)->ready()) << "rank " << r;
    ASSERT_TRUE((*f1)->Wait().ok()) << "rank " << r << ": " << (*f1)->Wait();
    FillGrad(**p2, 2, r);
    ExpectGradShard(c, r, u, 1);  // round 1, to the element, before round 2 is reduced
    absl::StatusOr<std::unique_ptr<SummonedParams>> summoned = (*next)->Wait();
    ASSERT_TRUE(summoned.ok()) << summoned.status();
    EXPECT_TRUE((*summoned)->End().ok());
    // Both remaining phase twos started in one order on every rank.
    absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> fv = c.StartFinish(*std::move(pv));
    ASSERT_TRUE(fv.ok()) << fv.status();
    absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> f2 = c.StartFinish(*std::move(p2));
    ASSERT_TRUE(f2.ok()) << f2.status();
    EXPECT_TRUE((*fv)->Wait().ok()) << "rank " << r << ": " << (*fv)->Wait();
    EXPECT_TRUE((*f2)->Wait().ok()) << "rank " << r << ": " << (*f2)->Wait();
    ExpectGradShard(c, r, u, 2);
    ExpectGradShard(c, r, v, 1);
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClientOverlapTest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());

}  // namespace
}  // namespace flatshard::client
