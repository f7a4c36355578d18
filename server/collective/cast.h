#pragma once
// Element-wise dtype conversion between the floating dtypes, for mixed precision: a full
// precision shard into its low-precision all-gather input, a low-precision reduced gradient
// into the full-precision gradient shard. Rounds to nearest even (float16, bfloat16; float64
// to a narrower dtype goes through float32, as torch's .to() does for bfloat16); NaN stays
// NaN, float16 overflow becomes Inf. Thread-safe: a pure function.

#include <cstddef>

#include "common/dtype.h"

namespace flatshard::collective {

// dst[i] = (to) src[i] for i in [0, count). `src` and `dst` do not overlap.
// REQUIRES: IsFloatingPoint(from) and IsFloatingPoint(to).
void CastInto(DType from, const void* src, DType to, void* dst, size_t count);

}  // namespace flatshard::collective
