#pragma once
// The client's transition lane: Summons (with the summons they end first) as messages on one
// TransitionLane stream per client (proto/flatshard/v1/transition_lane.proto), opened on
// first use and reopened after it broke. A message costs less than a unary call (no stream
// setup, headers or trailers), which is what brings a unit transition under one empty Ping.
// The daemon runs each request exactly as the unary Summon, so the lane changes no outcome:
// where it cannot take a request before sending it (busy with another thread's, its stream
// found closed, a daemon without the service), the caller makes the unary call instead.
// FLATSHARD_NO_TRANSITION_LANE=1 in the environment turns the lane off (every Summon unary),
// for comparisons and for a network path that breaks long-lived streams.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flatshard/v1/transition_lane.grpc.pb.h"

namespace flatshard::client::internal {

class TransitionLane {
 public:
  explicit TransitionLane(std::shared_ptr<grpc::Channel> channel);
  TransitionLane(const TransitionLane&) = delete;
  TransitionLane& operator=(const TransitionLane&) = delete;
  ~TransitionLane();  // cancels the stream (the daemon ends its side at once)

  // Sends `request` on the lane and waits for its reply, at most `timeout`. std::nullopt:
  // the lane did not take it and nothing reached the daemon; make the unary call. Otherwise
  // the Summon's status (`response` filled when OK): its own, or, when the stream broke after
  // the request went out, UNAVAILABLE (its outcome unknown, as a unary call that lost its
  // connection), or DEADLINE_EXCEEDED after `timeout` (the stream is then cancelled).
  // Thread-safe: a second thread's request while one is in flight gets std::nullopt.
  std::optional<absl::Status> Summon(const v1::SummonRequest& request, v1::SummonResponse* response,
                                     absl::Duration timeout);

 private:
  using Stream = grpc::ClientReaderWriter<v1::LaneRequest, v1::LaneReply>;

  std::optional<absl::Status> SummonLocked(const v1::SummonRequest& request,
                                           v1::SummonResponse* response, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cancels the stream of a request past its deadline; polls (kWatchPeriod) while one runs.
  void Watch();
  // Ends the stream (cancelling it first when `cancel`) and returns its final status.
  grpc::Status CloseStream(bool cancel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::TransitionLane::Stub> stub_;

  // Held for a whole request (TryLock: a busy lane is skipped, never waited for).
  absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(watch_mu_);
  std::unique_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Stream> stream_ ABSL_GUARDED_BY(mu_);
  // The daemon has no lane, or FLATSHARD_NO_TRANSITION_LANE: unary only.
  bool unsupported_ ABSL_GUARDED_BY(mu_) = false;

  // The watchdog's view of the request in flight.
  absl::Mutex watch_mu_;
  grpc::ClientContext* watched_ ABSL_GUARDED_BY(watch_mu_) = nullptr;
  absl::Time watch_deadline_ ABSL_GUARDED_BY(watch_mu_);
  bool timed_out_ ABSL_GUARDED_BY(watch_mu_) = false;
  bool stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watchdog_;  // started with the first stream
};

}  // namespace flatshard::client::internal
