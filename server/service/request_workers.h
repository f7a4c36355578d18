#pragma once
// RequestWorkers: the threads on which the daemon's services (ShardService; AdminService's
// DeleteGroup, WeightsService's DropWeights and OpenWeights' lease releases) run the bodies of
// calls that may take long, so that no gRPC callback thread does that work. One per daemon
// (Daemon owns it).
//
// Why: gRPC runs every callback handler and stream of the process (ShardService, admin,
// weights, the peer streams) on a few shared threads (as many as cores, at most 16). A body
// that allocates a shard-sized buffer (shm creation, fallocate, cudaHostRegister: seconds for
// a GiB), plans a large model, or waits for a rank's last writeback copy held one of them for
// that long, and with two of them every other call of the daemon stalled (issue 27). The
// handler now validates its request inline (cheap, answered at once) and posts the rest here;
// the body finishes the reactor itself, or hands it to a collective's completion as before.
//
// Order: each caller (group, rank) is a strand of BlockingWorkers: its bodies run one at a time
// in the order the handlers posted them, as one trainer's calls took effect when each ran on
// the thread that received it; different callers run in parallel. Operators' calls name a
// strand of their own (never a caller's). A body must not wait for another caller's body
// (collectives complete through callbacks, never by blocking), or a full pool could wait on
// itself. What stays inline (ShardServiceImpl) is what costs less than the hop here (30-40 us
// p50 on a loaded 2-core host): lookups, and steady-state or small read-only calls.
// Thread-safe. The destructor runs the bodies still queued, then joins the threads.

#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/strings/string_view.h"
#include "common/rpc_types.h"
#include "server/durable/blocking_workers.h"

namespace flatshard::server {

class RequestWorkers {
 public:
  // More threads than cores: a body mostly waits (page faults, a copy finishing), and each
  // thread held by one caller's slow body leaves the others to the other callers.
  static constexpr int kThreads = 8;

  explicit RequestWorkers(int threads = kThreads) : workers_(threads) {}

  // Runs `body` on a worker after every body posted earlier for `caller`'s (group, rank).
  void Post(const Caller& caller, absl::AnyInvocable<void()> body);
  // Runs `body` after every body posted earlier for `strand` (an operator's kind of call).
  void Post(absl::string_view strand, absl::AnyInvocable<void()> body);

 private:
  BlockingWorkers workers_;
};

}  // namespace flatshard::server
