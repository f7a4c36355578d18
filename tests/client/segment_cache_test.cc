#include "client/segment_cache.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_gpu.h"

namespace flatshard::client::internal {
namespace {

using ::testing::HasSubstr;

ShmSegment MakeSegment(size_t bytes) {
  absl::StatusOr<ShmSegment> s = ShmSegment::Create(MakeSegmentName("fscachetest"), bytes);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

SegmentRange RangeOf(const ShmSegment& s, uint64_t offset, uint64_t bytes) {
  SegmentRange r;
  r.segment = s.name();
  r.segment_bytes = s.size();
  r.offset = offset;
  r.bytes = bytes;
  return r;
}

TEST(SegmentCacheTest, MapsOnceAndReturnsTheSamePointer) {
  ShmSegment segment = MakeSegment(8192);
  static_cast<char*>(segment.data())[100] = 42;
  SegmentCache cache;
  absl::StatusOr<MappedRange> first = cache.Map(RangeOf(segment, 96, 64), /*writable=*/true);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(cache.map_calls(), 1);
  EXPECT_EQ(static_cast<const char*>(first->data)[4], 42);  // offset 96 + 4 = byte 100
  EXPECT_EQ(first->bytes, 64u);
  EXPECT_TRUE(first->writable);

  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<MappedRange> again = cache.Map(RangeOf(segment, 96, 64), true);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->data, first->data);
    EXPECT_EQ(again->mapping, first->mapping);
  }
  // Another range of the same segment: the same mapping, shifted.
  absl::StatusOr<MappedRange> other = cache.Map(RangeOf(segment, 4096, 4096), true);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(static_cast<char*>(other->data) - static_cast<char*>(first->data), 4096 - 96);
  EXPECT_EQ(cache.map_calls(), 1);
  EXPECT_EQ(cache.size(), 1u);
}

// The number of this process's mappings of `name` ("/x") that /proc/self/maps lists.
int MappingsOf(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    if (line.find(absl::StrCat("/dev/shm", name)) != std::string::npos) ++n;
  }
  return n;
}

TEST(SegmentCacheTest, DropUnlinkedUnmapsFreedSegmentsOnceNoRangeUsesThem) {
  ShmSegment kept = MakeSegment(4096);
  ShmSegment freed = MakeSegment(4096);
  SegmentCache cache;
  ASSERT_TRUE(cache.Map(RangeOf(kept, 0, 16), /*writable=*/false).ok());
  absl::StatusOr<MappedRange> in_use = cache.Map(RangeOf(freed, 0, 16), /*writable=*/true);
  ASSERT_TRUE(in_use.ok()) << in_use.status();
  ASSERT_TRUE(cache.Map(RangeOf(freed, 0, 16), /*writable=*/false).ok());
  EXPECT_EQ(cache.DropUnlinked(), 0u) << "both segments still exist";
  EXPECT_EQ(cache.size(), 2u);

  ASSERT_TRUE(freed.Unlink().ok());  // the daemon frees it
  EXPECT_EQ(cache.DropUnlinked(), 0u) << "a range still uses it";
  EXPECT_EQ(MappingsOf(freed.name()), 3) << "the creator's, and the cache's two";
  in_use = absl::CancelledError();  // the last view goes
  EXPECT_EQ(cache.DropUnlinked(), 1u);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(MappingsOf(freed.name()), 1) << "only the creator's is left";

  // The linked segment stays mapped: mapping it again is no new mmap.
  const int64_t calls = cache.map_calls();
  ASSERT_TRUE(cache.Map(RangeOf(kept, 0, 16), false).ok());
  EXPECT_EQ(cache.map_calls(), calls);
}

TEST(SegmentCacheTest, DropUnlinkedDropsANameReusedForAnotherSegment) {
  std::string name;
  SegmentCache cache;
  {
    ShmSegment first = MakeSegment(4096);
    name = first.name();
    ASSERT_TRUE(cache.Map(RangeOf(first, 0, 16), false).ok());
  }                                                                    // unlinked
  absl::StatusOr<ShmSegment> second = ShmSegment::Create(name, 4096);  // a restarted daemon
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(cache.DropUnlinked(), 1u);
  ASSERT_TRUE(cache.Map(RangeOf(*second, 0, 16), false).ok());
  EXPECT_EQ(cache.map_calls(), 2);
  EXPECT_EQ(cache.DropUnlinked(), 0u);
}

