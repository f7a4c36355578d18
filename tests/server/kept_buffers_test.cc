// KeptBuffers / KeptBufferPool: reuse while unused, fresh while in use, idle decommit read
// against a FakeClock, RESOURCE_EXHAUSTED retried after decommitting idle buffers.

#include "server/kept_buffers.h"

#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

constexpr int64_t kBytes = 64 << 10;

class KeptBuffersTest : public ::testing::Test {
 protected:
  explicit KeptBuffersTest(int64_t limit = std::numeric_limits<int64_t>::max())
      : store_(ShardStoreOptions{.segment_prefix = absl::StrCat("fskbt", getpid()),
                                 .memory_limit_bytes = limit,
                                 .pin_host_memory = false}),
        pool_(KeptBufferPool::Create(&store_, &clock_)) {}

  absl::StatusOr<std::shared_ptr<Buffer>> Get(KeptBuffers& set, const KeptKey& key,
                                              Placement placement = Placement::Host()) {
    return set.Get(key, BufferKind::kUnsharded, kBytes, "test", -1, placement);
  }

  FakeClock clock_;
  ShardStore store_;
  std::shared_ptr<KeptBufferPool> pool_;
};

TEST_F(KeptBuffersTest, ReusesABufferNobodyHolds) {
  auto set = pool_->NewSet();
  const KeptKey key = KeptKey::Rank(1, 3, KeptUse::kParams);
  Buffer* first = nullptr;
  {
    auto b = Get(*set, key);
    ASSERT_TRUE(b.ok()) << b.status();
    first = b->get();
  }
  auto again = Get(*set, key);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), first) << "an unused kept buffer is handed out again";
  EXPECT_EQ(set->size(), 1);
  EXPECT_EQ(store_.Usage().buffers, 1);
}

TEST_F(KeptBuffersTest, TryGetHandsOutOnlyWhatNeedsNoSyscall) {
  auto set = pool_->NewSet();
  const KeptKey key = KeptKey::Rank(0, 4, KeptUse::kParams);
  EXPECT_EQ(set->TryGet(key, Placement::Host()), nullptr) << "nothing kept yet";
  EXPECT_EQ(store_.Usage().buffers, 0) << "TryGet never allocates";
  Buffer* kept = Get(*set, key)->get();
  std::shared_ptr<Buffer> b = set->TryGet(key, Placement::Host());
  EXPECT_EQ(b.get(), kept);
  EXPECT_EQ(set->TryGet(key, Placement::Host()), nullptr) << "in use";
  EXPECT_EQ(set->TryGet(key, Placement::Pinned()), nullptr) << "another placement";
  b.reset();
  set->Release();
  clock_.Advance(KeptBufferPool::kIdleRelease);
  ASSERT_EQ(pool_->DecommitIdle(clock_.Now()), 1);
  EXPECT_EQ(set->TryGet(key, Placement::Host()), nullptr) << "decommitted: Commit is a syscall";
  EXPECT_FALSE(kept->committed());
  EXPECT_EQ(Get(*set, key)->get(), kept);
}

TEST_F(KeptBuffersTest, KeysOfDifferentOwnersAndUsesNeverShare) {
  auto set = pool_->NewSet();
  const std::vector<KeptKey> keys = {
      KeptKey::Rank(0, 0, KeptUse::kParams),       KeptKey::Rank(0, 0, KeptUse::kGrads),
      KeptKey::Rank(0, 0, KeptUse::kGradInput),    KeptKey::Rank(1, 0, KeptUse::kParams),
      KeptKey::Rank(0, 1, KeptUse::kParams),       KeptKey::NodeShared(0, KeptUse::kParams),
      KeptKey::NodeRank0Copy(0, KeptUse::kParams), KeptKey::RankRank0Copy(0, 0, KeptUse::kParams),
  };
  std::vector<Buffer*> seen;
  for (const KeptKey& key : keys) {
    auto b = Get(*set, key);  // dropped at once: each key's own buffer is unused afterwards
    ASSERT_TRUE(b.ok());
    EXPECT_THAT(seen, ::testing::Not(::testing::Contains(b->get())));
    seen.push_back(b->get());
  }
  EXPECT_EQ(set->size(), static_cast<int>(keys.size()));
}

