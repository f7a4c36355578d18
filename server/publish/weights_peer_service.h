#pragma once
// WeightsPeerService (proto/flatshard/v1/weights_peer.proto) on the peer port: other daemons
// read this daemon's committed shards of a publish (ReadShards) and copy its versions
// (FetchVersion), and hear of new versions (WatchVersions). gRPC's synchronous API: a call is a
// thread of the server's pool that sends chunks as fast as the stream takes them, holding the
// copies (a hold on the committed shards, a reference on the version) until the last one is sent.
//
// Peers are trusted as for checkpoints: calls about a group carry its token; copies of a
// version by name carry the reader's uid (or token) and are checked as OpenWeights checks
// them. Thread-safe.

#include <atomic>

#include "absl/time/time.h"
#include "flatshard/v1/weights_peer.grpc.pb.h"

namespace flatshard::server {

class GroupManager;
class Publisher;
class PublishRounds;
class UcxWeightsLink;

class WeightsPeerServiceImpl final : public v1::WeightsPeerService::Service {
 public:
  // `testing_copy_pause` (tests only, --testing_weights_copy_pause): a copy of a version by
  // name sends its descriptor, then waits this long before the bytes (a source daemon can
  // be killed mid-copy).
  // `ucx` (null: none, --weights_transport=grpc or UCX unavailable): copies asked with `ucx`
  // get the segment's rkey instead of its bytes. Must outlive the server.
  // `testing_ucx_stall_after` (tests only, --testing_weights_ucx_stall_after; 0: never): the
  // Nth rkey this daemon sends stalls `ucx` first (UcxWeightsLink::StallForTesting), so the
  // copier's get stays in flight until this daemon is killed.
  explicit WeightsPeerServiceImpl(absl::Duration testing_copy_pause = absl::ZeroDuration(),
                                  UcxWeightsLink* ucx = nullptr, int testing_ucx_stall_after = 0)
      : testing_copy_pause_(testing_copy_pause),
        ucx_(ucx),
        testing_ucx_stall_after_(testing_ucx_stall_after) {}

  // Until set (the daemon makes them after the peer port), calls answer UNAVAILABLE. The
  // pointers must outlive the server (or Stop first).
  void SetTargets(GroupManager* groups, Publisher* publisher, PublishRounds* rounds);
  // Later calls answer UNAVAILABLE (the ones in flight end with their streams).
  void Stop() { stopped_.store(true); }

  grpc::Status ReadShards(grpc::ServerContext* ctx, const v1::ReadShardsRequest* request,
                          grpc::ServerWriter<v1::ShardChunk>* writer) override;
  // Asked with `ucx` (and this daemon has a UCX link): registers the segment, sends its rkey
  // and holds the version (and the registration) until the caller ends the call (its gets
  // done), Stop, or the call's deadline; checks every 5 ms.
  grpc::Status FetchVersion(grpc::ServerContext* ctx, const v1::FetchVersionRequest* request,
                            grpc::ServerWriter<v1::VersionChunk>* writer) override;
  // Holds a server thread for the stream's life (up to wait_ms); checks for a cancel or Stop
  // every 100 ms while no version comes.
  grpc::Status WatchVersions(grpc::ServerContext* ctx, const v1::WatchVersionsRequest* request,
                             grpc::ServerWriter<v1::PublishedVersion>* writer) override;

 private:
  std::atomic<GroupManager*> groups_{nullptr};
  std::atomic<Publisher*> publisher_{nullptr};
  std::atomic<PublishRounds*> rounds_{nullptr};
  std::atomic<bool> stopped_{false};
  const absl::Duration testing_copy_pause_;
  UcxWeightsLink* const ucx_;
  const int testing_ucx_stall_after_;
  std::atomic<int> rkeys_sent_{0};
};

}  // namespace flatshard::server
