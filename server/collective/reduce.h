#pragma once
// Element-wise reduction kernels for ReduceScatter, shared by every backend that reduces on
// the host. float16 and bfloat16 accumulate in float32 and round once to nearest even;
// float32 accumulates in float32 and float64 in float64, in source order. Thread-safe: pure
// functions; callers parallelise by splitting ranges.

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "common/dtype.h"
#include "server/collective/backend.h"

namespace flatshard::collective {

// dst[i] = srcs[0][i] + srcs[1][i] + ... (in that order) for i in [0, count); with kAvg the
// sum is then divided by `divisor`. `dst` may equal one of `srcs` (exactly, not partially
// overlapping). REQUIRES: IsFloatingPoint(dtype), srcs non-empty, divisor >= 1.
void ReduceInto(DType dtype, absl::Span<const void* const> srcs, void* dst, size_t count,
                ReduceOp op, int divisor);

// Conversions used by the kernels (exposed for tests). Round to nearest even; NaN stays NaN.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace flatshard::collective