TEST_F(KeptBuffersTest, HandsOutAFreshBufferWhileTheKeptOnesAreInUse) {
  auto set = pool_->NewSet();
  const KeptKey key = KeptKey::NodeShared(2, KeptUse::kParams);
  // Every kept copy in use, each a buffer of its own; then one more: fresh, not kept.
  std::vector<std::shared_ptr<Buffer>> kept;
  for (int i = 0; i < KeptBuffers::kCopies; ++i) {
    auto b = Get(*set, key);
    ASSERT_TRUE(b.ok());
    for (const auto& k : kept) EXPECT_NE(k.get(), b->get());
    kept.push_back(*b);
  }
  auto extra = Get(*set, key);
  ASSERT_TRUE(extra.ok());
  for (const auto& k : kept) EXPECT_NE(k.get(), extra->get());
  EXPECT_EQ(set->size(), KeptBuffers::kCopies);
  extra->reset();
  EXPECT_EQ(store_.Usage().buffers, KeptBuffers::kCopies)
      << "the unkept buffer went with its last user";
  // A copy its user gave back is handed out again, whichever it is.
  Buffer* const first = kept[0].get();
  Buffer* const last = kept.back().get();
  kept[0].reset();
  auto again = Get(*set, key);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), first);
  kept.back().reset();
  auto again2 = Get(*set, key);
  ASSERT_TRUE(again2.ok());
  EXPECT_EQ(again2->get(), last);
}

TEST_F(KeptBuffersTest, IdleBuffersAreDecommittedAfterTheReleaseDelay) {
  auto set = pool_->NewSet();
  const KeptKey key = KeptKey::Rank(0, 0, KeptUse::kGradInput);
  std::shared_ptr<Buffer> b = *Get(*set, key);
  Buffer* const kept = b.get();
  set->Release();  // still held: not idle
  clock_.Advance(absl::Hours(1));
  EXPECT_EQ(pool_->DecommitIdle(clock_.Now()), 0);
  EXPECT_EQ(pool_->DecommitIdle(absl::InfiniteFuture()), 0) << "a held buffer is never decommitted";
  EXPECT_TRUE(kept->committed());

  b.reset();
  set->Release();  // idle from now
  clock_.Advance(KeptBufferPool::kIdleRelease - absl::Milliseconds(1));
  EXPECT_EQ(pool_->DecommitIdle(clock_.Now()), 0);
  EXPECT_TRUE(kept->committed());
  EXPECT_EQ(store_.Usage().bytes(BufferKind::kUnsharded), kBytes);
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(pool_->DecommitIdle(clock_.Now()), 1);
  EXPECT_FALSE(kept->committed());
  EXPECT_EQ(store_.Usage().bytes(BufferKind::kUnsharded), 0);
  EXPECT_EQ(store_.Usage().buffers, 1) << "decommitted, not freed: clients keep their mapping";

  // The next use commits it again (same buffer, same segment).
  std::shared_ptr<Buffer> again = *Get(*set, key);
  EXPECT_EQ(again.get(), kept);
  EXPECT_TRUE(kept->committed());
  // In use again: Release does not make it idle, however long it is held.
  set->Release();
  clock_.Advance(absl::Hours(1));
  EXPECT_EQ(pool_->DecommitIdle(clock_.Now()), 0);
}

TEST_F(KeptBuffersTest, ABufferOfAnotherPlacementIsReplaced) {
  auto set = pool_->NewSet();
  const KeptKey key = KeptKey::Rank(0, 0, KeptUse::kParams);
  std::weak_ptr<Buffer> host = *Get(*set, key);
  ASSERT_FALSE(host.expired()) << "kept";
  std::shared_ptr<Buffer> pinned = *Get(*set, key, Placement::Pinned());
  EXPECT_EQ(pinned->placement(), Placement::Pinned());
  EXPECT_TRUE(host.expired()) << "the host buffer nobody held went";
  EXPECT_EQ(set->size(), 1);
  EXPECT_EQ(store_.Usage().buffers, 1);
  pinned.reset();
  // Back to host: the pinned one (unused) goes the same way, the host one comes fresh.
  std::shared_ptr<Buffer> again = *Get(*set, key);
  EXPECT_EQ(again->placement(), Placement::Host());
  EXPECT_EQ(store_.Usage().buffers, 1);
}

