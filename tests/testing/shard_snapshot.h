#pragma once
// A copy of a rank's float32 shards and gradient shards, read through the client library
// (GetShardViews: local, no collective), for tests that check a failed collective changed
// nothing. Thread-compatible.

#include <vector>

#include "absl/status/statusor.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"

namespace flatshard::testing {

// Per unit, two entries: the shard's values, then the gradient shard's (empty when none).
inline std::vector<std::vector<float>> SnapshotShards(client::Client& client,
                                                      const std::string& module = "") {
  absl::StatusOr<client::ShardViews> views = client.GetShardViews(module);
  EXPECT_TRUE(views.ok()) << views.status();
  std::vector<std::vector<float>> out;
  if (!views.ok()) return out;
  for (const client::UnitShardView& u : *views) {
    const float* data = static_cast<const float*>(u.data);
    out.emplace_back(data, data + u.shard_numel);
    const float* grad = static_cast<const float*>(u.grad);
    out.push_back(grad == nullptr ? std::vector<float>()
                                  : std::vector<float>(grad, grad + u.shard_numel));
  }
  return out;
}

}  // namespace flatshard::testing
