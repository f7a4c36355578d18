#pragma once
// PublishRounds: the collective publishes of multi-daemon groups as this daemon sees them
// (README "Published weights across daemons").
//
// Each daemon numbers its own complete batches of each (group, module) 1, 2, ... (Arrived).
// The leader (rank 0's daemon) uses its number as the publish's: it reads every other
// daemon's shards for publish `seq` (ReadShards), and each of those daemons pairs `seq` with
// its oldest batch the leader has not read yet (TakeArrival): so the daemons' own counts
// never need to agree (a daemon restarted, a batch that timed out on one daemon only). Each
// other daemon's batch then waits for that pairing (AwaitLeaderSeq) and copies the version
// the leader built for `seq` (AwaitDone on the leader).
//
// Thread-safe; one leaf lock.

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::server {

class PublishRounds {
 public:
  // This daemon's ranks of (group, module) all arrived at a publish: its number here.
  // `token`: the group's (other daemons' AwaitDone present it). `leader`: this daemon builds
  // it (nobody reads it). `refusal`: why this daemon cannot take the version (a GPU it does
  // not use); the leader's read gets it, so the publish fails on every daemon.
  uint64_t Arrived(const std::string& group, const std::string& module, const std::string& token,
                   bool leader, absl::Status refusal = absl::OkStatus());
  // Another daemon's side of the leader's publish `seq`: the batch paired with it already,
  // else the oldest batch the leader has not read, waiting for one until `deadline`.
  // DEADLINE_EXCEEDED naming the group, module and seq; UNAVAILABLE after Shutdown; the
  // batch's refusal (Arrived) once paired.
  absl::Status TakeArrival(const std::string& group, const std::string& module, uint64_t seq,
                           absl::Time deadline);
  // The leader's publish number that batch `id` was paired with, waiting until `deadline`
  // (DEADLINE_EXCEEDED: the batch is dropped, never paired later).
  absl::StatusOr<uint64_t> AwaitLeaderSeq(const std::string& group, const std::string& module,
                                          uint64_t id, absl::Time deadline);
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
    uint64_t last = 0;  // the last batch number given here
    std::string token;
    std::deque<uint64_t> unread;               // batches the leader has not read yet
    std::map<uint64_t, uint64_t> leader_seq;   // batch -> the leader's publish (the newest few)
    std::map<uint64_t, absl::Status> refused;  // batch -> its refusal (the newest few)
    std::map<uint64_t, absl::StatusOr<uint64_t>> results;  // leader: by seq (the newest few)
  };
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<Key, Round> rounds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server
