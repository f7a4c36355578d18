#pragma once
// DeviceHostCopies: GPU daemons with a state directory keep a host copy of each module's
// committed device state after every change of its committed generation (Commit, committing
// End, rollback, roll forward, checkpoint load), so that kill -9 loses nothing either
// (README "Restarts": GPU daemons). Off the RPC path: a thread of its own copies device to
// host while the trainers run their next step.
//
// Crash safety: two host slots per rank. The record names the slot that holds a complete
// generation (Registered::host_committed, host_committed_state, at host_generation); the copy
// writes the other slot (Registered::host_spare, unrecorded), and only once every local rank's
// copy is complete are the slots swapped under the group's lock and the module's record
// written (fsync'd). A kill during the copy finds the previous complete slot recorded. All
// local ranks of a module are copied, swapped and recorded together, so a restart never finds
// them at different host generations. Cost: 2x the committed bytes (shards and optimizer
// state) of each GPU rank, in host shared memory.
//
// Ordering: the copy holds the module like a checkpoint save (Registered::ckpt_hold), so a
// commit that arrives meanwhile waits for it before writing the committed copies (after_ckpt);
// requests coalesce (one pending per module: the copy takes the newest committed generation).
//
// Thread-safe. Its lock is a leaf: taken under a group's lock (NoteCopiesDoneLocked), never
// held while taking one.

#include <cstdint>
#include <deque>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/group/group.h"
#include "server/group/group_table.h"
#include "server/module/module.h"
#include "server/rank_devices.h"
#include "server/shard_store.h"

namespace flatshard::server {

class Records;

class DeviceHostCopies {
 public:
  struct Options {
    Records* records = nullptr;  // writes the module's record after a copy
    ShardStore* store = nullptr;
    RankDevices* devices = nullptr;
    GroupTable* table = nullptr;
    // --gpu_host_copies and a state directory.
    bool enabled = false;
  };
  explicit DeviceHostCopies(Options options);
  ~DeviceHostCopies();
  DeviceHostCopies(const DeviceHostCopies&) = delete;
  DeviceHostCopies& operator=(const DeviceHostCopies&) = delete;

  bool enabled() const { return enabled_; }
  // Under the group's lock, when no copy into `reg`'s committed copies is in flight (busy 0):
  // queues a host copy of `module` when it has device ranks whose host copy is older.
  void NoteCopiesDoneLocked(Group& g, const std::string& module, Registered& reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) ABSL_LOCKS_EXCLUDED(mu_);
  // Under the group's lock: `rank`'s committed buffers were replaced (a fresh registration),
  // so its host copy is of other buffers: it becomes the spare slot (the record keeps naming
  // it until the module's next record, so it is not freed here).
  static void ReplacedLocked(Registered& reg, int32_t rank);
  // No new copies; waits for the running one (SIGTERM's own copies, or shutdown, follow).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // A re-form resolved `module` to `target`, one generation below what `ranks` hold on their
  // devices, because another daemon's host copy of the newer one never completed (README
  // "Restarts": GPU daemons): each rank's host slot at `target` (internal::HostFallback)
  // becomes the recorded one and the record is written (fsync'd) first, so a kill from here
  // on resumes at `target`; then it is copied into the rank's device committed copies, shards
  // and optimizer state, and the ranks' generation set. REQUIRES: the caller holds the
  // module's `busy` (Modules::RollbackNow); runs without the group's lock.
  absl::Status RollBack(const std::string& group, const std::string& module, uint64_t target,
                        const std::vector<int32_t>& ranks);

 private:
  struct Job;
  bool Ready() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopped_ || !queue_.empty(); }
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // One module: takes the hold and the committed buffers (under the lock), copies into the
  // spare slots, swaps and records.
  void CopyModule(const std::string& group, const std::string& module);
  absl::Status CopyToSpare(Job& job);

  Records* const records_;
  ShardStore* const store_;
  RankDevices& devices_;
  GroupTable& table_;
  const bool enabled_;

  absl::Mutex mu_;
  std::deque<std::pair<std::string, std::string>> queue_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<std::string, std::string>> queued_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // when enabled; joined by Stop
};

}  // namespace flatshard::server
