// Modules: Commit (a collective step closing), and rollbacks to the committed generation.

#include "server/module/modules.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/reduce.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/metrics/daemon_metrics.h"
#include "server/module/generations.h"
#include "server/module/unit_ops.h"

namespace flatshard::server {

void Modules::RunDurableWork(const Caller& caller, absl::AnyInvocable<absl::Status()> work,
                             absl::AnyInvocable<void(absl::Status)> done) {
  if (devices_.DeviceOf(caller.rank) != nullptr || !records_.enabled()) {
    devices_.RunBlocking(caller.rank, std::move(work), std::move(done));
    return;
  }
  records_.RunDurable(caller.group,
                      [work = std::move(work), done = std::move(done)]() mutable { done(work()); });
}

using internal::ConstOf;
using internal::Display;
using internal::kAlreadyUnsharding;
using internal::MutableOf;
using internal::SelectUnits;

void Modules::Commit(const Caller& caller, const std::string& module, absl::Time deadline,
                     CommitCallback answer, const gpu::IpcEventRef& written) {
  // Every answer, refusals included, counts in flatshard_commits_total.
  CommitCallback done = [start = absl::Now(),
                         answer = std::move(answer)](absl::StatusOr<uint64_t> generation) mutable {
    metrics::RecordCommit(generation.status().code(), absl::Now() - start);
    answer(std::move(generation));
  };
  // The optimizer's writes land before the shards are copied; a failure is this rank's "no".
  devices_.AfterTrainerWrites(
      caller.rank, written,
      [this, caller, module, deadline, done = std::move(done)](absl::Status local) mutable {
        CommitWritten(caller, module, deadline, std::move(done), std::move(local));
      });
}

void Modules::CommitWritten(const Caller& caller, const std::string& module, absl::Time deadline,
                            CommitCallback done, absl::Status local) {
  absl::Status error;
  internal::AgreeRecord record{};
  std::shared_ptr<collective::CollectiveGroup> coll;
  int32_t world_size = 0;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(g, caller);
    if (error.ok()) {
      auto it = g.registered.find(module);
      if (it == g.registered.end()) {
        error = absl::NotFoundError(
            absl::StrCat("group ", g.id, ": module ", Display(module), " is not registered"));
      } else {
        Registered& reg = it->second;
        error = CheckUsable(g, module, reg);
        if (error.ok() && reg.shards_by_rank[caller.rank].empty()) {
          error = absl::FailedPreconditionError(
              absl::StrCat("group ", g.id, " rank ", caller.rank, " holds no shards of module ",
                           Display(module), " (register it first)"));
        }
        if (error.ok()) {
          std::memset(&record, 0, sizeof(record));
          record.stale = reg.stale[caller.rank] ? 1 : 0;
          record.ok = record.stale || !local.ok() ? 0 : 1;
          record.generation = reg.generation[caller.rank];
          internal::CopyText(!local.ok() ? std::string(local.message())
                             : record.stale
                                 ? absl::StrCat("its views predate the rollback to "
                                                "generation ",
                                                record.generation, " (read them again first)")
                                 : std::string(),
                             record.text, sizeof(record.text));
          coll = g.coll;
          world_size = g.world_size;
          if (record.ok) {
            // Its shards hold the next generation until it learns the outcome
            // (server/durable/commit_votes.cc).
            if (reg.voted.size() < reg.generation.size()) reg.voted.resize(reg.generation.size());
            reg.voted[caller.rank] = record.generation + 1;
          }
        }
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  auto agree = [this, coll, caller, module, record, world_size, deadline,
                done = std::move(done)]() mutable {
    Agree(coll, caller, record, world_size, internal::kCommitAgreeUnit,
          absl::StrCat("the commit of module ", Display(module)), deadline,
          [this, caller, module, generation = record.generation, done = std::move(done)](
              absl::Status s, bool stale) mutable {
            if (s.ok()) {
              CommitAgreed(caller, module, generation, std::move(done));
              return;
            }
            if (!s.GetPayload(internal::kAgreeRefusedPayload).has_value()) {
              // The all-gather failed here (a daemon died, the group re-forms): other ranks
              // may have committed. The shards keep the vote; the re-form resolves it.
              done(absl::Status(s.code(),
                                absl::StrCat("the commit of generation ", generation + 1,
                                             " did not complete on this rank: ", s.message(),
                                             "; the group's next formation rolls every rank to "
                                             "one committed generation (re-join)")));
              return;
            }
            records_.VoteRefused(
                caller, module,
                [this, caller, module, stale, generation, s, done = std::move(done)]() mutable {
                  if (stale) RollbackRank(caller, module);
                  done(absl::Status(s.code(),
                                    absl::StrCat("generation ", generation + 1,
                                                 " was not committed on any rank: ", s.message())));
                });
          });
  };
  if (record.ok && devices_.DeviceOf(caller.rank) == nullptr) {
    records_.RecordVote(caller, module, record.generation + 1, std::move(agree));
  } else {
    agree();
  }
}

void Modules::CommitAgreed(const Caller& caller, const std::string& module, uint64_t generation,
                           CommitCallback done) {
  std::vector<internal::DurablePair> durable;
  bool gone = false;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    // Also gone: the module, dropped (lost at a re-form) since the agreement.
    gone = g.removed || !g.registered.contains(module);
    if (gone) {
      // answered below, after the lock
    } else {
      Registered& reg = g.registered.at(module);
      if (reg.ckpt_hold > 0) {
        // A checkpoint is reading (or loading) the committed copies: this copy waits
        // for it (ReleaseCheckpointHold runs it again).
        reg.after_ckpt.push_back(
            [this, caller, module, generation, done = std::move(done)]() mutable {
              CommitAgreed(caller, module, generation, std::move(done));
            });
        return;
      }
      ++reg.busy;  // every rank agreed: this rank commits, whatever its trainer does now
      Records::NoteCommitAgreed(reg, generation + 1, "commit");
      durable = internal::DurableBuffers(reg, caller.rank);
    }
  }
  if (gone) {
    done(absl::UnavailableError(
        absl::StrCat("group ", caller.group, " or its module ", Display(module), " is gone")));
    return;
  }
  // The copies run without the lock, on a worker (RunDurableWork). Invariant: `busy`
  // keeps every rollback out until DoneCopying.
  int64_t bytes = 0;
  for (const internal::DurablePair& pair : durable) {
    if (pair.live != nullptr) bytes += pair.live->bytes();
  }
  RunDurableWork(
      caller,
      [this, caller, module, generation, bytes, durable = std::move(durable)] {
        // Restarts: the intent is durable before the committed copy is overwritten,
        // the new generation before the trainer is answered (server/durable/).
        Records::TestingPauseBeforeIntent(generation + 1);
        FinishPendingCopies(caller.group, module, caller.rank);  // a writeback End's, first
        records_.CommitReady(caller, module, generation + 1, "commit");
        records_.TestingPauseMidCopy(caller.rank, durable);
        absl::Status s = records_.CopyCommitted(caller.rank, durable, /*to_committed=*/true);
        if (s.ok()) {
          records_.CommitDone(caller, module, generation + 1);
          metrics::RecordCommitBytes(bytes);
        }
        return s;
      },
      [this, caller, module, generation, done = std::move(done)](absl::Status s) mutable {
        AfterUnlock run;
        {
          std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
          Group& g = *held;
          absl::MutexLock lock(&g.mu);
          if (!g.removed && g.registered.contains(module)) {  // not dropped meanwhile
            Registered& reg = g.registered.at(module);
            if (s.ok()) reg.generation[caller.rank] = generation + 1;
            DoneCopying(g, reg, &run);
          }
        }
        run.Run();
        if (!s.ok()) {
          FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                        << ": commit failed after every rank agreed: " << s;
          done(s);
          return;
        }
        FS_VLOG(2) << "group=" << caller.group << " rank=" << caller.rank
                   << " module=" << Display(module) << " committed generation " << generation + 1;
        done(generation + 1);
      });
}

void Modules::DoneCopying(Group& g, Registered& reg, AfterUnlock* run) {
  --reg.busy;
  if (reg.busy > 0) return;
  for (auto& [module, r] : g.registered) {
    if (&r != &reg) continue;
    if (reg.rollback_pending) {
      RollbackNow(g, module, reg, run);
    } else {
      // GPU daemons: the committed copies are still; their host copy may be due.
      records_.NoteCopiesDoneLocked(g, module, reg);
    }
    return;
  }
}

void Modules::StartRollback(Group& g, AfterUnlock* run) {
  internal::DropMixedModules(g, absl::StrCat("at the rollback of epoch ", g.epoch), run);
  for (auto& [module, reg] : g.registered) {
    // The op stream starts afresh: the local ranks' k-th summons must meet in one slot again
    // (a failed summon may have counted on some ranks only), and no slot of the old stream
    // (with its assembly state) is reused. Open summons keep their own slots.
    uint64_t k = 0;
    for (int32_t r : g.local_ranks) {
      if (r < static_cast<int32_t>(reg.summon_count.size())) k = std::max(k, reg.summon_count[r]);
    }
    for (int32_t r : g.local_ranks) {
      if (r < static_cast<int32_t>(reg.summon_count.size())) reg.summon_count[r] = k;
    }
    reg.slots.clear();
    if (!reg.initialized) continue;  // nothing committed yet: it stays uninitialised
    reg.rollback_pending = true;
    if (reg.busy == 0) RollbackNow(g, module, reg, run);
  }
}

void Modules::RollbackNow(Group& g, const std::string& module, Registered& reg, AfterUnlock* run) {
  // Deferred behind copies (DoneCopying): a module whose local ranks ended at different
  // generations is dropped as lost, never rolled back into a mix (DropMixedModules; the
  // caller returns right after, so erasing it here is safe).
  if (!internal::MixedGenerations(reg).empty() && reg.busy == 0 &&
      internal::DropMixedModules(g, absl::StrCat("at the rollback of epoch ", g.epoch), run) > 0) {
    return;
  }
  // Ranks that voted for a Commit whose outcome they never learnt go to the generation the
  // daemons resolved the module to (ReconcileModules), or with one daemon the lowest its
  // local ranks can all end at: forward from their shards or back (commit_votes.cc). GPU
  // ranks above it go back from their host copy (another daemon's copy of their generation
  // never completed: internal::HostFallback, DeviceHostCopies::RollBack).
  const uint64_t target = reg.resolved_generation.value_or(internal::PossibleGenerations(reg).lo);
  reg.resolved_generation.reset();
  std::vector<int32_t> back, behind;
  for (int32_t r : g.local_ranks) {
    if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) || reg.shards_by_rank[r].empty() ||
        reg.generation[r] <= target) {
      continue;
    }
    const std::optional<internal::HostSlot> slot = internal::HostFallback(reg, r);
    (slot.has_value() && slot->generation == target ? back : behind).push_back(r);
  }
  if (!behind.empty()) {
    // Its host copy went since the daemons resolved (never expected): dropped, never a mix.
    std::string why = absl::StrCat(
        "group ", g.id, ": module ", Display(module),
        " lost: the daemons resolved it to generation ", target, " and ",
        internal::RankListText(behind),
        " on this daemon hold a newer one without a host copy of it; dropped at the rollback of "
        "epoch ",
        g.epoch, ": register it afresh on every rank (or restore it)");
    FS_LOG(WARNING) << why;
    g.lost[module] = std::move(why);
    reg.rollback_pending = false;
    // Not erased here: the caller may be walking the registered modules.
    run->Call([this, group = g.id, module] {
      AfterUnlock more;
      {
        std::shared_ptr<Group> held = table_.FindOrGone(group);
        Group& g = *held;
        absl::MutexLock lock(&g.mu);
        if (auto it = g.registered.find(module); !g.removed && it != g.registered.end()) {
          more.Destroy(g.registered.extract(it));
        }
      }
      more.Run();
    });
    return;
  }
  // Taking `busy` here keeps every other copy out until the rollback is done; the copies run
  // from `run`, after mu_ is released (before the join callbacks queued after them).
  ++reg.busy;
  const bool had_vote = reg.voted_commit != 0;
  std::vector<std::pair<int32_t, std::vector<internal::DurablePair>>> work, forward;
  std::vector<int32_t> at_target;
  for (int32_t r : g.local_ranks) {
    if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) || reg.shards_by_rank[r].empty()) {
      continue;
    }
    if (std::find(back.begin(), back.end(), r) != back.end()) {
      // Its committed copies and shards come from the host copy (RollBackFromHost).
    } else if (internal::VotedOf(reg, r) == target && reg.generation[r] + 1 == target) {
      forward.emplace_back(r, internal::DurableBuffers(reg, r));
    } else {
      if (reg.generation[r] == target) at_target.push_back(r);
      work.emplace_back(r, internal::DurableBuffers(reg, r));
    }
    Records::ClearVoteLocked(reg, r);
    reg.stale[r] = true;
  }
  if (forward.empty()) at_target.clear();
  run->Call([this, group = g.id, module, target, had_vote, work = std::move(work),
             forward = std::move(forward), at_target = std::move(at_target),
             back = std::move(back)] {
    FinishPendingCopies(group, module, -1);  // writeback Ends' copies into what is read here
    absl::Status status;
    if (!back.empty()) status = records_.RollBackFromHost(group, module, target, back);
    if (!forward.empty()) {
      absl::Status s = records_.RollForward(group, module, target, forward, at_target);
      if (status.ok()) status = s;
    }
    for (size_t i = 0; i < work.size(); ++i) {
      absl::Status s =
          records_.CopyCommitted(work[i].first, work[i].second, /*to_committed=*/false);
      if (!s.ok() && status.ok()) status = s;
    }
    AfterUnlock more;
    {
      std::shared_ptr<Group> held = table_.FindOrGone(group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (g.removed) return;
      auto reg = g.registered.find(module);
      if (reg == g.registered.end()) return;
      reg->second.rollback_pending = false;
      // A vote the rollback cleared leaves the record (RollForward wrote its own).
      if (had_vote && forward.empty()) records_.PersistModuleLater(g, module, &more);
      const uint64_t generation =
          work.empty() ? target : reg->second.generation[work.front().first];
      if (status.ok()) {
        FS_LOG(INFO) << "group=" << group << " module=" << Display(module)
                     << " rolled back to generation " << generation << " on ranks " << work.size()
                     << " local rank(s)";
      } else {
        FS_LOG(ERROR) << "group=" << group << " module=" << Display(module)
                      << ": rollback failed: " << status;
      }
      DoneCopying(g, reg->second, &more);
    }
    more.Run();
  });
}

