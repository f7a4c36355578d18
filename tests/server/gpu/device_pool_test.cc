// DevicePool over a fake SlabAllocator backed by host memory: reuse across alloc/free cycles,
// coalescing, dedicated big slabs, the limit (refusal changes nothing), trim, zero-fill,
// blocks outliving the pool, accounting, and concurrent use.

#include "server/gpu/device_pool.h"

#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/gpu/device_context.h"

namespace flatshard::gpu {
namespace {

using ::testing::HasSubstr;

// Slabs are host memory filled with 0xab (so zero-fill is visible); counts every call.
class FakeSlabAllocator : public SlabAllocator {
 public:
  struct Counters {
    absl::Mutex mu;
    int allocs = 0;
    int frees = 0;
    int zeros = 0;
    int64_t live_bytes = 0;
    bool fail_next_alloc = false;  // with RESOURCE_EXHAUSTED, as cudaMalloc would
    bool fail_zero = false;
    int64_t device_bytes = -1;  // allocations beyond this fail (out of device memory)
  };

  explicit FakeSlabAllocator(std::shared_ptr<Counters> c) : c_(std::move(c)) {}

  absl::StatusOr<Slab> Allocate(size_t bytes) override {
    absl::MutexLock lock(&c_->mu);
    if (c_->fail_next_alloc || (c_->device_bytes >= 0 &&
                                c_->live_bytes + static_cast<int64_t>(bytes) > c_->device_bytes)) {
      c_->fail_next_alloc = false;
      return absl::ResourceExhaustedError("fake cudaMalloc: out of memory");
    }
    ++c_->allocs;
    c_->live_bytes += static_cast<int64_t>(bytes);
    Slab s;
    s.base = new uint8_t[bytes];
    std::memset(s.base, 0xab, bytes);
    s.bytes = bytes;
    s.ipc_handle = std::string(kIpcHandleBytes, static_cast<char>(c_->allocs));
    return s;
  }
  void Free(const Slab& slab) override {
    absl::MutexLock lock(&c_->mu);
    ++c_->frees;
    c_->live_bytes -= static_cast<int64_t>(slab.bytes);
    delete[] static_cast<uint8_t*>(slab.base);
  }
  absl::Status Zero(void* p, size_t bytes) override {
    absl::MutexLock lock(&c_->mu);
    ++c_->zeros;
    if (c_->fail_zero) return absl::InternalError("fake memset failed");
    std::memset(p, 0, bytes);
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<Counters> c_;
};

class DevicePoolTest : public ::testing::Test {
 protected:
  std::shared_ptr<DevicePool> MakePool(DevicePoolOptions o) {
    o.device = 3;
    o.device_uuid = "GPU-test";
    return DevicePool::Create(std::move(o), std::make_unique<FakeSlabAllocator>(counters_));
  }
  DevicePoolOptions Small(int64_t limit = std::numeric_limits<int64_t>::max()) {
    DevicePoolOptions o;
    o.slab_bytes = 64 << 10;
    o.alignment = 512;
    o.limit_bytes = limit;
    return o;
  }
  int allocs() {
    absl::MutexLock lock(&counters_->mu);
    return counters_->allocs;
  }
  int frees() {
    absl::MutexLock lock(&counters_->mu);
    return counters_->frees;
  }
  int64_t live_bytes() {
    absl::MutexLock lock(&counters_->mu);
    return counters_->live_bytes;
  }