TEST_F(KeptBuffersTest, TakeAllEmptiesTheCache) {
  auto set = pool_->NewSet();
  std::shared_ptr<Buffer> held = *Get(*set, KeptKey::Rank(0, 0, KeptUse::kParams));
  (void)*Get(*set, KeptKey::Rank(0, 1, KeptUse::kParams));
  std::vector<std::shared_ptr<Buffer>> taken = set->TakeAll();
  EXPECT_EQ(taken.size(), 2u);
  EXPECT_EQ(set->size(), 0);
  taken.clear();
  EXPECT_EQ(store_.Usage().buffers, 1) << "only the held one is left";
}

class KeptBuffersLimitTest : public KeptBuffersTest {
 protected:
  KeptBuffersLimitTest() : KeptBuffersTest(2 * kBytes) {}
};

TEST_F(KeptBuffersLimitTest, ResourceExhaustedIsRetriedAfterDecommittingIdleBuffers) {
  // Another module's idle buffer holds half the limit; its idle delay has not passed.
  auto other = pool_->NewSet();
  Buffer* idle = Get(*other, KeptKey::Rank(0, 0, KeptUse::kParams))->get();
  other->Release();
  auto set = pool_->NewSet();
  std::shared_ptr<Buffer> held = *Get(*set, KeptKey::Rank(0, 0, KeptUse::kParams));
  ASSERT_TRUE(idle->committed());
  // A third buffer exceeds the limit until the idle one gives its pages back.
  absl::StatusOr<std::shared_ptr<Buffer>> third = Get(*set, KeptKey::Rank(1, 0, KeptUse::kParams));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_FALSE(idle->committed());

  // Re-committing the decommitted one now fails: everything else is in use, nothing to free.
  absl::StatusOr<std::shared_ptr<Buffer>> again =
      Get(*other, KeptKey::Rank(0, 0, KeptUse::kParams));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();
  // Once one is idle, the retry after decommitting it succeeds.
  third->reset();
  set->Release();
  again = Get(*other, KeptKey::Rank(0, 0, KeptUse::kParams));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->get(), idle);
  EXPECT_TRUE(idle->committed());
}

TEST_F(KeptBuffersTest, ConcurrentGetsNeverShareABuffer) {
  auto set = pool_->NewSet();
  const KeptKey key = KeptKey::NodeShared(0, KeptUse::kParams);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::shared_ptr<Buffer>> got(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        auto b = Get(*set, key);
        ASSERT_TRUE(b.ok()) << b.status();
        got[t] = *b;
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < 4; ++i) {
      for (int j = i + 1; j < 4; ++j) ASSERT_NE(got[i].get(), got[j].get()) << "round " << round;
    }
    EXPECT_EQ(set->size(), KeptBuffers::kCopies);
  }
}

TEST(KeptBufferPoolTest, ACacheLeavesThePoolWithItsLastReference) {
  FakeClock clock;
  ShardStore store(ShardStoreOptions{.segment_prefix = absl::StrCat("fskbp", getpid())});
  auto pool = KeptBufferPool::Create(&store, &clock);
  {
    auto set = pool->NewSet();
    (void)*set->Get(KeptKey::Rank(0, 0, KeptUse::kParams), BufferKind::kUnsharded, 4096, "x", -1,
                    Placement::Host());
    EXPECT_EQ(store.Usage().buffers, 1);
  }
  EXPECT_EQ(store.Usage().buffers, 0);
  EXPECT_EQ(pool->DecommitIdle(absl::InfiniteFuture()), 0);
}

}  // namespace
}  // namespace flatshard::server
