// NodeAssembly (server/module/node_assembly.h): the local ranks of a read-only summon meet on
// their node's copy; answers once all arrived, a failure at once, a deadline naming the
// missing local ranks.

#include "server/module/node_assembly.h"

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

// An answer, recorded once.
struct Answer {
  absl::Notification done;
  absl::Status status;
  absl::AnyInvocable<void(absl::Status)> Callback() {
    return [this](absl::Status s) {
      status = std::move(s);
      done.Notify();
    };
  }
};

TEST(NodeAssemblyTest, EveryLocalRankIsAnsweredOnceAllArrived) {
  NodeAssembly assembly;
  auto slot = std::make_shared<SummonSlot>();
  const std::vector<int32_t> locals = {2, 3};
  Answer a, b;
  assembly.Arrive(slot, 2, locals, absl::OkStatus(), absl::InfiniteFuture(), "summon",
                  a.Callback());
  EXPECT_FALSE(a.done.HasBeenNotified());  // rank 3 has not copied its block yet
  assembly.Arrive(slot, 3, locals, absl::OkStatus(), absl::InfiniteFuture(), "summon",
                  b.Callback());
  ASSERT_TRUE(a.done.HasBeenNotified());
  ASSERT_TRUE(b.done.HasBeenNotified());
  EXPECT_TRUE(a.status.ok()) << a.status;
  EXPECT_TRUE(b.status.ok()) << b.status;
}

TEST(NodeAssemblyTest, AFailureAnswersTheWaitingAndLaterRanksAtOnce) {
  NodeAssembly assembly;
  auto slot = std::make_shared<SummonSlot>();
  const std::vector<int32_t> locals = {0, 1, 2};
  Answer a, b, c;
  assembly.Arrive(slot, 0, locals, absl::OkStatus(), std::nullopt, "", a.Callback());
  assembly.Arrive(slot, 1, locals, absl::UnavailableError("rank 1's all-gather failed"),
                  std::nullopt, "", b.Callback());
  ASSERT_TRUE(a.done.HasBeenNotified());
  ASSERT_TRUE(b.done.HasBeenNotified());
  EXPECT_THAT(a.status.message(), HasSubstr("rank 1's all-gather failed"));
  EXPECT_TRUE(absl::IsUnavailable(b.status)) << b.status;
  assembly.Arrive(slot, 2, locals, absl::OkStatus(), std::nullopt, "", c.Callback());
  ASSERT_TRUE(c.done.HasBeenNotified());
  EXPECT_TRUE(absl::IsUnavailable(c.status)) << c.status;
}

TEST(NodeAssemblyTest, APassedDeadlineNamesTheLocalRanksThatDidNotArrive) {
  NodeAssembly assembly;
  auto slot = std::make_shared<SummonSlot>();
  const std::vector<int32_t> locals = {4, 5, 6};
  Answer a;
  // The deadline has passed already: the assembly's timer answers at once, on its thread.
  assembly.Arrive(slot, 5, locals, absl::OkStatus(), absl::Now(), "group g rank 5: summon",
                  a.Callback());
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(absl::IsDeadlineExceeded(a.status)) << a.status;
  EXPECT_THAT(a.status.message(), HasSubstr("group g rank 5: summon: local ranks 4, 6 did not"));
  // A rank arriving after that gets the same error at once.
  Answer late;
  assembly.Arrive(slot, 4, locals, absl::OkStatus(), absl::Now(), "", late.Callback());
  ASSERT_TRUE(late.done.HasBeenNotified());
  EXPECT_TRUE(absl::IsDeadlineExceeded(late.status)) << late.status;
}

TEST(NodeAssemblyTest, ALocalRankThatLeftFailsTheWaitUnlessItArrived) {
  NodeAssembly assembly;
  auto slot = std::make_shared<SummonSlot>();
  const std::vector<int32_t> locals = {0, 1, 2};
  Answer a, b;
  assembly.Arrive(slot, 0, locals, absl::OkStatus(), absl::InfiniteFuture(), "", a.Callback());
  assembly.Fail(slot, 0, absl::UnavailableError("rank 0 left"));  // arrived: changes nothing
  EXPECT_FALSE(a.done.HasBeenNotified());
  assembly.Fail(slot, 1, absl::UnavailableError("rank 1 left"));
  ASSERT_TRUE(a.done.HasBeenNotified());
  EXPECT_THAT(a.status.message(), HasSubstr("rank 1 left"));
  assembly.Arrive(slot, 2, locals, absl::OkStatus(), absl::InfiniteFuture(), "", b.Callback());
  ASSERT_TRUE(b.done.HasBeenNotified());
  EXPECT_THAT(b.status.message(), HasSubstr("rank 1 left"));
}

}  // namespace
}  // namespace flatshard::server