TEST(SegmentCacheTest, WritesThroughTheMappingReachTheCreator) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache;
  absl::StatusOr<MappedRange> r = cache.Map(RangeOf(segment, 8, 8), true);
  ASSERT_TRUE(r.ok()) << r.status();
  const int64_t value = 0x0123456789abcdef;
  std::memcpy(r->data, &value, sizeof(value));
  int64_t seen = 0;
  std::memcpy(&seen, static_cast<char*>(segment.data()) + 8, sizeof(seen));
  EXPECT_EQ(seen, value);
}

TEST(SegmentCacheTest, ReadOnlyAndWritableAreSeparateMappingsEachMadeOnce) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache;
  absl::StatusOr<MappedRange> ro = cache.Map(RangeOf(segment, 0, 16), /*writable=*/false);
  absl::StatusOr<MappedRange> rw = cache.Map(RangeOf(segment, 0, 16), /*writable=*/true);
  ASSERT_TRUE(ro.ok()) << ro.status();
  ASSERT_TRUE(rw.ok()) << rw.status();
  EXPECT_FALSE(ro->writable);
  // Host ranges hold their ShmSegment.
  EXPECT_FALSE(std::static_pointer_cast<const ShmSegment>(ro->mapping)->writable());
  EXPECT_TRUE(std::static_pointer_cast<const ShmSegment>(rw->mapping)->writable());
  EXPECT_NE(ro->data, rw->data);
  EXPECT_EQ(cache.map_calls(), 2);
  static_cast<char*>(rw->data)[3] = 7;  // both map the same pages
  EXPECT_EQ(static_cast<const char*>(ro->data)[3], 7);
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(cache.Map(RangeOf(segment, 0, 16), i % 2 == 0).ok());
  }
  EXPECT_EQ(cache.map_calls(), 2);
  EXPECT_EQ(cache.size(), 1u);
}

TEST(SegmentCacheTest, RefusesASegmentSmallerThanTheHandleSays) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache;
  SegmentRange r = RangeOf(segment, 0, 16);
  r.segment_bytes = 8192;
  absl::StatusOr<MappedRange> m = cache.Map(r, true);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
  EXPECT_EQ(cache.map_calls(), 0);
  EXPECT_EQ(cache.size(), 0u);
}

TEST(SegmentCacheTest, RefusesARangeOutsideTheSegment) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache;
  for (const auto& [offset, bytes] : std::vector<std::pair<uint64_t, uint64_t>>{
           {4000, 100}, {0, 4097}, {UINT64_MAX, 2}, {1, UINT64_MAX}}) {
    absl::StatusOr<MappedRange> m = cache.Map(RangeOf(segment, offset, bytes), true);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal) << offset << "+" << bytes;
    EXPECT_THAT(m.status().message(), HasSubstr(segment.name()));
  }
  SegmentRange unnamed;
  EXPECT_EQ(cache.Map(unnamed, true).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(cache.map_calls(), 0);
}

TEST(SegmentCacheTest, MissingSegmentIsNotFoundAndNotCached) {
  SegmentCache cache;
  SegmentRange r;
  r.segment = MakeSegmentName("fscachetest");  // never created
  r.segment_bytes = 4096;
  r.bytes = 16;
  EXPECT_EQ(cache.Map(r, true).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.size(), 0u);
}

TEST(SegmentCacheTest, ALargerHandleRemapsAndOldRangesStayValid) {
  // A segment the cache mapped partially (smaller segment_bytes) is mapped again whole.
  ShmSegment segment = MakeSegment(8192);
  SegmentCache cache;
  SegmentRange small = RangeOf(segment, 0, 16);
  small.segment_bytes = 4096;
  absl::StatusOr<MappedRange> a = cache.Map(small, true);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<MappedRange> b = cache.Map(RangeOf(segment, 8000, 16), true);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(cache.map_calls(), 2);
  static_cast<char*>(a->data)[0] = 5;  // the first mapping is still alive
  EXPECT_EQ(static_cast<char*>(segment.data())[0], 5);
  ASSERT_TRUE(cache.Map(small, true).ok());  // served by the bigger mapping
  EXPECT_EQ(cache.map_calls(), 2);
}

