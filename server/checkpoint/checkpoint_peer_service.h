#pragma once
// CheckpointPeerService (proto/flatshard/v1/checkpoint_peer.proto) on the peer port: another
// daemon of a multi-daemon group asks this one to write or load its ranks' part of a
// checkpoint (GroupManager::SaveCheckpoint / LoadCheckpoint with CheckpointArgs::from_peer).
// The work is file I/O: it runs on a thread per call, never on a reactor thread. Thread-safe.

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "flatshard/v1/checkpoint_peer.grpc.pb.h"
#include "server/group_manager.h"

namespace flatshard::server {

class CheckpointPeerServiceImpl final : public v1::CheckpointPeerService::CallbackService {
 public:
  CheckpointPeerServiceImpl() = default;
  ~CheckpointPeerServiceImpl() override { Stop(); }

  // The manager calls go to; until set (the daemon makes it after the peer port), UNAVAILABLE.
  void SetGroups(GroupManager* groups) { groups_.store(groups); }
  // Waits for the calls in flight; later calls answer UNAVAILABLE. Before the manager goes.
  void Stop();

  grpc::ServerUnaryReactor* WriteRanks(grpc::CallbackServerContext* ctx,
                                       const v1::CheckpointRanksRequest* request,
                                       v1::CheckpointRanksResponse* response) override;
  grpc::ServerUnaryReactor* LoadRanks(grpc::CallbackServerContext* ctx,
                                      const v1::CheckpointRanksRequest* request,
                                      v1::CheckpointRanksResponse* response) override;

 private:
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* ctx,
                                const v1::CheckpointRanksRequest* request,
                                v1::CheckpointRanksResponse* response, bool load);

  std::atomic<GroupManager*> groups_{nullptr};
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server
