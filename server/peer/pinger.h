#pragma once
// Pinger: PeerService.Ping calls to coordinators, on a CompletionQueue and a thread of its own
// rather than gRPC's callback threads. Those threads are shared by every callback service and
// stream of the process (two of them on a 2-core host), and a trainer's call that allocates a
// GiB there keeps them busy for seconds; a heartbeat that needs them would be late, and a live
// daemon declared dead (issue 27). A ping needs neither side's callback threads.
//
// Thread safety: thread-safe. `answered` callbacks run on the pinger's thread, never under its
// lock; they must not block.

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flatshard/v1/peer_service.grpc.pb.h"

namespace flatshard::server::peer {

class Pinger {
 public:
  // Pings name `daemon_id`; each gives up after `timeout`.
  Pinger(std::string daemon_id, absl::Duration timeout);
  // Close().
  ~Pinger();
  Pinger(const Pinger&) = delete;
  Pinger& operator=(const Pinger&) = delete;

  // Pings through `stub` (which must outlive the call) unless a ping of `key` is still in
  // flight. `answered` runs once the coordinator answers OK; not for an error (an older
  // coordinator without Ping, a daemon it does not know, a timeout). No-op after Close().
  void Ping(const void* key, v1::PeerService::Stub* stub, absl::AnyInvocable<void()> answered);

  // Cancels the pings in flight and joins the thread. Idempotent; not from an `answered`.
  void Close();

 private:
  struct Call;
  void Loop();

  const std::string daemon_id_;
  const absl::Duration timeout_;
  grpc::CompletionQueue cq_;
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<const void*, std::unique_ptr<Call>> in_flight_ ABSL_GUARDED_BY(mu_);
  absl::Mutex join_mu_;  // serializes Close()'s join
  std::thread thread_;
};

}  // namespace flatshard::server::peer
