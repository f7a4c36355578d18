#include "server/metrics/daemon_gauges.h"

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "server/gpu/device_pool.h"
#include "server/group_manager.h"
#include "server/metrics/daemon_metrics.h"
#include "server/shard_store.h"

namespace flatshard::server {

void UpdateDaemonGauges(const ShardStore& store, const GroupManager& groups) {
  const metrics::DaemonMetrics& m = metrics::GetDaemonMetrics();
  const MemoryUsage usage = store.Usage();
  for (int k = 0; k < kNumBufferKinds; ++k) {
    const auto kind = static_cast<BufferKind>(k);
    m.memory_bytes.WithLabels({BufferKindName(kind)}).Set(static_cast<double>(usage.bytes(kind)));
  }
  // The default limit is "none" (INT64_MAX); show it as 0 as the flag does.
  const int64_t limit =
      usage.limit_bytes == std::numeric_limits<int64_t>::max() ? 0 : usage.limit_bytes;
  m.memory_limit.WithLabels({}).Set(static_cast<double>(limit));
  m.memory_buffers.WithLabels({}).Set(static_cast<double>(usage.buffers));
  for (const std::shared_ptr<gpu::DevicePool>& pool : store.options().device_pools) {
    if (pool == nullptr) continue;
    const gpu::DevicePoolUsage u = pool->Usage();
    const std::string device = std::to_string(pool->device());
    m.gpu_memory.WithLabels({device, "reserved"}).Set(static_cast<double>(u.reserved_bytes));
    m.gpu_memory.WithLabels({device, "in_use"}).Set(static_cast<double>(u.in_use_bytes));
    m.gpu_memory.WithLabels({device, "limit"})
        .Set(u.limit_bytes == std::numeric_limits<int64_t>::max()
                 ? 0.0
                 : static_cast<double>(u.limit_bytes));
  }
  int64_t clients = 0;
  const std::vector<GroupManager::GroupInfo> list = groups.ListGroups();
  for (const GroupManager::GroupInfo& g : list)
    clients += static_cast<int64_t>(g.joined_ranks.size());
  m.groups.WithLabels({}).Set(static_cast<double>(list.size()));
  m.clients.WithLabels({}).Set(static_cast<double>(clients));
}

}  // namespace flatshard::server
