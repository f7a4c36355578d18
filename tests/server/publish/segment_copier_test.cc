// CopyRanges and ConvertRange (server/publish/segment_copier.h): chunks shared by threads
// copy every byte of every range exactly once, and the vectorized casts give the bits of the
// collectives' scalar conversions (round to nearest even, NaN quiet, infinities kept).

#include "server/publish/segment_copier.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "server/collective/reduce.h"

namespace flatshard::server {
namespace {

TEST(SegmentCopierTest, ChunksOnThreadsCopyEveryRangeOnce) {
  std::mt19937 rng(7);
  std::vector<float> src(100003);
  for (float& f : src) f = static_cast<float>(rng() % 1000) * 0.25f;
  // Three ranges of odd sizes into one destination, one cast to bfloat16, cut into chunks
  // of 4 KiB (many per range) on 3 threads.
  std::vector<char> dst(src.size() * 4 + 4096, 0x55);
  std::vector<CopyRange> ranges = {
      {src.data(), DType::kFloat32, dst.data(), DType::kFloat32, 50001},
      {src.data() + 50001, DType::kFloat32, dst.data() + 50001 * 4, DType::kBFloat16, 30000},
      {src.data() + 80001, DType::kFloat32, dst.data() + 50001 * 4 + 60000, DType::kFloat32,
       20002}};
  CopyRanges(ranges, 3, 4096);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 50001 * 4), 0);
  for (int64_t i = 0; i < 30000; ++i) {
    uint16_t got = 0;
    std::memcpy(&got, dst.data() + 50001 * 4 + i * 2, 2);
    ASSERT_EQ(got, collective::FloatToBFloat16(src[50001 + i])) << i;
  }
  EXPECT_EQ(std::memcmp(dst.data() + 50001 * 4 + 60000, src.data() + 80001, 20002 * 4), 0);
  const size_t end = 50001 * 4 + 60000 + 20002 * 4;
  for (size_t i = end; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0x55) << "written past " << end;
}

TEST(SegmentCopierTest, FastCastsMatchTheScalarConversionsBitForBit) {
  std::mt19937 rng(11);
  std::vector<float> f;
  for (int i = 0; i < 200000; ++i) f.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (float x : {0.0f, -0.0f, 1.0f, 1.00390625f, 1.01171875f, 65504.0f, 1e-8f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(),
                  std::bit_cast<float>(0x7f800001u) /* signalling NaN */}) {
    f.push_back(x);
  }
  std::vector<uint16_t> b(f.size()), h(f.size());
  ConvertRange(DType::kFloat32, f.data(), DType::kBFloat16, b.data(), f.size());
  ConvertRange(DType::kFloat32, f.data(), DType::kFloat16, h.data(), f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(b[i], collective::FloatToBFloat16(f[i])) << std::bit_cast<uint32_t>(f[i]);
    ASSERT_EQ(h[i], collective::FloatToHalf(f[i])) << std::bit_cast<uint32_t>(f[i]);
  }
  std::vector<float> back(f.size());
  ConvertRange(DType::kBFloat16, b.data(), DType::kFloat32, back.data(), b.size());
  for (size_t i = 0; i < f.size(); ++i) {
    const float want = collective::BFloat16ToFloat(b[i]);
    ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(want)) << i;
  }
}

}  // namespace
}  // namespace flatshard::server
