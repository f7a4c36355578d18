#include "server/shard_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/gpu/cuda_util.h"
#include "common/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/gpu/device_pool.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

using ::flatshard::testing::ListSegments;
using ::flatshard::testing::SegmentExists;

bool AllZero(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

class ShardStoreTest : public ::testing::Test {
 protected:
  ShardStoreTest()
      : prefix_(absl::StrCat("fs_storetest_", getpid(), "_",
                             ::testing::UnitTest::GetInstance()->current_test_info()->name())) {}

  void TearDown() override {
    const std::vector<std::string> left = ListSegments(prefix_);
    EXPECT_THAT(left, IsEmpty()) << "segments left behind";
    for (const std::string& name : left) shm_unlink(("/" + name).c_str());
  }

  ShardStoreOptions Options(int64_t limit = std::numeric_limits<int64_t>::max()) {
    return ShardStoreOptions{.segment_prefix = prefix_, .memory_limit_bytes = limit};
  }

  const std::string prefix_;
};

TEST_F(ShardStoreTest, AllocateReturnsAZeroFilledBufferClientsCanMap) {
  ShardStore store(Options());
  absl::StatusOr<std::shared_ptr<Buffer>> buf =
      store.Allocate(BufferKind::kShard, 10000, "group=g unit=3 rank=1");
  ASSERT_TRUE(buf.ok()) << buf.status();
  const Buffer& b = **buf;
  EXPECT_EQ(b.kind(), BufferKind::kShard);
  EXPECT_EQ(b.bytes(), 10000);
  EXPECT_EQ(b.offset(), 0);
  EXPECT_EQ(b.label(), "group=g unit=3 rank=1");
  EXPECT_TRUE(b.committed());
  EXPECT_TRUE(absl::StartsWith(b.segment_name(), absl::StrCat("/", prefix_, ".")))
      << b.segment_name();
  ASSERT_NE(b.data(), nullptr);
  EXPECT_TRUE(AllZero(b.data(), 10000));

  std::memset(b.data(), 0x3c, 10000);
  absl::StatusOr<ShmSegment> client =
      ShmSegment::Open(b.segment_name(), b.offset() + b.bytes(), /*writable=*/false);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ(std::memcmp(client->data(), b.data(), 10000), 0);
}

// Restarts (README "Restarts"): a keep-shards shutdown leaves the shard and gradient segments
// (and unlinks the rest); a second store adopts them with their bytes, charged as allocations;
// a wrong size, another prefix or a missing segment is refused and changes nothing.
TEST_F(ShardStoreTest, KeptSegmentsAreAdoptedByTheNextStore) {
  std::string shard_name, grad_name, staging_name;
  {
    ShardStore first(Options());
    std::shared_ptr<Buffer> shard = *first.Allocate(BufferKind::kShard, 4096, "s");
    std::shared_ptr<Buffer> grad = *first.Allocate(BufferKind::kGradShard, 100, "g");
    std::shared_ptr<Buffer> staging = *first.Allocate(BufferKind::kStaging, 100, "t");
    std::memset(shard->data(), 0x5a, 4096);
    std::memset(grad->data(), 0x33, 100);
    shard_name = shard->segment_name();
    grad_name = grad->segment_name();
    staging_name = staging->segment_name();
    first.Shutdown(/*keep_durable=*/true);
    EXPECT_FALSE(SegmentExists(staging_name));
  }  // the buffers go: the kept names stay
  EXPECT_TRUE(SegmentExists(shard_name));
  EXPECT_TRUE(SegmentExists(grad_name));

  ShardStore second(Options(1 << 20));
  absl::StatusOr<std::shared_ptr<Buffer>> wrong =
      second.Adopt(BufferKind::kShard, shard_name, 4000, "s");
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("has 4096 bytes, the record says 4000"));
  absl::StatusOr<std::shared_ptr<Buffer>> other =
      second.Adopt(BufferKind::kShard, "/someone_else.1.1", 4096, "s");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::shared_ptr<Buffer>> missing =
      second.Adopt(BufferKind::kShard, absl::StrCat("/", prefix_, ".1.999999"), 4096, "s");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(second.Usage().total_bytes, 0);
  EXPECT_TRUE(SegmentExists(shard_name));

  absl::StatusOr<std::shared_ptr<Buffer>> shard =
      second.Adopt(BufferKind::kShard, shard_name, 4096, "s");
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ((*shard)->segment_name(), shard_name);
  EXPECT_EQ(static_cast<const uint8_t*>((*shard)->data())[4095], 0x5a);
  // Unpopulated (kept summon buffers): the same bytes, faulted in as read.
  absl::StatusOr<std::shared_ptr<Buffer>> grad =
      second.Adopt(BufferKind::kGradShard, grad_name, 100, "g", -1, /*populate=*/false);
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(static_cast<const uint8_t*>((*grad)->data())[99], 0x33);
  EXPECT_EQ(second.Usage().bytes(BufferKind::kShard), 4096);
  EXPECT_EQ(second.Usage().bytes(BufferKind::kGradShard), 100);
  EXPECT_EQ(second.Usage().buffers, 2);
  // Adopted buffers own their names: dropping them unlinks (TearDown checks nothing is left).
  shard->reset();
  grad->reset();
  EXPECT_FALSE(SegmentExists(shard_name));
  EXPECT_EQ(second.Usage().total_bytes, 0);
}

