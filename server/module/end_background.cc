// Modules::CommitInBackground, RunPendingInBackground and FinishPendingCopies: the copy into a
// rank's committed copies a writeback End leaves to finish after it answered
// (server/module/pending_committed.h).

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "server/durable/records.h"
#include "server/module/modules.h"
#include "server/module/writeback_end.h"

namespace flatshard::server {

void Modules::CommitInBackground(const WritebackEnd& end, std::vector<ParallelCopier::Copy> later,
                                 std::vector<std::shared_ptr<Buffer>> sources) {
  const Caller caller = end.caller;
  for (const internal::DurablePair& d : end.durable) sources.push_back(d.committed);
  auto copy = std::make_shared<PendingCopy>(std::move(later), std::move(sources));
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto found = g.removed ? g.registered.end() : g.registered.find(end.module);
    if (found == g.registered.end()) return;  // dropped since: nothing to commit into
    // Before the End answers (FinishAppliedEnd), so the trainer's next call finds it.
    found->second.pending_committed.Add(caller.rank, copy);
  }
  RunPendingInBackground(caller, end.module, std::move(copy));
}

void Modules::RunPendingInBackground(const Caller& caller, const std::string& module,
                                     std::shared_ptr<PendingCopy> copy, uint64_t generation) {
  background_.Post(absl::StrCat(caller.group, "\x1f", caller.rank),
                   [this, caller, module, copy = std::move(copy), generation] {
                     if (generation != 0) Records::TestingPauseEndVote("deferred_copy", generation);
                     // Testing: twice a commit copy's pause, so that a Commit right after
                     // the End would overtake this copy unless it finishes it first (and a
                     // kill finds it recorded, with a state directory).
                     if (const absl::Duration pause = 2 * records_.testing_commit_copy_pause();
                         pause > absl::ZeroDuration()) {
                       FS_LOG(WARNING) << "testing: background commit copy of rank " << caller.rank
                                       << " held for " << absl::FormatDuration(pause);
                       absl::SleepFor(pause);
                     }
                     copy->CopyInBackground();
                     copy->Finish();  // waits for a chunk another thread took, if any
                     // The summon's buffers are free again (Finish let them go): the kept set
                     // may count them idle.
                     std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
                     Group& g = *held;
                     absl::MutexLock lock(&g.mu);
                     auto found = g.removed ? g.registered.end() : g.registered.find(module);
                     if (found == g.registered.end()) return;
                     found->second.pending_committed.Prune();
                     ReleaseKept(found->second);
                   });
}

void Modules::FinishPendingCopies(const std::string& group, const std::string& module,
                                  int32_t rank) {
  std::vector<std::shared_ptr<PendingCopy>> pending;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto found = g.removed ? g.registered.end() : g.registered.find(module);
    if (found == g.registered.end()) return;
    pending = found->second.pending_committed.Of(rank);
  }
  for (const std::shared_ptr<PendingCopy>& p : pending) p->Finish();
}

}  // namespace flatshard::server
