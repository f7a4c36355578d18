#pragma once
// The views of a rank's shards from the daemon's answer (Register, GetShardViews): each unit's
// shard, gradient shard and optimizer state buffers mapped through the segment cache, their
// sizes checked against the plan.

#include <cstdint>

#include "absl/status/statusor.h"
#include "client/segment_cache.h"
#include "flatshard/client.h"
#include "flatshard/v1/shard_service.pb.h"

namespace flatshard::client::internal {

// Where a daemon's memory handle lies, for the segment cache.
SegmentRange ToRange(const v1::MemoryHandle& proto);

class ShardViewsBuilder {
 public:
  // `rank`'s views (sorted by unit) of `shards` with `state_specs`. INTERNAL when the answer
  // does not fit the plan (an unknown or repeated unit, a short range, a state count off its
  // spec); the mapping's errors.
  static absl::StatusOr<ShardViews> Build(
      const ModuleLayout& layout, int32_t rank,
      const google::protobuf::RepeatedPtrField<v1::UnitShard>& shards,
      const google::protobuf::RepeatedPtrField<v1::StateSpec>& state_specs, SegmentCache& cache);
};

}  // namespace flatshard::client::internal
