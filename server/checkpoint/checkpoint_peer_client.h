#pragma once
// CheckpointPeerClient: asks the other daemons of a multi-daemon group to save or load their
// ranks' part of a checkpoint (CheckpointPeerService on their peer ports), in parallel.
//
// Thread-safe (no state but the credentials).

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "server/checkpoint/checkpoints.h"

namespace flatshard::server {

class CheckpointPeerClient {
 public:
  // `credentials`: how this daemon reaches the others' peer ports (null: insecure).
  explicit CheckpointPeerClient(std::shared_ptr<grpc::ChannelCredentials> credentials)
      : credentials_(std::move(credentials)) {}

  struct Ask {
    std::string group;
    std::string token;
    std::string module;
    std::string dir;
    absl::Duration wait;
  };
  // One answer per address of `peers`, in order; every call runs on a thread of its own and
  // this waits for all of them. A call has no deadline of its own beyond `wait` plus an hour
  // (a transfer); a daemon that dies ends it.
  std::vector<absl::StatusOr<CheckpointResult>> AskAll(const std::vector<std::string>& peers,
                                                       const Ask& ask, bool load) const;

 private:
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
};

}  // namespace flatshard::server
