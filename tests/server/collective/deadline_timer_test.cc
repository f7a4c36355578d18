// DeadlineTimer: ordering, cancellation, callbacks that schedule, destruction. Tests hold the
// timer thread in a "gate" callback while they set up, so no result depends on scheduling
// latency.

#include "server/collective/deadline_timer.h"

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::collective {
namespace {

// Occupies the timer thread until Open().
class Gate {
 public:
  explicit Gate(DeadlineTimer& timer) {
    timer.Schedule(absl::Now(), [this] {
      entered_.Notify();
      open_.WaitForNotification();
    });
    entered_.WaitForNotification();
  }
  void Open() { open_.Notify(); }

 private:
  absl::Notification entered_, open_;
};

TEST(DeadlineTimerTest, RunsCallbacksInDeadlineOrder) {
  DeadlineTimer timer;
  Gate gate(timer);
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification last;
  const absl::Time now = absl::Now();
  timer.Schedule(now + absl::Milliseconds(2), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(3);
    last.Notify();
  });
  timer.Schedule(now + absl::Milliseconds(1), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(1);
  });
  timer.Schedule(now - absl::Seconds(1), [&] {  // already due
    absl::MutexLock lock(&mu);
    order.push_back(0);
  });
  EXPECT_EQ(timer.pending(), 3u);
  gate.Open();
  ASSERT_TRUE(last.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  EXPECT_THAT(order, ::testing::ElementsAre(0, 1, 3));
}

TEST(DeadlineTimerTest, WaitsUntilTheDeadline) {
  DeadlineTimer timer;
  absl::Notification ran;
  const absl::Time when = absl::Now() + absl::Milliseconds(20);
  timer.Schedule(when, [&] { ran.Notify(); });
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(absl::Now(), when);
}

TEST(DeadlineTimerTest, CancelledCallbacksNeverRun) {
  DeadlineTimer timer;
  Gate gate(timer);
  bool ran = false;
  auto id = timer.Schedule(absl::Now(), [&] { ran = true; });  // due, but the thread is held
  EXPECT_TRUE(timer.Cancel(id));
  EXPECT_FALSE(timer.Cancel(id));
  EXPECT_FALSE(timer.Cancel(DeadlineTimer::kNoTimer));
  absl::Notification after;
  timer.Schedule(absl::Now(), [&] { after.Notify(); });
  gate.Open();
  ASSERT_TRUE(after.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(ran);
}

TEST(DeadlineTimerTest, InfiniteFutureIsNeverScheduled) {
  DeadlineTimer timer;
  EXPECT_EQ(timer.Schedule(absl::InfiniteFuture(), [] {}), DeadlineTimer::kNoTimer);
  EXPECT_EQ(timer.pending(), 0u);
}

TEST(DeadlineTimerTest, CallbacksMayScheduleAndCancel) {
  DeadlineTimer timer;
  absl::Notification inner;
  timer.Schedule(absl::Now(), [&] {
    auto id = timer.Schedule(absl::Now() + absl::Hours(1), [] {});
    EXPECT_TRUE(timer.Cancel(id));
    timer.Schedule(absl::Now(), [&] { inner.Notify(); });
  });
  EXPECT_TRUE(inner.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(DeadlineTimerTest, DestructionDropsPendingCallbacks) {
  auto token = std::make_shared<int>(0);
  bool ran = false;
  {
    DeadlineTimer timer;
    timer.Schedule(absl::Now() + absl::Hours(1), [&ran, token] { ran = true; });
    EXPECT_EQ(token.use_count(), 2);
  }
  EXPECT_EQ(token.use_count(), 1);  // the callback (and its captures) is gone
  EXPECT_FALSE(ran);
}

TEST(DeadlineTimerTest, MayBeDestroyedFromItsOwnCallback) {
  auto timer = std::make_shared<DeadlineTimer>();
  absl::Notification done;
  DeadlineTimer* raw = timer.get();
  raw->Schedule(absl::Now(), [&timer, &done] {
    timer.reset();  // the last owner goes away on the timer thread
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

}  // namespace
}  // namespace flatshard::collective