TEST(SegmentCacheTest, ClearForgetsMappingsButHandedOutRangesStayValid) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache;
  absl::StatusOr<MappedRange> r = cache.Map(RangeOf(segment, 0, 16), true);
  ASSERT_TRUE(r.ok());
  cache.Clear();
  EXPECT_EQ(cache.size(), 0u);
  static_cast<char*>(r->data)[1] = 9;
  EXPECT_EQ(static_cast<char*>(segment.data())[1], 9);
  ASSERT_TRUE(cache.Map(RangeOf(segment, 0, 16), true).ok());
  EXPECT_EQ(cache.map_calls(), 2);
}

TEST(SegmentCacheTest, EvictsOnlyUnusedMappingsPastTheLimit) {
  std::vector<ShmSegment> segments;
  for (int i = 0; i < 4; ++i) segments.push_back(MakeSegment(4096));
  SegmentCache cache(/*max_entries=*/2);
  absl::StatusOr<MappedRange> held = cache.Map(RangeOf(segments[0], 0, 16), true);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(cache.Map(RangeOf(segments[1], 0, 16), true).ok());  // unused from here on
  ASSERT_TRUE(cache.Map(RangeOf(segments[2], 0, 16), true).ok());  // 3 > 2: sweeps [1]
  EXPECT_LE(cache.size(), 2u);
  // The held one survived: mapping it again makes no new map.
  const int64_t before = cache.map_calls();
  absl::StatusOr<MappedRange> again = cache.Map(RangeOf(segments[0], 0, 16), true);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data, held->data);
  EXPECT_EQ(cache.map_calls(), before);
}

TEST(SegmentCacheTest, ConcurrentFirstUsesMapOnce) {
  ShmSegment segment = MakeSegment(1 << 20);
  SegmentCache cache;
  std::vector<std::thread> threads;
  std::vector<void*> seen(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<MappedRange> r = cache.Map(RangeOf(segment, 0, 64), true);
        ASSERT_TRUE(r.ok()) << r.status();
        seen[t] = r->data;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(cache.map_calls(), 1);
  for (void* p : seen) EXPECT_EQ(p, seen[0]);
}

TEST(SegmentCacheTest, ZeroByteRangeHasNoPointer) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache;
  absl::StatusOr<MappedRange> r = cache.Map(RangeOf(segment, 4096, 0), true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->data, nullptr);
  EXPECT_EQ(r->bytes, 0u);
}

}  // namespace
}  // namespace flatshard::client::internal

// --- Device segments (CUDA IPC), through FakeDeviceMemoryOpener ------------------------------

namespace flatshard::client::internal {
namespace device {

using testing::FakeDeviceMemoryOpener;
using testing::FakeGpuLog;
using testing::FakeIpcHandle;

SegmentRange DeviceRangeOf(const ShmSegment& s, uint64_t offset, uint64_t bytes,
                           const std::string& slab_id, const std::string& uuid = "GPU-fake-1") {
  SegmentRange r;
  r.segment = slab_id;
  r.segment_bytes = s.size();
  r.offset = offset;
  r.bytes = bytes;
  r.cuda = true;
  r.cuda_ipc_handle = FakeIpcHandle(s.name(), s.size());
  r.device_uuid = uuid;
  return r;
}

class DeviceSegmentCacheTest : public ::testing::Test {
 protected:
  int opens() {
    absl::MutexLock lock(&log_->mu);
    return log_->opens;
  }
  int closes() {
    absl::MutexLock lock(&log_->mu);
    return log_->closes;
  }

