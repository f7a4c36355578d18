#pragma once
// Conversions between the peer control plane's domain types (peer_client.h) and
// peer_service.proto. Internal to server/peer: the only peer code that sees both.
// Thread-safe: pure functions.

#include "flatshard/v1/peer_service.pb.h"
#include "server/peer/peer_client.h"

namespace flatshard::server::peer::internal {

void ToProto(const DaemonIdentity& d, v1::DaemonInfo* out);
DaemonIdentity FromProto(const v1::DaemonInfo& d);
void ToProto(const PeerTable& t, v1::PeerTable* out);
PeerTable FromProto(const v1::PeerTable& t);
void ToProto(const std::string& group, uint64_t epoch, const absl::Status& status,
             v1::GroupFailure* out);
// A failure's status; a code outside absl's canonical range reads as UNKNOWN.
absl::Status StatusFromProto(const v1::GroupFailure& f);

}  // namespace flatshard::server::peer::internal
