// ScratchPool: reuse, the bound on idle bytes, and the idle release on the timer.

#include "server/collective/scratch_pool.h"

#include <memory>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace flatshard::collective {
namespace {

TEST(ScratchPoolTest, AReleasedBufferIsReusedByTheNextAcquireThatFits) {
  auto pool = ScratchPool::Create(nullptr);
  uint8_t* first = nullptr;
  {
    ScratchPool::Scratch s = pool->Acquire(1000);
    ASSERT_NE(s.data(), nullptr);
    EXPECT_EQ(s.bytes(), 1000u);
    first = s.data();
  }
  EXPECT_EQ(pool->idle_bytes(), 1000u);
  ScratchPool::Scratch again = pool->Acquire(600);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(again.bytes(), 1000u);
  EXPECT_EQ(pool->idle_bytes(), 0u);
  ScratchPool::Scratch bigger = pool->Acquire(2000);  // nothing idle fits: a new one
  EXPECT_NE(bigger.data(), first);
}

TEST(ScratchPoolTest, TheSmallestIdleBufferThatFitsIsTaken) {
  auto pool = ScratchPool::Create(nullptr);
  uint8_t* small = nullptr;
  {
    ScratchPool::Scratch a = pool->Acquire(4000);
    ScratchPool::Scratch b = pool->Acquire(1000);
    small = b.data();
  }
  EXPECT_EQ(pool->Acquire(900).data(), small);
}

TEST(ScratchPoolTest, IdleBytesStayWithinTheBound) {
  auto pool = ScratchPool::Create(nullptr, /*keep_bytes=*/3000);
  {
    ScratchPool::Scratch a = pool->Acquire(2000);
    ScratchPool::Scratch b = pool->Acquire(2000);
    ScratchPool::Scratch huge = pool->Acquire(5000);  // never kept: over the bound alone
  }
  EXPECT_EQ(pool->idle_bytes(), 2000u);
}

TEST(ScratchPoolTest, AHandleThatOutlivesThePoolFreesItsBuffer) {
  auto pool = ScratchPool::Create(nullptr);
  ScratchPool::Scratch s = pool->Acquire(100);
  pool.reset();
  s = ScratchPool::Scratch();  // no pool to return to: freed (ASan would see a leak)
  EXPECT_EQ(s.data(), nullptr);
}

TEST(ScratchPoolTest, IdleBuffersAreFreedOnTheTimer) {
  auto timer = std::make_shared<DeadlineTimer>();
  auto pool = ScratchPool::Create(timer, ScratchPool::kDefaultKeepBytes, absl::ZeroDuration());
  { ScratchPool::Scratch s = pool->Acquire(100); }
  // The release runs on the timer's thread; wait for it with a generous deadline.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (pool->idle_bytes() != 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(pool->idle_bytes(), 0u);
}

}  // namespace
}  // namespace flatshard::collective
