#include "client/checkpoint_call.h"

#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace flatshard::client::internal {
namespace {

// One checkpoint RPC (AdminService.SaveCheckpoint / LoadCheckpoint) on the client's channel:
// reads the progress stream to its end.
template <typename Request>
absl::StatusOr<Client::CheckpointInfo> RunCheckpointCall(
    const std::shared_ptr<grpc::Channel>& channel, const Request& request,
    std::unique_ptr<grpc::ClientReader<v1::CheckpointProgress>> (v1::AdminService::Stub::*rpc)(
        grpc::ClientContext*, const Request&),
    const Client::CheckpointProgressFn& progress) {
  auto stub = v1::AdminService::NewStub(channel);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::CheckpointProgress>> reader =
      ((*stub).*rpc)(&ctx, request);
  v1::CheckpointProgress p, last;
  bool any = false;
  while (reader->Read(&p)) {
    last = p;
    any = true;
    if (progress) progress(p.done_bytes(), p.total_bytes());
  }
  FS_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  if (!any || !last.done()) {
    return absl::InternalError("the daemon ended the checkpoint stream without a result");
  }
  Client::CheckpointInfo info;
  info.generation = last.generation();
  info.bytes = last.total_bytes();
  info.files = last.files();
  info.ranks = last.ranks();
  info.unused_tensors = last.unused_tensors();
  info.path = last.dir();
  return info;
}

}  // namespace

absl::StatusOr<Client::CheckpointInfo> SaveCheckpointCall(
    const std::shared_ptr<grpc::Channel>& channel, const v1::SaveCheckpointRequest& request,
    const Client::CheckpointProgressFn& progress) {
  return RunCheckpointCall(channel, request, &v1::AdminService::Stub::SaveCheckpoint, progress);
}

absl::StatusOr<Client::CheckpointInfo> LoadCheckpointCall(
    const std::shared_ptr<grpc::Channel>& channel, const v1::LoadCheckpointRequest& request,
    const Client::CheckpointProgressFn& progress) {
  return RunCheckpointCall(channel, request, &v1::AdminService::Stub::LoadCheckpoint, progress);
}

}  // namespace flatshard::client::internal
