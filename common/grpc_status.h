#pragma once
// absl::Status <-> grpc::Status. The canonical codes are equal, so this is a cast plus the
// message. Thread-safe: pure functions.

#include <grpcpp/support/status.h>
#include "absl/status/status.h"

namespace flatshard {

// Trailing metadata key the daemon puts on every answer of its services (value "1"): a
// client that sees it knows the call reached the daemon and may have taken effect, so it must
// not retry it (client.cc Call). A failure without it came from the gRPC runtime.
inline constexpr char kDaemonAnswerKey[] = "flatshard-answer";

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace flatshard