  std::shared_ptr<FakeGpuLog> log_ = std::make_shared<FakeGpuLog>();
};

TEST_F(DeviceSegmentCacheTest, OpensEachSlabOnceAcrossRangesAndAccessModes) {
  ShmSegment slab = MakeSegment(8192);
  static_cast<char*>(slab.data())[4100] = 7;
  SegmentCache cache(4096, std::make_unique<FakeDeviceMemoryOpener>(log_));
  std::vector<MappedRange> held;
  for (int summon = 0; summon < 5; ++summon) {
    for (uint64_t offset : {0, 4096}) {
      for (bool writable : {false, true}) {
        absl::StatusOr<MappedRange> r =
            cache.Map(DeviceRangeOf(slab, offset, 4096, "slab-3"), writable);
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->device, 1);  // the fake's ordinal for GPU-fake-1
        EXPECT_EQ(r->writable, writable);
        EXPECT_EQ(r->bytes, 4096u);
        held.push_back(*r);
      }
    }
  }
  EXPECT_EQ(cache.ipc_open_calls(), 1);
  EXPECT_EQ(opens(), 1);
  EXPECT_EQ(cache.map_calls(), 0);  // no shm mapping for a device range
  EXPECT_EQ(cache.size(), 1u);
  // Read-only and writable ranges share one mapping; offsets are applied to its pointer.
  EXPECT_EQ(held[0].mapping, held[1].mapping);
  EXPECT_EQ(static_cast<char*>(held[2].data) - static_cast<char*>(held[0].data), 4096);
  EXPECT_EQ(static_cast<char*>(held[2].data)[4], 7);
}

TEST_F(DeviceSegmentCacheTest, HostRangesStayOnShmAndNeverCallTheOpener) {
  ShmSegment segment = MakeSegment(4096);
  SegmentCache cache(4096, std::make_unique<FakeDeviceMemoryOpener>(log_));
  absl::StatusOr<MappedRange> r = cache.Map(RangeOf(segment, 0, 16), true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device, -1);
  EXPECT_EQ(cache.ipc_open_calls(), 0);
  EXPECT_EQ(log_->total_calls(), 0);
}

TEST_F(DeviceSegmentCacheTest, ClosesWhenTheLastRangeAndTheCacheDropIt) {
  ShmSegment slab = MakeSegment(4096);
  {
    SegmentCache cache(4096, std::make_unique<FakeDeviceMemoryOpener>(log_));
    absl::StatusOr<MappedRange> r = cache.Map(DeviceRangeOf(slab, 0, 64, "slab-1"), true);
    ASSERT_TRUE(r.ok()) << r.status();
    cache.Clear();
    EXPECT_EQ(closes(), 0);  // the range still holds it
    static_cast<char*>(r->data)[0] = 9;
    r = absl::StatusOr<MappedRange>(absl::CancelledError("dropped"));
    EXPECT_EQ(closes(), 1);
    // Held only by the cache: closed with the cache.
    ASSERT_TRUE(cache.Map(DeviceRangeOf(slab, 0, 64, "slab-1"), true).ok());
    EXPECT_EQ(cache.ipc_open_calls(), 2);
    EXPECT_EQ(closes(), 1);
  }
  EXPECT_EQ(closes(), 2);
  EXPECT_EQ(static_cast<char*>(slab.data())[0], 9);
}

TEST_F(DeviceSegmentCacheTest, EvictionClosesOnlyUnusedSlabs) {
  std::vector<ShmSegment> slabs;
  for (int i = 0; i < 4; ++i) slabs.push_back(MakeSegment(4096));
  SegmentCache cache(/*max_entries=*/2, std::make_unique<FakeDeviceMemoryOpener>(log_));
  absl::StatusOr<MappedRange> kept = cache.Map(DeviceRangeOf(slabs[0], 0, 8, "s0"), true);
  ASSERT_TRUE(kept.ok()) << kept.status();
  for (int i = 1; i < 4; ++i) {
    ASSERT_TRUE(cache.Map(DeviceRangeOf(slabs[i], 0, 8, absl::StrCat("s", i)), true).ok());
  }
  // s2 pushed the cache over 2: s1 (unused) was closed; s0 is in use, s2 was being returned.
  // The next sweep waits until the cache doubled.
  EXPECT_EQ(closes(), 1);
  EXPECT_EQ(cache.size(), 3u);  // s0, s2, s3
  ASSERT_TRUE(cache.Map(DeviceRangeOf(slabs[0], 8, 8, "s0"), true).ok());
  EXPECT_EQ(cache.ipc_open_calls(), 4);  // s0 was not reopened
}

TEST_F(DeviceSegmentCacheTest, ASlabIdWithANewHandleIsReopened) {
  ShmSegment first = MakeSegment(4096);
  ShmSegment second = MakeSegment(4096);
  static_cast<char*>(second.data())[0] = 5;
  SegmentCache cache(4096, std::make_unique<FakeDeviceMemoryOpener>(log_));
  absl::StatusOr<MappedRange> a = cache.Map(DeviceRangeOf(first, 0, 8, "slab"), true);
  absl::StatusOr<MappedRange> b = cache.Map(DeviceRangeOf(second, 0, 8, "slab"), true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(cache.ipc_open_calls(), 2);
  EXPECT_EQ(static_cast<char*>(b->data)[0], 5);
  EXPECT_EQ(closes(), 0);  // `a` still holds the replaced mapping
}

TEST_F(DeviceSegmentCacheTest, ConcurrentFirstUsesOpenOnce) {
  ShmSegment slab = MakeSegment(4096);
  SegmentCache cache(4096, std::make_unique<FakeDeviceMemoryOpener>(log_));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        EXPECT_TRUE(cache.Map(DeviceRangeOf(slab, 0, 8, "slab"), i % 2 == 0).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(cache.ipc_open_calls(), 1);
}

TEST_F(DeviceSegmentCacheTest, ErrorsNameTheSegmentAndGpuAndAreNotCached) {
  ShmSegment slab = MakeSegment(4096);
  SegmentCache cache(4096, std::make_unique<FakeDeviceMemoryOpener>(log_));

  SegmentRange bad = DeviceRangeOf(slab, 0, 8, "slab-9");
  bad.cuda_ipc_handle.resize(10);
  absl::StatusOr<MappedRange> m = cache.Map(bad, true);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(m.status().message(), HasSubstr("device segment slab-9 on GPU GPU-fake-1"));
  EXPECT_THAT(m.status().message(), HasSubstr("wrong size: 10 bytes, want 64"));
  EXPECT_EQ(log_->total_calls(), 0);  // refused before the opener

  m = cache.Map(DeviceRangeOf(slab, 0, 8, "slab-9", "GPU-elsewhere"), true);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("device segment slab-9 on GPU GPU-elsewhere: "));

  m = cache.Map(DeviceRangeOf(slab, 4000, 200, "slab-9"), true);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(m.status().message(), HasSubstr("does not fit in device segment slab-9"));

  {
    absl::MutexLock lock(&log_->mu);
    log_->no_gpu = absl::FailedPreconditionError("no usable GPU: fake");
  }
  m = cache.Map(DeviceRangeOf(slab, 0, 8, "slab-9"), true);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.ipc_open_calls(), 0);
  {
    absl::MutexLock lock(&log_->mu);
    log_->no_gpu = absl::OkStatus();
  }
  EXPECT_TRUE(cache.Map(DeviceRangeOf(slab, 0, 8, "slab-9"), true).ok());  // retried
}

// The real opener on this machine (no GPU here, or built without CUDA): a clean
// FAILED_PRECONDITION naming the GPU; with a GPU the fake uuid is NOT_FOUND. Never a crash.
TEST(RealDeviceOpenerTest, FailsCleanlyForAGpuThisProcessCannotUse) {
  SegmentCache cache;
  SegmentRange r;
  r.segment = "slab-1";
  r.segment_bytes = 1024;
  r.bytes = 1024;
  r.cuda = true;
  r.cuda_ipc_handle = std::string(64, '\1');
  r.device_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  absl::StatusOr<MappedRange> m = cache.Map(r, true);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(),
              HasSubstr("device segment slab-1 on GPU GPU-00000000-0000-0000-0000-000000000000"));
  if (m.status().code() == absl::StatusCode::kFailedPrecondition) {
    EXPECT_THAT(m.status().message(),
                HasSubstr("the daemon placed this rank's memory on GPU "
                          "GPU-00000000-0000-0000-0000-000000000000 but this process has no "
                          "usable GPU: "));
  } else {
    EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  }
}

}  // namespace device
}  // namespace flatshard::client::internal
