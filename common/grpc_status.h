#pragma once
// absl::Status <-> grpc::Status. The canonical codes are equal, so this is a cast plus the
// message. Thread-safe: pure functions.

#include "absl/status/status.h"
#include <grpcpp/support/status.h>

namespace flatshard {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace flatshard
