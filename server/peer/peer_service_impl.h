#pragma once
// PeerService over gRPC's callback API: the coordinator side of the peer control plane. Thin:
// it converts requests and hands them to a Coordinator. Rendezvous answers from the
// coordinator's callback, so no gRPC thread waits while ranks gather. Watch is a bidi stream
// per daemon: the first message names the daemon, then heartbeats flow both ways every
// `heartbeat_interval`; pushed tables and failures share the stream. The daemon also Pings
// every interval outside the stream (see PeerServiceBase). One internal thread sends
// the heartbeats and runs the coordinator's deadlines (rendezvous deadlines, silent daemons).
//
// Thread safety: thread-safe.
//
// Lifetime: call Shutdown() before shutting the grpc::Server down (open Watch streams would
// otherwise keep Server::Shutdown() without a deadline waiting), and destroy the service only
// after the server has shut down.

#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flatshard/v1/peer_service.grpc.pb.h"
#include "server/peer/coordinator.h"
#include "server/peer/peer_client.h"

namespace flatshard::server::peer {

// Every method on gRPC's callback API but Ping, which is synchronous: it runs on the server's
// own synchronous threads, so a daemon's liveness is heard even while every callback thread of
// this process is busy in a long handler.
using PeerServiceBase = v1::PeerService::WithCallbackMethod_Rendezvous<
    v1::PeerService::WithCallbackMethod_Depart<v1::PeerService::WithCallbackMethod_Watch<
        v1::PeerService::WithCallbackMethod_ReportFailure<v1::PeerService::Service>>>>;

class PeerServiceImpl final : public PeerServiceBase {
 public:
  // Rendezvous calls without an RPC deadline wait at most this long.
  static constexpr absl::Duration kDefaultRendezvousWait = absl::Seconds(60);

  // Uses `options.heartbeat_interval` and `options.peer_timeout`; `credentials` are the
  // client side's and are ignored here.
  explicit PeerServiceImpl(PeerOptions options);
  // Shutdown(), then joins the internal thread.
  ~PeerServiceImpl() override;
  PeerServiceImpl(const PeerServiceImpl&) = delete;
  PeerServiceImpl& operator=(const PeerServiceImpl&) = delete;

  // Pending rendezvous calls fail with UNAVAILABLE, Watch streams finish with UNAVAILABLE,
  // later calls are refused with UNAVAILABLE. Idempotent.
  void Shutdown();

  // The groups this daemon coordinates (for the admin service and tests).
  Coordinator& coordinator() { return coordinator_; }

  grpc::ServerUnaryReactor* Rendezvous(grpc::CallbackServerContext* ctx,
                                       const v1::RendezvousRequest* request,
                                       v1::RendezvousResponse* response) override;
  grpc::ServerUnaryReactor* Depart(grpc::CallbackServerContext* ctx,
                                   const v1::DepartRequest* request,
                                   v1::DepartResponse* response) override;
  grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent>* Watch(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ReportFailure(grpc::CallbackServerContext* ctx,
                                          const v1::ReportFailureRequest* request,
                                          v1::ReportFailureResponse* response) override;
  // OK when `daemon_id` has a Watch stream here (its heartbeat is counted), NOT_FOUND otherwise.
  grpc::Status Ping(grpc::ServerContext* ctx, const v1::PeerPingRequest* request,
                    v1::PeerPingResponse* response) override;

 private:
  class WatchReactor;
  friend class WatchReactor;

  void TimerLoop();
  void Wake();
  void Forget(WatchReactor* reactor);

  const PeerOptions options_;
  Coordinator coordinator_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  // Open streams, for heartbeats. Weak: a stream lives until gRPC is done with it.
  absl::flat_hash_map<WatchReactor*, std::weak_ptr<WatchReactor>> streams_ ABSL_GUARDED_BY(mu_);
  absl::Mutex join_mu_;  // serializes Shutdown()'s join
  std::thread timer_;
};

}  // namespace flatshard::server::peer
