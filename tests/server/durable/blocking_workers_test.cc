// BlockingWorkers: jobs of one strand run one at a time and in order, strands run in parallel,
// the destructor runs what is still queued.
#include "server/durable/blocking_workers.h"

#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

TEST(BlockingWorkersTest, JobsOfOneStrandRunOneAtATimeInOrder) {
  absl::Mutex mu;
  std::vector<int> order;
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  absl::Notification all_done;
  {
    BlockingWorkers workers(4);
    for (int i = 0; i < 20; ++i) {
      workers.Post("g", [&, i] {
        const int now = ++inside;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        absl::SleepFor(absl::Milliseconds(1));
        {
          absl::MutexLock lock(&mu);
          order.push_back(i);
        }
        --inside;
        if (i == 19) all_done.Notify();
      });
    }
    ASSERT_TRUE(all_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
  EXPECT_EQ(most.load(), 1) << "two jobs of one strand ran at once";
  std::vector<int> want;
  for (int i = 0; i < 20; ++i) want.push_back(i);
  EXPECT_EQ(order, want);
}

TEST(BlockingWorkersTest, StrandsRunInParallel) {
  BlockingWorkers workers(2);
  absl::Notification a_started, b_started;
  std::atomic<bool> a_saw_b{false}, b_saw_a{false};
  absl::Notification a_done, b_done;
  // Each waits (bounded) for the other to start: only parallel strands see each other.
  workers.Post("a", [&] {
    a_started.Notify();
    a_saw_b = b_started.WaitForNotificationWithTimeout(absl::Seconds(10));
    a_done.Notify();
  });
  workers.Post("b", [&] {
    b_started.Notify();
    b_saw_a = a_started.WaitForNotificationWithTimeout(absl::Seconds(10));
    b_done.Notify();
  });
  ASSERT_TRUE(a_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(b_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(a_saw_b.load());
  EXPECT_TRUE(b_saw_a.load());
}

TEST(BlockingWorkersTest, ABusyStrandDoesNotHoldBackAnother) {
  BlockingWorkers workers(2);
  absl::Notification release_a, b_ran;
  workers.Post("a", [&] { release_a.WaitForNotificationWithTimeout(absl::Seconds(10)); });
  workers.Post("a", [] {});  // queued behind the first, on its strand
  workers.Post("b", [&] { b_ran.Notify(); });
  EXPECT_TRUE(b_ran.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "a job of another strand waited behind strand a";
  release_a.Notify();
}

TEST(BlockingWorkersTest, DestructorRunsEveryQueuedJob) {
  std::atomic<int> ran{0};
  {
    BlockingWorkers workers(1);
    for (int i = 0; i < 50; ++i) workers.Post(i % 2 == 0 ? "x" : "y", [&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 50);
}

}  // namespace
}  // namespace flatshard::server
