#pragma once
// PublishRounds: the collective publishes of multi-daemon groups as this daemon sees them
// (README "Published weights across daemons"). Every daemon of the group numbers the
// publishes of each (group, module) 1, 2, ... as its own ranks complete them (publishes are
// collective and ordered per module, so the numbers agree); the leader (rank 0's daemon)
// builds the version of publish `seq` after every other daemon's ranks arrived at `seq`, and
// the others copy the version the leader built for `seq`.
//
// Thread-safe; one leaf lock, never held across a wait's caller's work.

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::server {

class PublishRounds {
 public:
  // This daemon's ranks of (group, module) all arrived at their next publish: its number.
  // `token`: the group's (other daemons' AwaitDone present it).
  uint64_t Arrived(const std::string& group, const std::string& module, const std::string& token);
  // Waits until this daemon's ranks arrived at publish `seq`. DEADLINE_EXCEEDED naming the
  // group, module and seq; UNAVAILABLE after Shutdown.
  absl::Status AwaitArrived(const std::string& group, const std::string& module, uint64_t seq,
                            absl::Time deadline);
  // The leader built publish `seq` as `version` (or failed with the status).
  void Done(const std::string& group, const std::string& module, uint64_t seq,
            absl::StatusOr<uint64_t> version);
  // Waits for the leader's result of publish `seq` (the version number or its error).
  // PERMISSION_DENIED when `token` is not the group's.
  absl::StatusOr<uint64_t> AwaitDone(const std::string& group, const std::string& module,
                                     const std::string& token, uint64_t seq, absl::Time deadline);
  // Wakes every waiter (UNAVAILABLE). Idempotent.
  void Shutdown();

 private:
  using Key = std::pair<std::string, std::string>;
  struct Round {
    uint64_t arrived = 0;  // the last seq this daemon's ranks completed
    std::string token;
    // The leader's results by seq (the newest few).
    std::map<uint64_t, absl::StatusOr<uint64_t>> results;
  };
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<Key, Round> rounds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server
