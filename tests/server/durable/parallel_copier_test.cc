// ParallelCopier: every byte of every range lands, whatever the chunking; small batches and a
// copier without helpers copy on the caller; callers on several threads share the helpers;
// Copy::also writes a second destination.
#include "server/durable/parallel_copier.h"

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

std::vector<uint8_t> Pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(seed + i * 7 + i / 251);
  return v;
}

// Copies ranges of these sizes (chunk_bytes 1000: many chunks, ragged ends) and checks them.
void ExpectCopied(ParallelCopier& copier, const std::vector<size_t>& sizes) {
  std::vector<std::vector<uint8_t>> src, dst;
  std::vector<ParallelCopier::Copy> copies;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(Pattern(sizes[i], static_cast<uint8_t>(i + 1)));
    dst.emplace_back(sizes[i] + 1, 0xEE);  // one guard byte past the range
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    copies.push_back({dst[i].data(), src[i].data(), sizes[i]});
  }
  copier.Run(copies);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(std::equal(src[i].begin(), src[i].end(), dst[i].begin())) << "range " << i;
    EXPECT_EQ(dst[i].back(), 0xEE) << "range " << i << " was written past its end";
  }
}

TEST(ParallelCopierTest, CopiesEveryRangeInChunks) {
  ParallelCopier copier(3, /*chunk_bytes=*/1000);
  ExpectCopied(copier, {1, 999, 1000, 1001, 123457, 0, 64000});
}

TEST(ParallelCopierTest, EmptyAndSmallBatchesAndNoHelpers) {
  ParallelCopier copier(2, /*chunk_bytes=*/1000);
  copier.Run({});
  ExpectCopied(copier, {10});
  ParallelCopier alone(0, /*chunk_bytes=*/1000);
  ExpectCopied(alone, {5000, 77777});
}

TEST(ParallelCopierTest, CallersOnSeveralThreadsShareTheHelpers) {
  ParallelCopier copier(2, /*chunk_bytes=*/4096);
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&copier] {
      for (int round = 0; round < 20; ++round) ExpectCopied(copier, {100000, 4096 * 3 + 5});
    });
  }
  for (std::thread& t : callers) t.join();
}

// Copy::also: the same bytes land in a second destination, chunk by chunk (a range larger than
// the 256 KiB pieces the copier splits its chunks into, and ragged ends), nothing past either.
TEST(ParallelCopierTest, AlsoWritesASecondDestination) {
  ParallelCopier copier(2, /*chunk_bytes=*/300000);
  for (size_t bytes : {size_t{1}, size_t{299999}, size_t{1} << 20, (size_t{1} << 20) + 17}) {
    const std::vector<uint8_t> src = Pattern(bytes, 3);
    std::vector<uint8_t> dst(bytes + 1, 0xEE), also(bytes + 1, 0xDD);
    copier.Run({{dst.data(), src.data(), bytes, also.data()}});
    EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin())) << bytes;
    EXPECT_TRUE(std::equal(src.begin(), src.end(), also.begin())) << bytes;
    EXPECT_EQ(dst.back(), 0xEE) << bytes;
    EXPECT_EQ(also.back(), 0xDD) << bytes;
  }
}

TEST(ParallelCopierTest, SharedCopierCopies) {
  ExpectCopied(ParallelCopier::Shared(), {size_t{9} << 20, 3});
}

}  // namespace
}  // namespace flatshard::server