  std::shared_ptr<FakeSlabAllocator::Counters> counters_ =
      std::make_shared<FakeSlabAllocator::Counters>();
};

bool AllZero(const std::shared_ptr<DeviceBlock>& b) {
  const auto* p = static_cast<const uint8_t*>(b->data());
  for (size_t i = 0; i < b->bytes(); ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

TEST_F(DevicePoolTest, BlocksAreZeroFilledAlignedAndDescribeTheirSlab) {
  auto pool = MakePool(Small());
  auto a = pool->Allocate(1000, "unit 1 shard");
  auto b = pool->Allocate(100, "unit 2 shard");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(AllZero(*a));
  EXPECT_TRUE(AllZero(*b));
  EXPECT_EQ((*a)->bytes(), 1000u);
  EXPECT_EQ((*a)->device(), 3);
  EXPECT_EQ((*a)->device_uuid(), "GPU-test");
  EXPECT_EQ((*a)->label(), "unit 1 shard");
  EXPECT_EQ((*a)->slab_id(), (*b)->slab_id());  // one slab serves both
  EXPECT_EQ((*a)->slab_bytes(), size_t{64} << 10);
  EXPECT_EQ((*a)->ipc_handle().size(), kIpcHandleBytes);
  EXPECT_EQ((*a)->ipc_handle(), (*b)->ipc_handle());
  EXPECT_EQ((*a)->offset() % 512, 0u);
  EXPECT_EQ((*b)->offset() % 512, 0u);
  // The blocks' reserved ranges (1000 rounds up to 1024, 100 to 512) do not overlap.
  const size_t a_off = (*a)->offset(), b_off = (*b)->offset();
  EXPECT_TRUE(a_off + 1024 <= b_off || b_off + 512 <= a_off) << a_off << " " << b_off;
  EXPECT_EQ(static_cast<uint8_t*>((*b)->data()) - static_cast<uint8_t*>((*a)->data()),
            static_cast<ptrdiff_t>(b_off) - static_cast<ptrdiff_t>(a_off));
  EXPECT_EQ(allocs(), 1);
}

TEST_F(DevicePoolTest, ReusedMemoryIsZeroFilledAgain) {
  auto pool = MakePool(Small());
  void* first = nullptr;
  {
    auto a = pool->Allocate(4096, "a");
    ASSERT_TRUE(a.ok());
    std::memset((*a)->data(), 0x5a, 4096);
    first = (*a)->data();
  }
  auto again = pool->Allocate(4096, "again");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->data(), first);
  EXPECT_TRUE(AllZero(*again));
}

TEST_F(DevicePoolTest, UnshardReshardLoopReusesSlabsWithoutNewAllocations) {
  auto pool = MakePool(Small());
  std::set<uint64_t> slab_ids;
  for (int step = 0; step < 100; ++step) {
    // Every step: three unsharded buffers (one above slab_bytes) and a gradient, then freed.
    std::vector<std::shared_ptr<DeviceBlock>> live;
    for (size_t bytes : {size_t{20000}, size_t{30000}, size_t{200000}, size_t{10000}}) {
      auto b = pool->Allocate(bytes, "unsharded");
      ASSERT_TRUE(b.ok()) << b.status();
      slab_ids.insert((*b)->slab_id());
      live.push_back(*std::move(b));
    }
  }
  // Step 1 made one standard slab and one dedicated slab; every later step reused them, so a
  // trainer's cached IPC mappings stay valid.
  EXPECT_EQ(allocs(), 2);
  EXPECT_EQ(frees(), 0);
  EXPECT_EQ(slab_ids.size(), 2u);
  DevicePoolUsage u = pool->Usage();
  EXPECT_EQ(u.slabs, 2);
  EXPECT_EQ(u.blocks, 0);
  EXPECT_EQ(u.in_use_bytes, 0);
  EXPECT_EQ(u.reserved_bytes, (64 << 10) + 200192);  // 200000 rounded up to 512
}

TEST_F(DevicePoolTest, FreedNeighboursCoalesceIntoOneRange) {
  auto pool = MakePool(Small());  // 64 KiB slabs
  std::vector<std::shared_ptr<DeviceBlock>> quarters;
  for (int i = 0; i < 4; ++i) {
    auto b = pool->Allocate(16 << 10, "quarter");
    ASSERT_TRUE(b.ok());
    quarters.push_back(*std::move(b));
  }
  ASSERT_EQ(allocs(), 1);
  // Free the middle two in either order, then the ends: a 64 KiB block fits only if all four
  // ranges merged back into one.
  quarters[2].reset();
  quarters[1].reset();
  auto half = pool->Allocate(32 << 10, "half");
  ASSERT_TRUE(half.ok());
  EXPECT_EQ((*half)->offset(), size_t{16} << 10);  // the merged middle
  EXPECT_EQ(allocs(), 1);
  half->reset();
  quarters[0].reset();
  quarters[3].reset();
  auto whole = pool->Allocate(64 << 10, "whole");
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ((*whole)->offset(), 0u);
  EXPECT_EQ(allocs(), 1);
}

TEST_F(DevicePoolTest, RequestsAboveSlabBytesGetADedicatedSlab) {
  auto pool = MakePool(Small());
  auto small = pool->Allocate(100, "small");
  auto big = pool->Allocate(100000, "big");
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE(big.ok());
  EXPECT_NE((*small)->slab_id(), (*big)->slab_id());
  EXPECT_EQ((*big)->slab_bytes(), 100352u);  // the request rounded to the alignment
  EXPECT_EQ((*big)->offset(), 0u);
  EXPECT_EQ(allocs(), 2);
  // Small requests keep using the standard slab while it has room (best fit).
  auto small2 = pool->Allocate(100, "small2");
  ASSERT_TRUE(small2.ok());
  EXPECT_EQ((*small2)->slab_id(), (*small)->slab_id());
}

TEST_F(DevicePoolTest, SlabIdsAreUniqueAcrossPoolsAndNeverReused) {
  auto pool1 = MakePool(Small());
  auto pool2 = MakePool(Small());
  auto a = pool1->Allocate(100, "a");
  auto b = pool2->Allocate(100, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  const uint64_t first = (*a)->slab_id();
  EXPECT_NE(first, (*b)->slab_id());
  a->reset();
  EXPECT_EQ(pool1->Trim(), 64 << 10);
  auto c = pool1->Allocate(100, "c");
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*c)->slab_id(), first);
  EXPECT_NE((*c)->slab_id(), (*b)->slab_id());
}

TEST_F(DevicePoolTest, LimitRefusalNamesEverythingAndChangesNothing) {
  auto pool = MakePool(Small(/*limit=*/100 << 10));
  auto a = pool->Allocate(60 << 10, "unit 1 unsharded");  // one 64 KiB slab
  ASSERT_TRUE(a.ok());
  const DevicePoolUsage before = pool->Usage();
  auto refused = pool->Allocate(40 << 10, "unit 2 unsharded");  // needs a 2nd slab: > 100 KiB
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  const std::string msg(refused.status().message());
  EXPECT_THAT(msg, HasSubstr("device 3 (GPU-test)"));
  EXPECT_THAT(msg, HasSubstr("'unit 2 unsharded'"));
  EXPECT_THAT(msg, HasSubstr("40960 bytes"));
  EXPECT_THAT(msg, HasSubstr("reserved 65536"));
  EXPECT_THAT(msg, HasSubstr("in use 61440"));
  EXPECT_THAT(msg, HasSubstr("limit 102400"));
  const DevicePoolUsage after = pool->Usage();
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(after.slabs, before.slabs);
  EXPECT_EQ(after.blocks, before.blocks);
  EXPECT_EQ(allocs(), 1);
  EXPECT_EQ(frees(), 0);
  // The existing slab still serves what fits.
  auto fits = pool->Allocate(4 << 10, "fits");
  EXPECT_TRUE(fits.ok()) << fits.status();
}

TEST_F(DevicePoolTest, NearTheLimitASlabOfJustTheRequestIsReserved) {
  auto pool = MakePool(Small(/*limit=*/80 << 10));
  auto a = pool->Allocate(60 << 10, "a");  // standard 64 KiB slab
  ASSERT_TRUE(a.ok());
  auto b = pool->Allocate(10 << 10, "b");  // fits in the slab's remaining 4 KiB? no: new slab
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->slab_bytes(), size_t{10} << 10);  // 64 KiB would pass the 80 KiB limit
  EXPECT_EQ(pool->Usage().reserved_bytes, 74 << 10);
}

TEST_F(DevicePoolTest, LimitPressureFreesEmptySlabsFirst) {
  auto pool = MakePool(Small(/*limit=*/128 << 10));
  {
    auto a = pool->Allocate(64 << 10, "a");
    auto b = pool->Allocate(64 << 10, "b");
    ASSERT_TRUE(a.ok() && b.ok());
  }
  EXPECT_EQ(pool->Usage().slabs, 2);            // empty, kept for reuse
  auto big = pool->Allocate(100 << 10, "big");  // dedicated: needs both empty slabs' room
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(frees(), 2);
  DevicePoolUsage u = pool->Usage();
  EXPECT_EQ(u.slabs, 1);
  EXPECT_EQ(u.reserved_bytes, 100 << 10);
  EXPECT_LE(live_bytes(), 128 << 10);
}

TEST_F(DevicePoolTest, OutOfDeviceMemoryFreesEmptySlabsAndRetriesOnce) {
  counters_->device_bytes = 128 << 10;  // the device, not the pool's limit
  auto pool = MakePool(Small());
  {
    auto a = pool->Allocate(64 << 10, "a");
    auto b = pool->Allocate(64 << 10, "b");
    ASSERT_TRUE(a.ok() && b.ok());
  }
  auto big = pool->Allocate(100 << 10, "big");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(pool->Usage().slabs, 1);
  // With nothing left to free, cudaMalloc's failure is returned and nothing changes.
  const DevicePoolUsage before = pool->Usage();
  auto more = pool->Allocate(100 << 10, "more");
  ASSERT_FALSE(more.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(more.status())) << more.status();
  EXPECT_THAT(std::string(more.status().message()), HasSubstr("fake cudaMalloc: out of memory"));
  EXPECT_THAT(std::string(more.status().message()), HasSubstr("'more'"));
  EXPECT_EQ(pool->Usage().reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(pool->Usage().blocks, before.blocks);
}

TEST_F(DevicePoolTest, TrimFreesOnlySlabsWithoutLiveBlocks) {
  auto pool = MakePool(Small());
  auto keep = pool->Allocate(100, "keep");
  auto drop = pool->Allocate(100000, "drop");  // dedicated slab
  ASSERT_TRUE(keep.ok() && drop.ok());
  drop->reset();
  EXPECT_EQ(pool->Trim(), 100352);
  EXPECT_EQ(frees(), 1);
  EXPECT_EQ(pool->Trim(), 0);
  DevicePoolUsage u = pool->Usage();
  EXPECT_EQ(u.slabs, 1);
  EXPECT_EQ(u.reserved_bytes, 64 << 10);
  EXPECT_EQ(u.in_use_bytes, 100);
}

TEST_F(DevicePoolTest, FailedZeroFillReturnsTheBlock) {
  auto pool = MakePool(Small());
  counters_->fail_zero = true;
  auto b = pool->Allocate(100, "b");
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("fake memset failed"));
  DevicePoolUsage u = pool->Usage();
  EXPECT_EQ(u.blocks, 0);
  EXPECT_EQ(u.in_use_bytes, 0);
}

TEST_F(DevicePoolTest, ZeroByteBlocksHaveNoSlab) {
  auto pool = MakePool(Small());
  auto b = pool->Allocate(0, "empty");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->data(), nullptr);
  EXPECT_EQ((*b)->bytes(), 0u);
  EXPECT_EQ((*b)->slab_id(), 0u);
  EXPECT_TRUE((*b)->ipc_handle().empty());
  EXPECT_EQ(pool->Usage().blocks, 1);
  EXPECT_EQ(pool->Usage().slabs, 0);
  EXPECT_EQ(allocs(), 0);
  b->reset();
  EXPECT_EQ(pool->Usage().blocks, 0);
}

TEST_F(DevicePoolTest, BlocksOutliveThePoolAndFreeTheirSlabsLast) {
  auto pool = MakePool(Small());
  auto a = pool->Allocate(100, "a");
  auto b = pool->Allocate(200, "b");
  auto c = pool->Allocate(100000, "c");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  { auto empty = pool->Allocate(100000, "freed before the pool"); }
  std::shared_ptr<DeviceBlock> ba = *a, bb = *b, bc = *c;
  a->reset();
  b->reset();
  c->reset();
  pool.reset();  // frees the empty dedicated slab only
  EXPECT_EQ(frees(), 1);
  EXPECT_EQ(bb->label(), "b");  // still readable and writable
  std::memset(bb->data(), 1, bb->bytes());
  bc.reset();  // its slab has no block left: freed now
  EXPECT_EQ(frees(), 2);
  ba.reset();
  EXPECT_EQ(frees(), 2);  // the standard slab still holds `b`
  bb.reset();
  EXPECT_EQ(frees(), 3);
  EXPECT_EQ(live_bytes(), 0);
}

TEST_F(DevicePoolTest, UsageAccountsRequestedBytesAndDebugStringShowsIt) {
  auto pool = MakePool(Small(1 << 20));
  auto a = pool->Allocate(1000, "a");
  auto b = pool->Allocate(3000, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  DevicePoolUsage u = pool->Usage();
  EXPECT_EQ(u.in_use_bytes, 4000);
  EXPECT_EQ(u.reserved_bytes, 64 << 10);
  EXPECT_EQ(u.limit_bytes, 1 << 20);
  EXPECT_EQ(u.slabs, 1);
  EXPECT_EQ(u.blocks, 2);
  EXPECT_EQ(u.DebugString(), "reserved=65536 in_use=4000 limit=1048576 slabs=1 blocks=2");
  EXPECT_EQ(pool->device(), 3);
  EXPECT_EQ(pool->device_uuid(), "GPU-test");
}

TEST_F(DevicePoolTest, ConcurrentAllocationsNeverOverlapAndRespectTheLimit) {
  auto pool = MakePool(Small(/*limit=*/512 << 10));
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  absl::Mutex mu;
  int refused = 0;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = 512 + static_cast<size_t>((i * 7919 + t * 104729) % 90000);
        auto b = pool->Allocate(bytes, "stress");
        if (!b.ok()) {
          EXPECT_TRUE(absl::IsResourceExhausted(b.status())) << b.status();
          absl::MutexLock lock(&mu);
          ++refused;
          continue;
        }
        // Stamp the block and check nobody else wrote into it.
        auto* p = static_cast<uint8_t*>((*b)->data());
        std::memset(p, t + 1, bytes);
        std::this_thread::yield();
        for (size_t k = 0; k < bytes; k += 97) ASSERT_EQ(p[k], t + 1);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  DevicePoolUsage u = pool->Usage();
  EXPECT_EQ(u.blocks, 0);
  EXPECT_EQ(u.in_use_bytes, 0);
  EXPECT_LE(u.reserved_bytes, 512 << 10);
  EXPECT_LE(live_bytes(), 512 << 10);
  pool->Trim();
  EXPECT_EQ(live_bytes(), 0);
}

TEST(CudaSlabAllocatorTest, FailsCleanlyWithoutAGpu) {
  if (ListGpus().ok()) GTEST_SKIP() << "a GPU is present; gpu_device_test covers it";
  absl::StatusOr<std::unique_ptr<SlabAllocator>> a = MakeCudaSlabAllocator(0);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(a.status())) << a.status();
  GpuDevice gpu;
  gpu.ordinal = 0;
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  ASSERT_FALSE(ctx.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(ctx.status())) << ctx.status();
  int x = 0;
  absl::Status pinned = PinHostMemory(&x, sizeof(x));
  EXPECT_FALSE(pinned.ok());
}

}  // namespace
}  // namespace flatshard::gpu
