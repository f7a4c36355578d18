#pragma once
// AccessControl: who is calling, as far as ShardService's admission rules are concerned.
//
// Calls over the Unix socket (accepted by UnixSocketAcceptor, peer "fd:<n>") carry the uid the
// kernel reported for the connecting process (SO_PEERCRED); when an allow-list is configured
// (--allowed_uids) other uids are refused with PERMISSION_DENIED. Calls over TCP (the remote
// client port, "ipv4:..." / "ipv6:...") have no uid: they get kRemoteUid, and are
// authenticated by mutual TLS when it is configured. Anything else (an unknown descriptor,
// another transport) is refused: UNAUTHENTICATED.
//
// GroupManager keeps groups apart with the uid: a group belongs to the uid of the rank that
// created it, and only that uid may join it or call into it (README "Access control").
// Thread-safe.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::server::access {

class UnixSocketAcceptor;

// The uid of callers that came over TCP (no kernel credentials); also what code that does
// not know the caller (unit tests of GroupManager) uses.
inline constexpr int64_t kRemoteUid = -1;

// Parses "1000,1001" (--allowed_uids; empty: no list). INVALID_ARGUMENT names the bad entry.
absl::StatusOr<std::vector<uid_t>> ParseUidList(absl::string_view list);

class AccessControl {
 public:
  // `acceptor` may be null (no Unix-socket callers: every "fd:" peer is refused).
  // `allowed_uids`: empty: every uid that can open the socket; else only these and the
  // daemon's own uid.
  AccessControl(const UnixSocketAcceptor* acceptor, std::vector<uid_t> allowed_uids);

  // The caller's uid (kRemoteUid over TCP) for gRPC peer string `peer` (ctx->peer()).
  absl::StatusOr<int64_t> CallerUid(absl::string_view peer) const;

 private:
  const UnixSocketAcceptor* const acceptor_;
  const std::vector<uid_t> allowed_uids_;
  const uid_t self_uid_;
};

}  // namespace flatshard::server::access
