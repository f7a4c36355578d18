#pragma once
// Client::SaveCheckpoint / LoadCheckpoint / ImportSafetensors on the wire: one streaming
// AdminService call on the client's channel, its progress stream read to the end.

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "flatshard/client.h"
#include "flatshard/v1/admin_service.grpc.pb.h"

namespace flatshard::client::internal {

absl::StatusOr<Client::CheckpointInfo> SaveCheckpointCall(
    const std::shared_ptr<grpc::Channel>& channel, const v1::SaveCheckpointRequest& request,
    const Client::CheckpointProgressFn& progress);

// Loads a checkpoint directory or imports a safetensors file (request.safetensors).
absl::StatusOr<Client::CheckpointInfo> LoadCheckpointCall(
    const std::shared_ptr<grpc::Channel>& channel, const v1::LoadCheckpointRequest& request,
    const Client::CheckpointProgressFn& progress);

}  // namespace flatshard::client::internal
