#include "server/collective/reduce.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "common/logging.h"

namespace flatshard::collective {
namespace {

// Elements reduced per pass: the accumulator stays in L1 while every source streams through.
constexpr size_t kBlock = 1024;

struct F32 {
  using Storage = float;
  using Acc = float;
  static Acc Load(Storage v) { return v; }
  static Storage Store(Acc v) { return v; }
};
struct F64 {
  using Storage = double;
  using Acc = double;
  static Acc Load(Storage v) { return v; }
  static Storage Store(Acc v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(Storage v) { return HalfToFloat(v); }
  static Storage Store(Acc v) { return FloatToHalf(v); }
};
struct BF16 {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(Storage v) { return BFloat16ToFloat(v); }
  static Storage Store(Acc v) { return FloatToBFloat16(v); }
};

template <typename T>
void ReduceTyped(absl::Span<const void* const> srcs, void* dst_raw, size_t count, ReduceOp op,
                 int divisor) {
  using S = typename T::Storage;
  using A = typename T::Acc;
  S* dst = static_cast<S*>(dst_raw);
  const A div = static_cast<A>(divisor);
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const S* s0 = static_cast<const S*>(srcs[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = T::Load(s0[i]);
    for (size_t k = 1; k < srcs.size(); ++k) {
      const S* sk = static_cast<const S*>(srcs[k]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] += T::Load(sk[i]);
    }
    if (op == ReduceOp::kAvg) {
      for (size_t i = 0; i < n; ++i) acc[i] /= div;
    }
    // All reads of this block happened above, so dst may alias a source.
    S* d = dst + base;
    for (size_t i = 0; i < n; ++i) d[i] = T::Store(acc[i]);
  }
}

}  // namespace

// Branch-light conversions after F. Giesen, "half_to_float" / "float_to_half_fast3_rtne".
float HalfToFloat(uint16_t h) {
  constexpr uint32_t kShiftedExp = 0x7c00u << 13;
  const float magic = std::bit_cast<float>(113u << 23);
  uint32_t o = (static_cast<uint32_t>(h) & 0x7fffu) << 13;
  const uint32_t exp = kShiftedExp & o;
  o += (127u - 15u) << 23;
  if (exp == kShiftedExp) {
    o += (128u - 16u) << 23;  // Inf/NaN
  } else if (exp == 0) {
    o += 1u << 23;  // zero/subnormal: renormalise through the FPU
    o = std::bit_cast<uint32_t>(std::bit_cast<float>(o) - magic);
  }
  o |= (static_cast<uint32_t>(h) & 0x8000u) << 16;
  return std::bit_cast<float>(o);
}

uint16_t FloatToHalf(float f) {
  constexpr uint32_t kF32Infty = 255u << 23;
  constexpr uint32_t kF16Max = (127u + 16u) << 23;
  constexpr uint32_t kDenormMagicBits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= kF16Max) {
    o = (u > kF32Infty) ? 0x7e00 : 0x7c00;  // NaN stays NaN, overflow goes to Inf
  } else if (u < (113u << 23)) {
    // Result is subnormal or zero: let the FPU round the shifted-out bits.
    const float t = std::bit_cast<float>(u) + std::bit_cast<float>(kDenormMagicBits);
    o = static_cast<uint16_t>(std::bit_cast<uint32_t>(t) - kDenormMagicBits);
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu;  // rebias (wraps, as intended) and round
    u += mant_odd;
    o = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

float BFloat16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

void ReduceInto(DType dtype, absl::Span<const void* const> srcs, void* dst, size_t count,
                ReduceOp op, int divisor) {
  FS_CHECK(!srcs.empty() && divisor >= 1) << "bad reduction arguments";
  switch (dtype) {
    case DType::kFloat32:
      return ReduceTyped<F32>(srcs, dst, count, op, divisor);
    case DType::kFloat64:
      return ReduceTyped<F64>(srcs, dst, count, op, divisor);
    case DType::kFloat16:
      return ReduceTyped<F16>(srcs, dst, count, op, divisor);
    case DType::kBFloat16:
      return ReduceTyped<BF16>(srcs, dst, count, op, divisor);
    default:
      FS_CHECK(false) << "reduction over non-floating dtype " << DTypeName(dtype);
  }
}

}  // namespace flatshard::collective
