#include "server/collective/cast.h"

#include <cstdint>
#include <cstring>

#include "common/logging.h"
#include "server/collective/reduce.h"

namespace flatshard::collective {
namespace {

// Widening loads: exact for float16, bfloat16 and float32 (all of them fit a double, and
// the first two a float).
double LoadWide(DType dtype, const void* src, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(src)[i];
    case DType::kFloat64:
      return static_cast<const double*>(src)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(src)[i]);
    default:
      FS_CHECK(false) << "cast from non-floating dtype " << DTypeName(dtype);
      return 0;
  }
}

template <typename Store>
void CastFrom(DType from, const void* src, size_t count, Store store) {
  // The common cases without the double round trip.
  if (from == DType::kFloat32) {
    const float* s = static_cast<const float*>(src);
    for (size_t i = 0; i < count; ++i) store(i, s[i]);
    return;
  }
  for (size_t i = 0; i < count; ++i) store(i, static_cast<float>(LoadWide(from, src, i)));
}

}  // namespace

void CastInto(DType from, const void* src, DType to, void* dst, size_t count) {
  if (from == to) {
    std::memcpy(dst, src, count * static_cast<size_t>(ItemSize(from)));
    return;
  }
  switch (to) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = static_cast<float>(LoadWide(from, src, i));
      return;
    }
    case DType::kFloat64: {
      double* d = static_cast<double*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = LoadWide(from, src, i);
      return;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return CastFrom(from, src, count, [d](size_t i, float v) { d[i] = FloatToHalf(v); });
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return CastFrom(from, src, count, [d](size_t i, float v) { d[i] = FloatToBFloat16(v); });
    }
    default:
      FS_CHECK(false) << "cast to non-floating dtype " << DTypeName(to);
  }
}

}  // namespace flatshard::collective