TEST_F(ShardStoreTest, UsageCountsBytesPerKind) {
  ShardStore store(Options(1 << 20));
  std::vector<std::shared_ptr<Buffer>> keep;
  for (auto [kind, bytes] : {std::pair{BufferKind::kShard, 100},
                             {BufferKind::kGradShard, 200},
                             {BufferKind::kUnsharded, 300},
                             {BufferKind::kStaging, 400},
                             {BufferKind::kShard, 5}}) {
    absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(kind, bytes);
    ASSERT_TRUE(buf.ok()) << buf.status();
    keep.push_back(*std::move(buf));
  }
  MemoryUsage usage = store.Usage();
  EXPECT_EQ(usage.bytes(BufferKind::kShard), 105);
  EXPECT_EQ(usage.bytes(BufferKind::kGradShard), 200);
  EXPECT_EQ(usage.bytes(BufferKind::kUnsharded), 300);
  EXPECT_EQ(usage.bytes(BufferKind::kStaging), 400);
  EXPECT_EQ(usage.total_bytes, 1005);
  EXPECT_EQ(usage.limit_bytes, 1 << 20);
  EXPECT_EQ(usage.buffers, 5);
  EXPECT_EQ(usage.DebugString(),
            "shard=105 grad_shard=200 unsharded=300 staging=400 total=1005 limit=1048576 "
            "buffers=5");
  EXPECT_THAT(ListSegments(prefix_), SizeIs(5));

  keep.erase(keep.begin());  // the 100-byte shard
  usage = store.Usage();
  EXPECT_EQ(usage.bytes(BufferKind::kShard), 5);
  EXPECT_EQ(usage.total_bytes, 905);
  EXPECT_EQ(usage.buffers, 4);
}

TEST_F(ShardStoreTest, AllocationOverTheLimitFailsAndChangesNothing) {
  ShardStore store(Options(1000));
  absl::StatusOr<std::shared_ptr<Buffer>> shard = store.Allocate(BufferKind::kShard, 600);
  ASSERT_TRUE(shard.ok()) << shard.status();
  const MemoryUsage before = store.Usage();

  absl::StatusOr<std::shared_ptr<Buffer>> refused =
      store.Allocate(BufferKind::kUnsharded, 500, "group=g unit=7");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("cannot allocate 500 bytes of unsharded memory (group=g unit=7): 600 "
                        "bytes in use, limit 1000"));
  const MemoryUsage after = store.Usage();
  EXPECT_EQ(after.bytes_by_kind, before.bytes_by_kind);
  EXPECT_EQ(after.total_bytes, 600);
  EXPECT_EQ(after.buffers, 1);
  EXPECT_THAT(ListSegments(prefix_), SizeIs(1));

  // Exactly up to the limit is fine; empty buffers always fit.
  absl::StatusOr<std::shared_ptr<Buffer>> rest = store.Allocate(BufferKind::kGradShard, 400);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(store.Allocate(BufferKind::kStaging, 1).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Allocate(BufferKind::kStaging, 0).ok());
  EXPECT_EQ(store.Usage().total_bytes, 1000);

  // Freeing makes room again.
  shard->reset();
  EXPECT_TRUE(store.Allocate(BufferKind::kUnsharded, 500).ok());
}

