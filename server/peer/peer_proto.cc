#include "server/peer/peer_proto.h"

namespace flatshard::server::peer::internal {

void ToProto(const DaemonIdentity& d, v1::DaemonInfo* out) {
  out->set_node(d.node);
  out->set_daemon_id(d.daemon_id);
  out->set_peer_address(d.peer_address);
  out->set_backend_address(d.backend_address);
  out->set_nccl(d.nccl);
  out->set_collective_settings(d.collective_settings);
}

DaemonIdentity FromProto(const v1::DaemonInfo& d) {
  return DaemonIdentity{d.node(), d.daemon_id(),          d.peer_address(), d.backend_address(),
                        d.nccl(), d.collective_settings()};
}

void ToProto(const PeerTable& t, v1::PeerTable* out) {
  out->set_group(t.group);
  out->set_epoch(t.epoch);
  for (const DaemonIdentity& d : t.rank_daemons) ToProto(d, out->add_rank_daemons());
  for (const std::string& uuid : t.rank_devices) out->add_rank_devices(uuid);
  out->set_device_transport(t.device_transport);
  out->set_nccl_unique_id(t.nccl_unique_id);
  for (const std::optional<std::vector<std::string>>& modules : t.rank_modules) {
    v1::RankModules* m = out->add_rank_modules();
    m->set_reported(modules.has_value());
    if (modules) {
      for (const std::string& module : *modules) m->add_modules(module);
    }
  }
}

PeerTable FromProto(const v1::PeerTable& t) {
  PeerTable table;
  table.group = t.group();
  table.epoch = t.epoch();
  table.rank_daemons.reserve(t.rank_daemons_size());
  for (const v1::DaemonInfo& d : t.rank_daemons()) table.rank_daemons.push_back(FromProto(d));
  table.rank_devices.assign(t.rank_devices().begin(), t.rank_devices().end());
  table.device_transport = t.device_transport();
  table.nccl_unique_id = t.nccl_unique_id();
  for (const v1::RankModules& m : t.rank_modules()) {
    if (m.reported()) {
      table.rank_modules.emplace_back(
          std::vector<std::string>(m.modules().begin(), m.modules().end()));
    } else {
      table.rank_modules.emplace_back(std::nullopt);
    }
  }
  return table;
}

void ToProto(const std::string& group, uint64_t epoch, const absl::Status& status,
             v1::GroupFailure* out) {
  out->set_group(group);
  out->set_epoch(epoch);
  out->set_code(static_cast<int32_t>(status.code()));
  out->set_message(std::string(status.message()));
}

absl::Status StatusFromProto(const v1::GroupFailure& f) {
  int code = f.code();
  // 1..16 are the canonical error codes; OK or garbage would make the failure vanish.
  if (code < 1 || code > 16) code = static_cast<int>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), f.message());
}

}  // namespace flatshard::server::peer::internal
