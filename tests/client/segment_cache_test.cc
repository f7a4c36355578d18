#include "client/segment_cache.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
  EXPECT_FALSE(ro->mapping->writable());
  EXPECT_TRUE(rw->mapping->writable());
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
