#pragma once
// TransitionLane over gRPC's callback API (proto/flatshard/v1/transition_lane.proto): the
// steady state's unit transitions as messages on one stream per client, each run exactly as
// ShardService.Summon (ShardServiceImpl::RunSummon: same checks, caller identity, inline or
// posted body, errors). A message costs one HTTP/2 data frame each way where a unary call
// also opens a stream and sends headers and trailers: the transition's round trip falls below
// one empty Ping's. One request at a time per stream, answered in order.
// Thread-safe.

#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "flatshard/v1/transition_lane.grpc.pb.h"

namespace flatshard::server {

class ShardServiceImpl;
class LaneReactor;

class TransitionLaneService final : public v1::TransitionLane::CallbackService {
 public:
  // `summons` runs every request; it must outlive the service.
  explicit TransitionLaneService(ShardServiceImpl* summons);

  grpc::ServerBidiReactor<v1::LaneRequest, v1::LaneReply>* Transitions(
      grpc::CallbackServerContext* ctx) override;

  // Ends every open lane (UNAVAILABLE): an idle one at once, a busy one once its request was
  // answered; new lanes are refused. Called before the server's shutdown, which would
  // otherwise wait its whole grace for streams that clients keep open.
  void Shutdown();

 private:
  friend class LaneReactor;
  // False when shutting down (the lane then ends at once).
  bool Add(LaneReactor* lane);
  void Remove(LaneReactor* lane);

  ShardServiceImpl* const summons_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::set<LaneReactor*> lanes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server
