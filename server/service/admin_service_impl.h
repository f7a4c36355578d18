#pragma once
// AdminService over gRPC's callback API: read-only views of the daemon for operators
// (`flatshardctl pending`). Answers from snapshots; never waits on other ranks. Thread-safe.

#include "flatshard/v1/admin_service.grpc.pb.h"
#include "server/group_manager.h"

namespace flatshard::server {

class AdminServiceImpl final : public v1::AdminService::CallbackService {
 public:
  explicit AdminServiceImpl(GroupManager* groups) : groups_(groups) {}

  grpc::ServerUnaryReactor* ListPendingCollectives(
      grpc::CallbackServerContext* ctx, const v1::ListPendingCollectivesRequest* request,
      v1::ListPendingCollectivesResponse* response) override;

 private:
  GroupManager* const groups_;
};

}  // namespace flatshard::server
