#pragma once
// ClientOptions::address as the gRPC target Client::Connect dials (README "Connect a
// trainer"): gRPC targets as given, a filesystem path as "unix:<path>", host:port as given,
// anything else INVALID_ARGUMENT at once (gRPC would only time out on it).

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "flatshard/client.h"

namespace flatshard::client::internal {

absl::StatusOr<std::string> ChannelTarget(const std::string& address);

// The credentials Connect dials `options.address` (already a ChannelTarget) with: mutual TLS
// from ClientOptions::tls_* (the three PEM files read now; INVALID_ARGUMENT naming a missing
// one) off the Unix socket when any is set, insecure otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options);

}  // namespace flatshard::client::internal
