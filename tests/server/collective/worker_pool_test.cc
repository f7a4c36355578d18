// WorkerPool: every index exactly once, concurrent callers, no helpers.

#include "server/collective/worker_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective {
namespace {

TEST(WorkerPoolTest, CallsEveryIndexExactlyOnce) {
  for (int helpers : {0, 1, 3}) {
    WorkerPool pool(helpers);
    EXPECT_EQ(pool.num_helpers(), helpers);
    std::vector<std::atomic<int>> hits(1000);
    pool.ParallelFor(hits.size(), [&](size_t i) { hits[i].fetch_add(1); });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    pool.ParallelFor(0, [&](size_t) { FAIL(); });
  }
}

TEST(WorkerPoolTest, ConcurrentCallersAllFinish) {
  WorkerPool pool(2);
  std::atomic<int> total{0};
  ::flatshard::testing::RunRanks(6, [&](int) {
    for (int round = 0; round < 20; ++round) {
      pool.ParallelFor(50, [&](size_t) { total.fetch_add(1); });
    }
  });
  EXPECT_EQ(total.load(), 6 * 20 * 50);
}

}  // namespace
}  // namespace flatshard::collective