TEST_F(ShardStoreTest, HugeRequestsDoNotOverflowTheLimitCheck) {
  ShardStore store(Options());
  ASSERT_TRUE(store.Allocate(BufferKind::kShard, 4096).ok());
  absl::StatusOr<std::shared_ptr<Buffer>> a = store.Allocate(BufferKind::kShard, 4096);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(store.Allocate(BufferKind::kShard, std::numeric_limits<int64_t>::max()).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Within the (unlimited) budget but more than /dev/shm holds: the segment error, uncharged.
  absl::StatusOr<std::shared_ptr<Buffer>> big =
      store.Allocate(BufferKind::kShard, int64_t{1} << 50);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_THAT(big.status().message(), HasSubstr("bytes of shard memory"));
  EXPECT_EQ(store.Usage().total_bytes, 4096);
}

TEST_F(ShardStoreTest, LastReferenceFreesTheBuffer) {
  ShardStore store(Options());
  absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(BufferKind::kUnsharded, 8192);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const std::string name = (*buf)->segment_name();
  std::shared_ptr<Buffer> second = *buf;
  buf->reset();
  EXPECT_TRUE(SegmentExists(name));
  EXPECT_EQ(store.Usage().total_bytes, 8192);
  second.reset();
  errno = 0;
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
  EXPECT_EQ(store.Usage().total_bytes, 0);
  EXPECT_EQ(store.Usage().buffers, 0);
}

TEST_F(ShardStoreTest, BuffersMayOutliveTheStore) {
  std::shared_ptr<Buffer> buf;
  {
    ShardStore store(Options());
    absl::StatusOr<std::shared_ptr<Buffer>> b = store.Allocate(BufferKind::kStaging, 100);
    ASSERT_TRUE(b.ok()) << b.status();
    buf = *std::move(b);
  }
  std::memset(buf->data(), 1, 100);
  EXPECT_TRUE(SegmentExists(buf->segment_name()));
  buf.reset();  // frees against the shared accounting; TearDown checks the unlink
}

TEST_F(ShardStoreTest, ShutdownUnlinksEverySegmentAndRefusesNewWork) {
  ShardStore store(Options());
  std::vector<std::shared_ptr<Buffer>> keep;
  for (BufferKind kind :
       {BufferKind::kShard, BufferKind::kGradShard, BufferKind::kUnsharded, BufferKind::kStaging}) {
    absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(kind, 4096);
    ASSERT_TRUE(buf.ok()) << buf.status();
    keep.push_back(*std::move(buf));
  }
  ASSERT_TRUE(keep[2]->Decommit().ok());
  store.Shutdown();
  EXPECT_THAT(ListSegments(prefix_), IsEmpty());
  // Mappings stay usable until the buffers are dropped.
  for (const auto& buf : keep) std::memset(buf->data(), 7, 4096);
  absl::StatusOr<std::shared_ptr<Buffer>> late = store.Allocate(BufferKind::kShard, 1);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("shut down"));
  EXPECT_EQ(keep[2]->Commit().code(), absl::StatusCode::kFailedPrecondition);
  store.Shutdown();  // idempotent
  keep.clear();
  EXPECT_EQ(store.Usage().total_bytes, 0);
  EXPECT_EQ(store.Usage().buffers, 0);
  EXPECT_EQ(store.Usage().decommitted_buffers, 0);
}

