// Reduction kernels and half-precision conversions, checked against the compiler's _Float16
// and a direct bfloat16 rounding.

#include "server/collective/reduce.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace flatshard::collective {
namespace {

uint16_t CompilerHalf(float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); }

TEST(ReduceTest, HalfConversionsRoundTripEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const float want = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(h)));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(f), std::bit_cast<uint32_t>(want)) << h;
    ASSERT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(ReduceTest, FloatToHalfRoundsToNearestEvenLikeTheCompiler) {
  // Every float32 bit pattern in steps that hit all exponents and many rounding cases.
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4093) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(u));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), CompilerHalf(f)) << std::hexfloat << f;
  }
  // Ties: 1 + 2^-11 lies halfway between 1 and the next half; rounds to even (1).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // overflows to infinity
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
}

TEST(ReduceTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, to even
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, to even
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(BFloat16ToFloat(0x4049), std::bit_cast<float>(0x40490000u));
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
}

TEST(ReduceTest, SumAndAvgOfFloat32InSourceOrder) {
  std::vector<float> a = {1, 2, 3}, b = {10, 20, 30}, c = {100, 200, 301};
  std::vector<float> out(3);
  const void* srcs[] = {a.data(), b.data(), c.data()};
  ReduceInto(DType::kFloat32, srcs, out.data(), 3, ReduceOp::kSum, 3);
  EXPECT_EQ(out, (std::vector<float>{111, 222, 334}));
  ReduceInto(DType::kFloat32, srcs, out.data(), 3, ReduceOp::kAvg, 3);
  EXPECT_EQ(out, (std::vector<float>{37, 74, 334.0f / 3.0f}));
}

TEST(ReduceTest, HalfTypesAccumulateInFloatAndRoundOnce) {
  // 2048 + 1 + 1 in float16 step by step is 2048 (ties to even twice); accumulated in float32
  // and rounded once it is 2050.
  std::vector<uint16_t> a = {FloatToHalf(2048)}, b = {FloatToHalf(1)}, c = {FloatToHalf(1)};
  uint16_t out = 0;
  const void* srcs[] = {a.data(), b.data(), c.data()};
  ReduceInto(DType::kFloat16, srcs, &out, 1, ReduceOp::kSum, 1);
  EXPECT_EQ(HalfToFloat(out), 2050.0f);
  // bfloat16: 256 + 1 + 1 = 258 exactly representable only via one rounding.
  std::vector<uint16_t> x = {FloatToBFloat16(256)}, y = {FloatToBFloat16(1)};
  const void* bsrcs[] = {x.data(), y.data(), y.data()};
  ReduceInto(DType::kBFloat16, bsrcs, &out, 1, ReduceOp::kSum, 1);
  EXPECT_EQ(BFloat16ToFloat(out), 258.0f);
  ReduceInto(DType::kBFloat16, bsrcs, &out, 1, ReduceOp::kAvg, 3);
  EXPECT_EQ(out, FloatToBFloat16(258.0f / 3.0f));
}

TEST(ReduceTest, Float64AndInPlaceDestination) {
  std::vector<double> a(5000), b(5000);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<double>(i);
    b[i] = 0.5;
  }
  const void* srcs[] = {a.data(), b.data()};
  ReduceInto(DType::kFloat64, srcs, a.data(), a.size(), ReduceOp::kAvg, 2);  // dst == srcs[0]
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], (static_cast<double>(i) + 0.5) / 2);
}

}  // namespace
}  // namespace flatshard::collective
