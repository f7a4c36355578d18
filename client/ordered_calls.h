#pragma once
// The client's collectives in issue order. A collective's op_seq is assigned by the daemon in
// the order each rank's calls arrive (server/collective/collective_engine.h), so every rank
// must issue its collectives in one order. Client::StartSummon runs its RPC on this lane's
// thread; every later call that acts on the group first waits (Drain) for what was started
// before it, so a synchronous call can never overtake a started summon. A call that runs no
// collective but must not overlap some started jobs (BeginReduceScatter: the started phase two
// of the same unit, which reads the gradient buffer the Begin hands out) waits only for the
// last job submitted with its key (DrainKey) instead.
//
// Thread safety: thread-safe. Jobs run one at a time, first in first out, on one thread that
// starts with the first Submit. A job may call Drain (it returns at once on the lane's own
// thread); it must not wait for jobs submitted after it.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::client::internal {

class OrderedCalls {
 public:
  OrderedCalls() = default;
  // Runs what was submitted, then stops the thread (see Stop).
  ~OrderedCalls();
  OrderedCalls(const OrderedCalls&) = delete;
  OrderedCalls& operator=(const OrderedCalls&) = delete;

  // Queues `job` behind every job submitted before it. After Stop, runs it on the caller's
  // thread instead (nothing is left behind). A non-empty `key` names the job for DrainKey.
  void Submit(std::function<void()> job, std::string key = {});
  // Returns once every job submitted before this call has run. No-op on the lane's thread.
  void Drain() const;
  // Returns once the last job submitted with `key` before this call has run, and so every
  // job submitted before that one (jobs run in order); at once when none is queued or
  // running. Jobs without the key submitted after it are not waited for. No-op on the
  // lane's thread.
  void DrainKey(const std::string& key) const;
  // Runs the queued jobs to the end and joins the thread (detaches it when called from the
  // lane's own thread, e.g. by the last owner of the client released inside a job).
  void Stop();

  // Jobs submitted and not yet finished (tests, diagnostics).
  int64_t pending() const;

 private:
  // Shared with the thread, which may outlive this object (Stop from the lane's own thread).
  struct State {
    mutable absl::Mutex mu;
    std::deque<std::pair<std::function<void()>, std::string>> queue ABSL_GUARDED_BY(mu);
    // Per key of a job not yet finished: the submit number (1-based) of its last such job.
    absl::flat_hash_map<std::string, uint64_t> last_of_key ABSL_GUARDED_BY(mu);
    uint64_t submitted ABSL_GUARDED_BY(mu) = 0;
    uint64_t finished ABSL_GUARDED_BY(mu) = 0;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    std::thread thread ABSL_GUARDED_BY(mu);
    std::thread::id thread_id ABSL_GUARDED_BY(mu);
  };
  static void Run(std::shared_ptr<State> state);
  // Waits until `target` jobs have finished (not on the lane's own thread).
  static void AwaitFinished(State& s, uint64_t target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace flatshard::client::internal