TEST_F(ShardStoreTest, ConcurrentAllocationsKeepTotalsExact) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 40;
  ShardStore store(Options());
  std::vector<std::vector<std::shared_ptr<Buffer>>> kept(kThreads);
  std::vector<int64_t> kept_bytes(kThreads, 0);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const auto kind = static_cast<BufferKind>((t + i) % kNumBufferKinds);
        const int64_t bytes = 1 + (t * 131 + i * 977) % 20000;
        absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(kind, bytes);
        if (!buf.ok()) {
          ++failures;
          continue;
        }
        if (i % 2 == 0) {  // keep half, drop half right away
          kept_bytes[t] += bytes;
          kept[t].push_back(*std::move(buf));
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  int64_t want_total = 0;
  std::array<int64_t, kNumBufferKinds> want_by_kind{};
  for (int t = 0; t < kThreads; ++t) {
    want_total += kept_bytes[t];
    for (const auto& buf : kept[t]) want_by_kind[static_cast<int>(buf->kind())] += buf->bytes();
  }
  const MemoryUsage usage = store.Usage();
  EXPECT_EQ(usage.total_bytes, want_total);
  EXPECT_EQ(usage.bytes_by_kind, want_by_kind);
  EXPECT_EQ(usage.buffers, kThreads * kPerThread / 2);
  EXPECT_THAT(ListSegments(prefix_), SizeIs(kThreads * kPerThread / 2));
  kept.clear();
  EXPECT_EQ(store.Usage().total_bytes, 0);
}

TEST_F(ShardStoreTest, ConcurrentAllocationsNeverOvershootTheLimit) {
  constexpr int kThreads = 8;
  constexpr int kFit = 20;  // the limit holds exactly this many buffers
  constexpr int64_t kBytes = 4096;
  ShardStore store(Options(kFit * kBytes));
  std::vector<std::vector<std::shared_ptr<Buffer>>> kept(kThreads);
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kFit; ++i) {
        absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(BufferKind::kShard, kBytes);
        if (buf.ok()) {
          kept[t].push_back(*std::move(buf));
        } else if (buf.status().code() == absl::StatusCode::kResourceExhausted) {
          ++refused;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  size_t granted = 0;
  for (const auto& k : kept) granted += k.size();
  EXPECT_EQ(granted, static_cast<size_t>(kFit));
  EXPECT_EQ(refused.load(), kThreads * kFit - kFit);
  EXPECT_EQ(store.Usage().total_bytes, kFit * kBytes);
}

TEST_F(ShardStoreTest, DecommitAndCommitKeepTheSegmentAndTheClientMapping) {
  constexpr int64_t kBytes = 1 << 20;
  ShardStore store(Options(kBytes + 4096));
  absl::StatusOr<std::shared_ptr<Buffer>> buf =
      store.Allocate(BufferKind::kUnsharded, kBytes, "unit=0");
  ASSERT_TRUE(buf.ok()) << buf.status();
  Buffer& b = **buf;
  absl::StatusOr<ShmSegment> client = ShmSegment::Open(b.segment_name(), kBytes, true);
  ASSERT_TRUE(client.ok()) << client.status();
  std::memset(b.data(), 0x77, kBytes);

  ASSERT_TRUE(b.Decommit().ok());
  EXPECT_FALSE(b.committed());
  EXPECT_TRUE(b.Decommit().ok());  // no-op
  MemoryUsage usage = store.Usage();
  EXPECT_EQ(usage.bytes(BufferKind::kUnsharded), 0);
  EXPECT_EQ(usage.buffers, 1);
  EXPECT_EQ(usage.decommitted_buffers, 1);
  EXPECT_TRUE(SegmentExists(b.segment_name()));
  EXPECT_TRUE(AllZero(client->data(), kBytes));

  // While decommitted the budget is free for others; committing again is re-checked.
  {
    absl::StatusOr<std::shared_ptr<Buffer>> other = store.Allocate(BufferKind::kStaging, 8192);
    ASSERT_TRUE(other.ok()) << other.status();
    const absl::Status refused = b.Commit();
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.message(), HasSubstr("unsharded memory (unit=0)"));
    EXPECT_FALSE(b.committed());
    EXPECT_EQ(store.Usage().decommitted_buffers, 1);
  }
  ASSERT_TRUE(b.Commit().ok());
  EXPECT_TRUE(b.committed());
  usage = store.Usage();
  EXPECT_EQ(usage.bytes(BufferKind::kUnsharded), kBytes);
  EXPECT_EQ(usage.decommitted_buffers, 0);
  EXPECT_TRUE(AllZero(b.data(), kBytes));
  static_cast<uint8_t*>(client->data())[123] = 5;  // same mapping, no new mmap
  EXPECT_EQ(static_cast<const uint8_t*>(b.data())[123], 5);

  ASSERT_TRUE(b.Decommit().ok());
  buf->reset();  // dropping a decommitted buffer
  usage = store.Usage();
  EXPECT_EQ(usage.total_bytes, 0);
  EXPECT_EQ(usage.buffers, 0);
  EXPECT_EQ(usage.decommitted_buffers, 0);
}

