#include "server/checkpoint/checkpoint_peer_client.h"

#include <thread>
#include <utility>

#include "common/dtype.h"
#include "common/grpc_status.h"
#include "flatshard/v1/checkpoint_peer.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace flatshard::server {

std::vector<absl::StatusOr<CheckpointResult>> CheckpointPeerClient::AskAll(
    const std::vector<std::string>& peers, const Ask& ask, bool load) const {
  std::vector<absl::StatusOr<CheckpointResult>> out(peers.size(), absl::UnknownError("not asked"));
  std::vector<std::thread> threads;
  for (size_t k = 0; k < peers.size(); ++k) {
    threads.emplace_back([&, k] {
      auto creds = credentials_ ? credentials_ : grpc::InsecureChannelCredentials();
      auto stub = v1::CheckpointPeerService::NewStub(grpc::CreateChannel(peers[k], creds));
      v1::CheckpointRanksRequest request;
      request.set_group(ask.group);
      request.set_token(ask.token);
      request.set_module(ask.module);
      request.set_dir(ask.dir);
      request.set_wait_ms(absl::ToInt64Milliseconds(ask.wait));
      v1::CheckpointRanksResponse response;
      grpc::ClientContext ctx;
      // The transfer has no deadline of its own; a daemon that dies ends the call.
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + ask.wait + absl::Hours(1)));
      const grpc::Status st = load ? stub->LoadRanks(&ctx, request, &response)
                                   : stub->WriteRanks(&ctx, request, &response);
      if (!st.ok()) {
        out[k] = FromGrpcStatus(st);
        return;
      }
      CheckpointResult r;
      r.generation = response.generation();
      r.bytes = response.bytes();
      r.ranks = response.ranks();
      for (const v1::CheckpointFile& f : response.files()) {
        r.written_files.push_back({f.name(), f.rank(), f.bytes(), f.crc32c()});
      }
      for (const v1::CheckpointTensor& t : response.tensors()) {
        r.written_tensors.push_back({t.rank(), t.unit(), t.name(),
                                     ParseDType(t.dtype()).value_or(DType::kUInt8), t.offset(),
                                     t.bytes()});
      }
      out[k] = std::move(r);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace flatshard::server
