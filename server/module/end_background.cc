// Modules::CommitInBackground: the copy into a rank's committed copies a writeback End without a
// state directory leaves running after it answered (server/module/pending_committed.h).

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
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto found = g.removed ? g.registered.end() : g.registered.find(end.module);
    if (found == g.registered.end()) return;  // dropped since: nothing to commit into
    // Held until the copy is done: `busy` keeps re-form rollbacks and checkpoints out, the
    // rank's entry its Commit, next writeback End and rollback (pending_committed.h). Taken
    // before the End answers (FinishAppliedEnd), so the trainer's next call sees it.
    ++found->second.busy;
    found->second.pending_committed.Start(caller.rank);
  }
  background_.Post(
      absl::StrCat(caller.group, "\x1f", caller.rank),
      [this, caller, module = end.module, target = end.target(), later = std::move(later),
       sources = std::move(sources), durable = end.durable]() mutable {
        // `sources` (the summon's buffers) and `durable` (the committed copies) stay alive
        // until here whatever happens to the summon or the module meanwhile.
        if (const absl::Duration pause = records_.testing_commit_copy_pause();
            pause > absl::ZeroDuration()) {
          FS_LOG(WARNING) << "testing: background commit copy of rank " << caller.rank
                          << " held for " << absl::FormatDuration(pause);
          absl::SleepFor(pause);
        }
        ParallelCopier::Shared().Run(later);
        records_.CommitDone(caller, module, target);
        // The summon's buffers go before ReleaseKept, so the kept set sees them unused; a last
        // reference (the set dropped one meanwhile) unmaps here, off the lock.
        sources.clear();
        durable.clear();
        AfterUnlock run;
        {
          std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
          Group& g = *held;
          absl::MutexLock lock(&g.mu);
          auto found = g.removed ? g.registered.end() : g.registered.find(module);
          if (found != g.registered.end()) {
            Registered& reg = found->second;
            for (auto& retry : reg.pending_committed.Done(caller.rank)) run.Call(std::move(retry));
            ReleaseKept(reg);
            DoneCopying(g, reg, &run);
          }
        }
        run.Run();
      });
}

}  // namespace flatshard::server