TEST_F(ShardStoreTest, ShardsCannotBeDecommitted) {
  ShardStore store(Options());
  for (BufferKind kind : {BufferKind::kShard, BufferKind::kGradShard}) {
    absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(kind, 4096, "unit=1");
    ASSERT_TRUE(buf.ok()) << buf.status();
    static_cast<uint8_t*>((*buf)->data())[0] = 1;
    EXPECT_EQ((*buf)->Decommit().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE((*buf)->committed());
    EXPECT_EQ(static_cast<const uint8_t*>((*buf)->data())[0], 1);
  }
}

TEST_F(ShardStoreTest, ZeroByteBuffersWork) {
  ShardStore store(Options());
  absl::StatusOr<std::shared_ptr<Buffer>> buf = store.Allocate(BufferKind::kShard, 0);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ((*buf)->data(), nullptr);
  EXPECT_EQ((*buf)->bytes(), 0);
  EXPECT_TRUE(ShmSegment::Open((*buf)->segment_name(), 0, false).ok());
  EXPECT_EQ(store.Usage().buffers, 1);
  EXPECT_EQ(store.Usage().total_bytes, 0);
}

TEST_F(ShardStoreTest, InvalidRequestsAndOptions) {
  ShardStore store(Options());
  EXPECT_EQ(store.Allocate(BufferKind::kShard, -1).status().code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_TRUE(ShardStore::ValidateOptions(Options()).ok());
  EXPECT_EQ(ShardStore::ValidateOptions({.segment_prefix = "a/b"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardStore::ValidateOptions({.segment_prefix = "ok", .memory_limit_bytes = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  ShardStore bad({.segment_prefix = "no/slash"});
  absl::StatusOr<std::shared_ptr<Buffer>> buf = bad.Allocate(BufferKind::kShard, 1);
  EXPECT_EQ(buf.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(buf.status().message(), HasSubstr("no/slash"));
}

// Device placement, over a DevicePool whose slabs are host memory (no GPU needed): what the
// store does with device buffers, not what CUDA does.
class FakeSlabs final : public gpu::SlabAllocator {
 public:
  absl::StatusOr<gpu::Slab> Allocate(size_t bytes) override {
    gpu::Slab slab;
    slab.base = std::malloc(bytes);
    slab.bytes = bytes;
    slab.ipc_handle = std::string(gpu::kIpcHandleBytes, static_cast<char>('a' + allocs_++ % 26));
    return slab;
  }
  void Free(const gpu::Slab& slab) override { std::free(slab.base); }
  absl::Status Zero(void* p, size_t bytes) override {
    std::memset(p, 0, bytes);
    return absl::OkStatus();
  }

 private:
  int allocs_ = 0;
};

class ShardStoreDeviceTest : public ShardStoreTest {
 protected:
  ShardStoreOptions DeviceOptions(int64_t device_limit) {
    gpu::DevicePoolOptions pool;
    pool.device = 1;
    pool.device_uuid = "GPU-fake-1";
    pool.limit_bytes = device_limit;
    pool.slab_bytes = 1 << 20;
    ShardStoreOptions o = Options();
    o.device_pools.resize(2);
    o.device_pools[1] = gpu::DevicePool::Create(pool, std::make_unique<FakeSlabs>());
    return o;
  }
};

TEST_F(ShardStoreDeviceTest, DeviceBuffersLiveInPoolSlabsAndAreAccountedApart) {
  ShardStore store(DeviceOptions(8 << 20));
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      store.Allocate(BufferKind::kShard, 4096, "unit=0", -1, Placement::Device(1));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*b)->on_device());
  EXPECT_EQ((*b)->view(DType::kFloat32).kind, collective::MemoryKind::kCuda);
  EXPECT_TRUE(absl::StartsWith((*b)->segment_name(), "cuda-slab-")) << (*b)->segment_name();
  EXPECT_EQ((*b)->segment_bytes(), 1 << 20);
  EXPECT_EQ((*b)->ipc_handle().size(), gpu::kIpcHandleBytes);
  EXPECT_EQ((*b)->device_uuid(), "GPU-fake-1");
  ASSERT_NE((*b)->data(), nullptr);
  EXPECT_TRUE(AllZero((*b)->data(), 4096));
  EXPECT_THAT(ListSegments(prefix_), IsEmpty()) << "device buffers make no shm segments";
  MemoryUsage usage = store.Usage();
  EXPECT_EQ(usage.device_bytes, 4096);
  EXPECT_EQ(usage.total_bytes, 0);
  EXPECT_EQ(usage.buffers, 1);
  b->reset();
  usage = store.Usage();
  EXPECT_EQ(usage.device_bytes, 0);
  EXPECT_EQ(usage.buffers, 0);
}

TEST_F(ShardStoreDeviceTest, DecommitReturnsTheBlockAndCommitReusesTheSlab) {
  ShardStore store(DeviceOptions(8 << 20));
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      store.Allocate(BufferKind::kUnsharded, 8192, "full", -1, Placement::Device(1));
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string slab = (*b)->segment_name();
  std::memset((*b)->data(), 7, 8192);
  ASSERT_TRUE((*b)->Decommit().ok());
  EXPECT_FALSE((*b)->committed());
  EXPECT_EQ((*b)->data(), nullptr);
  EXPECT_EQ(store.Usage().device_bytes, 0);
  ASSERT_TRUE((*b)->Commit().ok());
  EXPECT_EQ((*b)->segment_name(), slab) << "the slab stays: trainers keep their IPC mapping";
  EXPECT_TRUE(AllZero((*b)->data(), 8192));
  EXPECT_EQ(store.Usage().device_bytes, 8192);
}

TEST_F(ShardStoreDeviceTest, RefusalsNameTheDeviceAndChangeNothing) {
  ShardStore store(DeviceOptions(1 << 20));
  absl::StatusOr<std::shared_ptr<Buffer>> none =
      store.Allocate(BufferKind::kShard, 64, "unit=3", -1, Placement::Device(0));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("GPU 0"));
  absl::StatusOr<std::shared_ptr<Buffer>> big =
      store.Allocate(BufferKind::kShard, 4 << 20, "unit=4", -1, Placement::Device(1));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_EQ(store.Usage().device_bytes, 0);
  EXPECT_EQ(store.Usage().buffers, 0);
}

// Device bytes count per uid (--gpu_memory_quota_mib_per_uid), apart from host bytes, and
// come back with Decommit, Commit and the buffer's end.
TEST_F(ShardStoreDeviceTest, DeviceBytesCountAgainstTheUidsDeviceQuota) {
  ShardStoreOptions o = DeviceOptions(8 << 20);
  o.device_quota_bytes_per_uid = 12288;
  ShardStore store(o);
  const int64_t uid = static_cast<int64_t>(::geteuid());
  absl::StatusOr<std::shared_ptr<Buffer>> a =
      store.Allocate(BufferKind::kShard, 8192, "unit=0", uid, Placement::Device(1));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(store.UsageOf(uid).device_bytes, 8192);
  EXPECT_EQ(store.UsageOf(uid).bytes, 0) << "device bytes are not host bytes";
  absl::StatusOr<std::shared_ptr<Buffer>> over =
      store.Allocate(BufferKind::kStaging, 8192, "weights name=w", uid, Placement::Device(1));
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_THAT(over.status().message(),
              HasSubstr(absl::StrCat("uid ", uid,
                                     " cannot allocate 8192 bytes of staging device "
                                     "memory (weights name=w): it uses 8192 bytes of its GPU "
                                     "memory quota of 12288 bytes "
                                     "(--gpu_memory_quota_mib_per_uid)")));
  EXPECT_EQ(store.UsageOf(uid).device_bytes, 8192) << "a refusal changes nothing";
  EXPECT_EQ(store.Usage().device_bytes, 8192);
  // Another uid has a quota of its own; host memory is not limited by it.
  ASSERT_TRUE(store.Allocate(BufferKind::kShard, 8192, "other", -1, Placement::Device(1)).ok());
  ASSERT_TRUE(store.Allocate(BufferKind::kShard, 65536, "host", uid).ok());
  // Decommit returns the bytes to the quota, Commit charges them again (and may be refused).
  absl::StatusOr<std::shared_ptr<Buffer>> u =
      store.Allocate(BufferKind::kUnsharded, 4096, "full", uid, Placement::Device(1));
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(store.UsageOf(uid).device_bytes, 12288);
  ASSERT_TRUE((*u)->Decommit().ok());
  EXPECT_EQ(store.UsageOf(uid).device_bytes, 8192);
  absl::StatusOr<std::shared_ptr<Buffer>> fill =
      store.Allocate(BufferKind::kStaging, 4096, "fill", uid, Placement::Device(1));
  ASSERT_TRUE(fill.ok()) << fill.status();
  EXPECT_EQ((*u)->Commit().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE((*u)->committed());
  fill->reset();
  ASSERT_TRUE((*u)->Commit().ok());
  EXPECT_EQ(store.UsageOf(uid).device_bytes, 12288);
  a->reset();
  u->reset();
  EXPECT_EQ(store.UsageOf(uid).device_bytes, 0);
}

TEST_F(ShardStoreTest, PinnedHostMemoryNeedsCudaAndLeavesNothingWithout) {
  ShardStore store(Options());
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      store.Allocate(BufferKind::kUnsharded, 4096, "offload", -1, Placement::Pinned());
  if (b.ok()) GTEST_SKIP() << "this machine can pin host memory (it has a GPU)";
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_THAT(b.status().message(), HasSubstr("cannot pin 4096 bytes"));
  EXPECT_EQ(store.Usage().total_bytes, 0);
}

TEST(BufferKindTest, Names) {
  EXPECT_EQ(BufferKindName(BufferKind::kShard), "shard");
  EXPECT_EQ(BufferKindName(BufferKind::kGradShard), "grad_shard");
  EXPECT_EQ(BufferKindName(BufferKind::kUnsharded), "unsharded");
  EXPECT_EQ(BufferKindName(BufferKind::kStaging), "staging");
}

// ---- Per-uid quotas and the segment budget (issue 11) ----

TEST_F(ShardStoreTest, MemoryQuotaPerUidRefusesNamingUidQuotaAndUsageAndSparesOthers) {
  ShardStoreOptions o = Options();
  o.memory_quota_bytes_per_uid = 10000;
  ShardStore store(o);
  auto a = store.Allocate(BufferKind::kShard, 6000, "a", /*owner_uid=*/-1);
  ASSERT_TRUE(a.ok()) << a.status();
  const MemoryUsage before = store.Usage();
  auto b = store.Allocate(BufferKind::kShard, 5000, "group=g unit=1 rank=0", -1);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(b.status().message(),
            "uid (remote) cannot allocate 5000 bytes of shard memory (group=g unit=1 rank=0): it "
            "uses 6000 bytes of its memory quota of 10000 bytes (--memory_quota_mib_per_uid)");
  // Nothing changed on refusal.
  EXPECT_EQ(store.Usage().total_bytes, before.total_bytes);
  EXPECT_EQ(store.Usage().buffers, before.buffers);
  EXPECT_EQ(store.UsageOf(-1).bytes, 6000);
  EXPECT_EQ(store.UsageOf(-1).segments, 1);
  // Another tenant is not starved by the first one's usage.
  const int64_t other = static_cast<int64_t>(::geteuid());
  auto c = store.Allocate(BufferKind::kShard, 9000, "c", other);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(store.UsageOf(other).bytes, 9000);
  // Freeing gives the quota back; decommitted bytes do not count, recommits do.
  a->reset();
  EXPECT_EQ(store.UsageOf(-1).bytes, 0);
  EXPECT_EQ(store.UsageOf(-1).segments, 0);
  auto u = store.Allocate(BufferKind::kUnsharded, 8000, "u", -1);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_TRUE((*u)->Decommit().ok());
  EXPECT_EQ(store.UsageOf(-1).bytes, 0);
  EXPECT_EQ(store.UsageOf(-1).segments, 1);
  auto d = store.Allocate(BufferKind::kShard, 3000, "d", -1);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::Status again = (*u)->Commit();
  EXPECT_EQ(again.code(), absl::StatusCode::kResourceExhausted) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("uid (remote) cannot allocate 8000 bytes"));
  EXPECT_FALSE((*u)->committed());
  d->reset();
  EXPECT_TRUE((*u)->Commit().ok());
  EXPECT_EQ(store.UsageOf(-1).bytes, 8000);
}

TEST_F(ShardStoreTest, SegmentQuotaPerUidAndSegmentBudgetRefuseBeforeDescriptorsRunOut) {
  ShardStoreOptions o = Options();
  o.max_segments_per_uid = 3;
  o.max_segments = 5;
  ShardStore store(o);
  std::vector<std::shared_ptr<Buffer>> mine;
  for (int i = 0; i < 3; ++i) {
    auto b = store.Allocate(BufferKind::kShard, 64, absl::StrCat("unit=", i), 1000);
    ASSERT_TRUE(b.ok()) << b.status();
    mine.push_back(*std::move(b));
  }
  auto refused = store.Allocate(BufferKind::kShard, 64, "unit=3", 1000);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "uid 1000 cannot allocate shard memory (unit=3): it has 3 shared-memory segments "
            "open, its segment quota is 3 (--max_segments_per_uid)");
  EXPECT_EQ(store.Usage().buffers, 3);
  EXPECT_THAT(ListSegments(prefix_), SizeIs(3));
  // Another uid still gets segments, up to the daemon's budget.
  std::vector<std::shared_ptr<Buffer>> theirs;
  for (int i = 0; i < 2; ++i) {
    auto b = store.Allocate(BufferKind::kShard, 64, "theirs", 1001);
    ASSERT_TRUE(b.ok()) << b.status();
    theirs.push_back(*std::move(b));
  }
  auto over = store.Allocate(BufferKind::kShard, 64, "third", 1002);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()),
              HasSubstr("flatshardd has 5 shared-memory segments open, its budget is 5"));
  // Freeing one gives it back.
  mine.pop_back();
  EXPECT_TRUE(store.Allocate(BufferKind::kShard, 64, "now", 1002).ok());
  EXPECT_EQ(store.UsageOf(1000).segments, 2);
}

TEST(ShardStoreOptionsTest, NegativeQuotasAreRefused) {
  ShardStoreOptions o;
  o.max_segments_per_uid = -1;
  EXPECT_EQ(ShardStore::ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flatshard::server
