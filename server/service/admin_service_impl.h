#pragma once
// AdminService over gRPC's callback API: views of the daemon for operators (`flatshardctl
// status`, `groups`, `units`, `pending`) and levers (`drain`, `undrain`, `log-level`,
// `delete-group`). The views answer
// from snapshots and never wait on other ranks. Thread-safe.

#include <functional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "server/access/access_control.h"
#include "server/group_manager.h"
#include "server/service/request_workers.h"
#include "server/shard_store.h"

namespace flatshard::server {

struct AdminServiceOptions {
  ShardStore* store = nullptr;  // memory in GetStatus; null: reported as empty
  std::string peer_address;     // this daemon's PeerService ("" without one)
  std::string node;             // its node name in peer tables
  std::string state_dir;        // where its records go; empty: ephemeral
  absl::Time start_time = absl::Now();
  // Called when a Drain starts (the daemon marks its health NOT_SERVING) and when an Undrain
  // ends a drain (SERVING again): the argument is whether it now drains.
  std::function<void(bool draining)> on_drain;
  // How often Drain looks at the work in flight.
  absl::Duration drain_poll = absl::Milliseconds(100);
  // Who may change the daemon (Drain, SetLogLevel): over the Unix socket only root and the
  // daemon's own uid; over TCP whoever got through (loopback, or mutual TLS). Null: anyone.
  const access::AccessControl* access = nullptr;
  // Runs DeleteGroup (the group's segments unmapped and unlinked, its records removed).
  // Required; must outlive the service.
  RequestWorkers* workers = nullptr;
};

class AdminServiceImpl final : public v1::AdminService::CallbackService {
 public:
  explicit AdminServiceImpl(GroupManager* groups, AdminServiceOptions options = {});

  grpc::ServerUnaryReactor* ListPendingCollectives(
      grpc::CallbackServerContext* ctx, const v1::ListPendingCollectivesRequest* request,
      v1::ListPendingCollectivesResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* ListGroups(grpc::CallbackServerContext* ctx,
                                       const v1::ListGroupsRequest* request,
                                       v1::ListGroupsResponse* response) override;
  grpc::ServerUnaryReactor* ListUnits(grpc::CallbackServerContext* ctx,
                                      const v1::ListUnitsRequest* request,
                                      v1::ListUnitsResponse* response) override;
  grpc::ServerWriteReactor<v1::DrainProgress>* Drain(grpc::CallbackServerContext* ctx,
                                                     const v1::DrainRequest* request) override;
  grpc::ServerUnaryReactor* Undrain(grpc::CallbackServerContext* ctx,
                                    const v1::UndrainRequest* request,
                                    v1::UndrainResponse* response) override;
  grpc::ServerUnaryReactor* SetLogLevel(grpc::CallbackServerContext* ctx,
                                        const v1::SetLogLevelRequest* request,
                                        v1::SetLogLevelResponse* response) override;
  // The group's owner uid, root or the daemon's uid (over TCP: whoever got through, for the
  // groups created over TCP); see GroupManager::DeleteGroup.
  grpc::ServerUnaryReactor* DeleteGroup(grpc::CallbackServerContext* ctx,
                                        const v1::DeleteGroupRequest* request,
                                        v1::DeleteGroupResponse* response) override;
  // Checkpoints (GroupManager::SaveCheckpoint / LoadCheckpoint): the work runs on a thread of
  // its own; the stream reports its progress every 200 ms and ends with the result. The
  // group's uid, root or the daemon's uid (as DeleteGroup).
  grpc::ServerWriteReactor<v1::CheckpointProgress>* SaveCheckpoint(
      grpc::CallbackServerContext* ctx, const v1::SaveCheckpointRequest* request) override;
  grpc::ServerWriteReactor<v1::CheckpointProgress>* LoadCheckpoint(
      grpc::CallbackServerContext* ctx, const v1::LoadCheckpointRequest* request) override;

 private:
  GroupManager* const groups_;
  const AdminServiceOptions options_;
  std::vector<std::string> backends_;
  std::string node_;  // options_.node, or the host name
  // Orders Drain's and Undrain's flag-and-health updates, so the health always ends as the
  // last of them left the flag.
  absl::Mutex drain_mu_;
};

}  // namespace flatshard::server
