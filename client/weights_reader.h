#pragma once
// Client internals of published weights (README "Publishing weights"): the Publish RPC of a
// joined Client, and the conversions WeightsReader shares with it.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "flatshard/v1/weights_service.grpc.pb.h"

namespace flatshard::client::internal {

// Client::Publish's RPC on `channel` for the session `caller` (deadline: `timeout`).
absl::StatusOr<PublishedVersion> PublishCall(const std::shared_ptr<grpc::Channel>& channel,
                                             const v1::Caller& caller, const std::string& module,
                                             const std::string& name, const PublishOptions& options,
                                             absl::Duration timeout);

PublishedVersion FromProto(const v1::PublishedVersion& v);

}  // namespace flatshard::client::internal
