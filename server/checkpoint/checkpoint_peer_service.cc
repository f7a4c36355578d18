#include "server/checkpoint/checkpoint_peer_service.h"

#include "common/dtype.h"
#include "common/grpc_status.h"

namespace flatshard::server {

void CheckpointPeerServiceImpl::Stop() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
}

grpc::ServerUnaryReactor* CheckpointPeerServiceImpl::WriteRanks(
    grpc::CallbackServerContext* ctx, const v1::CheckpointRanksRequest* request,
    v1::CheckpointRanksResponse* response) {
  return Run(ctx, request, response, /*load=*/false);
}

grpc::ServerUnaryReactor* CheckpointPeerServiceImpl::LoadRanks(
    grpc::CallbackServerContext* ctx, const v1::CheckpointRanksRequest* request,
    v1::CheckpointRanksResponse* response) {
  return Run(ctx, request, response, /*load=*/true);
}

grpc::ServerUnaryReactor* CheckpointPeerServiceImpl::Run(grpc::CallbackServerContext* ctx,
                                                         const v1::CheckpointRanksRequest* request,
                                                         v1::CheckpointRanksResponse* response,
                                                         bool load) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  GroupManager* groups = groups_.load();
  GroupManager::CheckpointArgs args;
  args.group = request->group();
  args.module = request->module();
  args.dir = request->dir();
  args.token = request->token();
  args.from_peer = true;
  if (request->wait_ms() > 0) args.wait = absl::Milliseconds(request->wait_ms());
  absl::MutexLock lock(&mu_);
  if (groups == nullptr || stopped_) {
    reactor->Finish(ToGrpcStatus(absl::UnavailableError("flatshardd is not serving checkpoints")));
    return reactor;
  }
  threads_.emplace_back([groups, args, reactor, response, load] {
    GroupManager::CheckpointProgress progress;
    absl::StatusOr<GroupManager::CheckpointResult> r =
        load ? groups->LoadCheckpoint(args, &progress) : groups->SaveCheckpoint(args, &progress);
    if (!r.ok()) {
      reactor->Finish(ToGrpcStatus(r.status()));
      return;
    }
    response->set_generation(r->generation);
    response->set_bytes(r->bytes);
    response->set_ranks(r->ranks);
    for (const checkpoint::FileEntry& f : r->written_files) {
      v1::CheckpointFile* out = response->add_files();
      out->set_name(f.name);
      out->set_rank(f.rank);
      out->set_bytes(f.bytes);
      out->set_crc32c(f.crc32c);
    }
    for (const checkpoint::TensorEntry& t : r->written_tensors) {
      v1::CheckpointTensor* out = response->add_tensors();
      out->set_rank(t.rank);
      out->set_unit(t.unit);
      out->set_name(t.name);
      out->set_dtype(std::string(DTypeName(t.dtype)));
      out->set_offset(t.offset);
      out->set_bytes(t.bytes);
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

}  // namespace flatshard::server
