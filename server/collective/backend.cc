#include "server/collective/backend.h"

#include <utility>

namespace flatshard::collective {

absl::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kHostPinned:
      return "host_pinned";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

absl::string_view CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "AllGather";
    case CollectiveKind::kReduceScatter:
      return "ReduceScatter";
    case CollectiveKind::kBroadcast:
      return "Broadcast";
    case CollectiveKind::kGather:
      return "Gather";
    case CollectiveKind::kAllReduce:
      return "AllReduce";
  }
  return "Unknown";
}

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "unknown";
}

GroupSpec GroupSpec::AllLocal(std::string group_id, int world_size) {
  GroupSpec spec;
  spec.group_id = std::move(group_id);
  spec.world_size = world_size;
  for (int r = 0; r < world_size; ++r) spec.local_ranks.push_back(r);
  return spec;
}

}  // namespace flatshard::collective
