#pragma once
// What every daemon of a multi-daemon group must share before the group forms (issue 27).
//
// Daemons whose remote backends would run one op differently (UCX's hierarchical all-gather on
// one, the flat ring on another: --ucx_hierarchical) never match each other's messages: their
// first all-gather would fail on a size mismatch or at the deadline. Each daemon checks the
// coordinator's peer table instead, so every rank's join fails at once with one message that
// names both daemons. Thread-safe: a pure function.

#include "absl/status/status.h"
#include "server/peer/peer_client.h"

namespace flatshard::server {

// FAILED_PRECONDITION naming rank 0's daemon and the first daemon whose
// DaemonIdentity::collective_settings differ from it (node, id, ranks, settings); OK when all
// agree, and for tables whose device memory moves over NCCL (no remote backend runs the ops).
absl::Status CheckDaemonsAgree(const peer::PeerTable& table);

}  // namespace flatshard::server