void Modules::RollbackRank(const Caller& caller, const std::string& module) {
  AfterUnlock run;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    auto reg = g.registered.find(module);
    if (reg == g.registered.end() || !reg->second.initialized) return;
    // A refused commit: this rank's part of rolling the whole group back (every rank got the
    // same verdict). Its views are stale from now on.
    Registered& r = reg->second;
    if (r.ckpt_hold > 0) {  // a checkpoint holds the copies still: roll back after it
      r.after_ckpt.push_back([this, caller, module] { RollbackRank(caller, module); });
      return;
    }
    ++r.busy;
    r.stale[caller.rank] = true;
    run.Call([this, caller, module, durable = internal::DurableBuffers(r, caller.rank)] {
      FinishPendingCopies(caller.group, module, caller.rank);  // a writeback End's, first
      absl::Status s = records_.CopyCommitted(caller.rank, durable, /*to_committed=*/false);
      if (!s.ok()) {
        FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                      << ": rollback after a refused commit failed: " << s;
      }
      AfterUnlock more;
      {
        std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
        Group& g = *held;
        absl::MutexLock lock(&g.mu);
        if (g.removed) return;
        auto reg = g.registered.find(module);
        if (reg != g.registered.end()) DoneCopying(g, reg->second, &more);
      }
      more.Run();
    });
  }
  run.Run();
}

}  // namespace flatshard::server
