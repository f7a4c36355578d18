#pragma once
// Sets the daemon's gauges (memory by kind and limit, groups, clients) from the ShardStore
// and the GroupManager; the metrics endpoint calls it before each render. Thread-safe.

namespace flatshard::server {

class GroupManager;
class ShardStore;

void UpdateDaemonGauges(const ShardStore& store, const GroupManager& groups);

}  // namespace flatshard::server
