// GroupManager's reduce-scatter of gradients through its public API (GroupManagerHarness):
// SUM, AVG, accumulate, with_grads summons, refusals, a failure that changes nothing.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::FloatCount;
using testing::Floats;
using ::testing::HasSubstr;
using testing::IdsOf;
using ::testing::IsEmpty;
using testing::kWait;
using testing::StatusCall;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, ReduceScatterSumsAveragesAndAccumulates) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  constexpr int32_t kUnit = 2;  // enc.l1: 15 elements, shard 8
  auto grads_hold = [&](float factor) {
    for (int rank = 0; rank < 2; ++rank) {
      absl::StatusOr<RegisterResult> v = gm_->GetShards(c[rank], "");
      if (!v.ok()) return ::testing::AssertionFailure() << v.status();
      const std::shared_ptr<Buffer>& g = v->shards[kUnit].grad;
      if (g == nullptr) return ::testing::AssertionFailure() << "rank " << rank << ": no gradient";
      for (int64_t j = 0; j < FloatCount(*g); ++j) {
        const float want = factor * (rank * FloatCount(*g) + j + 1);
        if (Floats(*g)[j] != want) {
          return ::testing::AssertionFailure()
                 << "rank " << rank << " element " << j << ": " << Floats(*g)[j] << " != " << want;
        }
      }
      if (v->shards[1].grad != nullptr)
        return ::testing::AssertionFailure() << "unit 1 got a gradient";
    }
    return ::testing::AssertionSuccess();
  };
  for (const absl::Status& s : ReduceScatterAll(c, kUnit, ReduceOp::kSum, false, Deadline())) {
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(grads_hold(3.0f));  // 1 + 2
  for (const absl::Status& s : ReduceScatterAll(c, kUnit, ReduceOp::kAvg, true, Deadline())) {
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(grads_hold(4.5f));  // 3 + (1 + 2) / 2
  for (const absl::Status& s : ReduceScatterAll(c, kUnit, ReduceOp::kAvg, false, Deadline())) {
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(grads_hold(1.5f));  // replaced
  // with_grads: the full gradient of units that have one; none for the others.
  std::vector<absl::StatusOr<SummonResult>> s =
      SummonAll(c, "enc", SummonOptions{.writeback = false, .with_grads = true});
  for (const absl::StatusOr<SummonResult>& r : s) {
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->views.size(), 3u);
    EXPECT_EQ(r->views[0].grads, nullptr) << "a unit without a gradient reports it absent";
    ASSERT_NE(r->views[1].grads, nullptr);
    for (int64_t i = 0; i < FloatCount(*r->views[1].grads); ++i) {
      ASSERT_EQ(Floats(*r->views[1].grads)[i], 1.5f * (i + 1));
    }
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  // rank0_only: only rank 0 sees the full gradient.
  s = SummonAll(c, "enc.l1",
                SummonOptions{.writeback = false, .rank0_only = true, .with_grads = true});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  ASSERT_EQ(s[0]->views.size(), 1u);
  ASSERT_NE(s[0]->views[0].grads, nullptr);
  for (int64_t i = 0; i < FloatCount(*s[0]->views[0].grads); ++i) {
    ASSERT_EQ(Floats(*s[0]->views[0].grads)[i], 1.5f * (i + 1));
  }
  EXPECT_THAT(s[1]->views, IsEmpty());
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  // Refusals.
  EXPECT_EQ(gm_->BeginReduceScatter(c[0], "", 9).status().code(), absl::StatusCode::kNotFound);
  StatusCall unbegun;
  gm_->FinishReduceScatter(c[0], "", 3, ReduceOp::kSum, false, Deadline(), unbegun.Callback());
  ASSERT_EQ(unbegun.Wait().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(unbegun.Wait().message(), HasSubstr("(begin the reduce-scatter first)"));
}

TEST_F(GroupManagerTest, FailedReduceScatterChangesNothingAndARepeatedFinishGetsItsCause) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  absl::StatusOr<std::shared_ptr<Buffer>> full = gm_->BeginReduceScatter(c[0], "", 4);
  ASSERT_TRUE(full.ok()) << full.status();
  for (int64_t i = 0; i < FloatCount(**full); ++i) Floats(**full)[i] = 1.0f;
  StatusCall finish;
  gm_->FinishReduceScatter(c[0], "", 4, ReduceOp::kSum, false, Deadline(absl::Seconds(60)),
                           finish.Callback());
  // Rank 1's client dies: rank 0's reduce-scatter fails at once, naming it.
  const absl::Time start = absl::Now();
  gm_->EndSession("g", c[1].session);
  const absl::Status failed = finish.Wait();
  EXPECT_LT(absl::Now() - start, kWait);
  ASSERT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_THAT(failed.message(), HasSubstr("rank 1's session ended"));
  // The unit got no gradient.
  absl::StatusOr<RegisterResult> v = gm_->GetShards(c[0], "");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->shards[4].grad, nullptr);
  // A client's retry of the finish gets the first cause, not "begin first".
  StatusCall retry;
  gm_->FinishReduceScatter(c[0], "", 4, ReduceOp::kSum, false, Deadline(), retry.Callback());
  EXPECT_EQ(retry.Wait(), failed);
  EXPECT_EQ(finish.calls(), 1);
}

}  // namespace
}  // namespace flatshard::server
