#pragma once
// ClientOptions::address as the gRPC target Client::Connect dials (README "Connect a
// trainer"): gRPC targets as given, a filesystem path as "unix:<path>", host:port as given,
// anything else INVALID_ARGUMENT at once (gRPC would only time out on it).

#include <string>

#include "absl/status/statusor.h"

namespace flatshard::client::internal {

absl::StatusOr<std::string> ChannelTarget(const std::string& address);

}  // namespace flatshard::client::internal
