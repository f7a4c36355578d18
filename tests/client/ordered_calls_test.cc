#include "client/ordered_calls.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::client::internal {
namespace {

using ::testing::ElementsAre;

TEST(OrderedCallsTest, RunsJobsInSubmitOrderAndDrainWaitsForThem) {
  OrderedCalls lane;
  absl::Notification release;
  std::vector<int> order;  // written only by the lane's thread until Drain returns
  lane.Submit([&] {
    release.WaitForNotification();
    order.push_back(1);
  });
  lane.Submit([&] { order.push_back(2); });
  lane.Submit([&] { order.push_back(3); });
  EXPECT_EQ(lane.pending(), 3);
  std::atomic<bool> drained{false};
  std::thread waiter([&] {
    lane.Drain();
    drained = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(drained) << "Drain returned while the first job was still blocked";
  release.Notify();
  waiter.join();
  EXPECT_TRUE(drained);
  EXPECT_THAT(order, ElementsAre(1, 2, 3));
  EXPECT_EQ(lane.pending(), 0);
}

TEST(OrderedCallsTest, DrainKeyWaitsForTheLastJobOfItsKeyOnly) {
  OrderedCalls lane;
  absl::Notification release_first, release_second;
  std::vector<int> order;  // written only by the lane's thread until a drain covers it
  lane.Submit(
      [&] {
        release_first.WaitForNotification();
        order.push_back(1);
      },
      "a");
  lane.Submit(
      [&] {
        release_second.WaitForNotification();
        order.push_back(2);
      },
      "b");
  // No job of key "c": at once, although both jobs are blocked.
  lane.DrainKey("c");
  EXPECT_EQ(lane.pending(), 2);
  std::atomic<bool> drained_a{false};
  std::thread waiter([&] {
    lane.DrainKey("a");
    drained_a = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(drained_a) << "DrainKey returned while its job was still blocked";
  release_first.Notify();
  waiter.join();
  EXPECT_TRUE(drained_a);
  EXPECT_THAT(order, ElementsAre(1));  // "b" still blocked: DrainKey("a") did not wait for it
  EXPECT_EQ(lane.pending(), 1);
  release_second.Notify();
  lane.DrainKey("b");
  EXPECT_THAT(order, ElementsAre(1, 2));
  EXPECT_EQ(lane.pending(), 0);
  lane.DrainKey("a");  // finished keys are forgotten: at once
}

TEST(OrderedCallsTest, DrainKeyWaitsForTheJobsBeforeItsJobToo) {
  OrderedCalls lane;
  absl::Notification release;
  std::vector<int> order;
  lane.Submit([&] {
    release.WaitForNotification();
    order.push_back(1);
  });
  lane.Submit([&] { order.push_back(2); }, "k");
  lane.Submit([&] { order.push_back(3); }, "k");
  std::thread releaser([&] { release.Notify(); });
  lane.DrainKey("k");  // the last "k" job ran, and so everything before it
  releaser.join();
  EXPECT_THAT(order, ElementsAre(1, 2, 3));
  EXPECT_EQ(lane.pending(), 0);
}

TEST(OrderedCallsTest, DrainInsideAJobReturnsAtOnce) {
  OrderedCalls lane;
  absl::Notification ran;
  lane.Submit([&] {
    lane.Drain();  // would wait for itself
    ran.Notify();
  });
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  lane.Drain();
}

TEST(OrderedCallsTest, AJobThatDestroysTheLaneFinishesSafely) {
  auto lane = std::make_shared<OrderedCalls>();
  absl::Notification done;
  std::weak_ptr<OrderedCalls> weak = lane;
  lane->Submit([holder = lane, &done]() mutable {
    holder.reset();  // the last owner: the lane is destroyed on its own thread
    done.Notify();
  });
  lane.reset();
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (int i = 0; i < 100 && !weak.expired(); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(weak.expired());
}

TEST(OrderedCallsTest, AfterStopJobsRunOnTheCallersThread) {
  OrderedCalls lane;
  lane.Stop();
  std::thread::id ran_on;
  lane.Submit([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(lane.pending(), 0);
}

}  // namespace
}  // namespace flatshard::client::internal
