#pragma once
// The values the weights tests write into shards: one definition for the one-daemon
// (weights_testing.h) and the multi-daemon (weights_multi_testing.h) fixtures.

#include <cstdint>

#include "flatshard/client.h"
#include "gtest/gtest.h"

namespace flatshard::client::weights_testing {

// Element e of unit u's flat buffer at "step" s: small multiples of 0.5, exact in bfloat16.
inline float Pattern(int32_t u, int64_t e, int s) {
  return static_cast<float>((e * 7 + u * 3 + s) % 64) * 0.5f;
}

// Writes Pattern(.., step) into this rank's live shards.
inline void FillShards(const ShardViews& views, int step) {
  for (const UnitShardView& u : views) {
    ASSERT_EQ(u.dtype, DType::kFloat32);
    float* p = static_cast<float*>(u.data);
    for (int64_t i = 0; i < u.shard_numel; ++i) p[i] = Pattern(u.unit, u.shard_offset + i, step);
  }
}

}  // namespace flatshard::client::weights_testing
