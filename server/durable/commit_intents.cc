// Records: commit intents (a torn committed copy is never adopted) and the batched copies of
// a writeback End's local ranks.

#include "server/durable/records.h"

#include <sys/stat.h>
#include <algorithm>
#include <cstring>
#include <set>
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "server/durable/parallel_copier.h"
#include "server/messages.h"
#include "server/module/foreground_copies.h"

namespace flatshard::server {

using internal::Display;

namespace {

// A host rank's copies between its live buffers and its committed copies, appended to `out`
// (nothing appended on a size mismatch: RankDevices::CopyEach's check and message).
absl::Status AppendHostCopies(int32_t rank, const std::vector<internal::DurablePair>& durable,
                              bool to_committed, std::vector<ParallelCopier::Copy>* out) {
  std::vector<ParallelCopier::Copy> copies;
  for (size_t i = 0; i < durable.size(); ++i) {
    const internal::DurablePair& d = durable[i];
    if (d.live == nullptr || d.committed == nullptr) continue;
    const Buffer& from = to_committed ? *d.live : *d.committed;
    const Buffer& to = to_committed ? *d.committed : *d.live;
    if (from.bytes() != to.bytes()) {
      return absl::InternalError(absl::StrCat("rank ", rank, " unit ", d.unit, " ", d.what,
                                              ": copy of ", from.bytes(),
                                              " bytes into a buffer of ", to.bytes()));
    }
    copies.push_back({to.data(), from.data(), static_cast<size_t>(from.bytes())});
  }
  out->insert(out->end(), copies.begin(), copies.end());
  return absl::OkStatus();
}

}  // namespace

void Records::NoteCommitAgreed(Registered& reg, uint64_t generation, const char* kind) {
  if (!reg.pending_commit.has_value() || reg.pending_commit->generation != generation ||
      reg.pending_commit->kind != kind) {
    reg.pending_commit = state::PendingCommit{generation, kind, {}, {}};
  }
}

void Records::CommitReady(const Caller& caller, const std::string& module, uint64_t generation,
                          const char* kind) {
  const bool commit = std::string(kind) == "commit";
  // GPU ranks: their record is their host copy (DeviceHostCopies), which a commit of the device
  // copies does not change, so their intents are not written (nor their ends, CommitDone).
  const bool device = devices_.DeviceOf(caller.rank) != nullptr;
  const bool written = EditAndRecord(caller.group, module, [&](Registered& reg) {
    NoteCommitAgreed(reg, generation, kind);
    std::vector<int32_t>& ready = reg.pending_commit->ready_ranks;
    if (std::find(ready.begin(), ready.end(), caller.rank) == ready.end()) {
      ready.push_back(caller.rank);
      std::sort(ready.begin(), ready.end());
    }
    // A "commit" intent on disk covers every local rank: the others skip its write.
    return !device && !(commit && reg.durable_commit_intent == generation);
  });
  if (written && commit) {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (Registered* reg = FindModuleLocked(g, module)) {
      reg->durable_commit_intent = std::max(reg->durable_commit_intent, generation);
    }
  }
}

void Records::CommitDone(const Caller& caller, const std::string& module, uint64_t generation) {
  // One fsync per commit, the intent's: the end is written (it survives the daemon's death,
  // which the restart needs) but not fsynced. After a machine crash the shared-memory shards
  // it describes are gone anyway, and an intent without its end is finished from the shards.
  const bool device = devices_.DeviceOf(caller.rank) != nullptr;  // see CommitReady
  EditAndRecord(
      caller.group, module,
      [&](Registered& reg) {
        MarkCommitDoneLocked(reg, caller.rank, generation);
        return !device;
      },
      /*sync=*/false);
}

void Records::MarkCommitDoneLocked(Registered& reg, int32_t rank, uint64_t generation) {
  reg.generation[rank] = generation;
  if (rank < static_cast<int32_t>(reg.voted.size()) && reg.voted[rank] <= generation) {
    ClearVoteLocked(reg, rank);
  }
  if (!reg.pending_commit.has_value() || reg.pending_commit->generation != generation) return;
  std::vector<int32_t>& done = reg.pending_commit->done_ranks;
  if (std::find(done.begin(), done.end(), rank) == done.end()) {
    done.push_back(rank);
    std::sort(done.begin(), done.end());
  }
  for (int32_t r = 0; r < static_cast<int32_t>(reg.shards_by_rank.size()); ++r) {
    if (!reg.shards_by_rank[r].empty() && std::find(done.begin(), done.end(), r) == done.end()) {
      return;
    }
  }
  if (reg.pending_commit->kind == "init") {
    reg.initialized = true;
    reg.uninitialized_why.clear();
  }
  reg.pending_commit.reset();
}

void Records::EndArrive(const Caller& caller, const std::string& module, uint64_t k,
                        uint64_t target, const char* kind, absl::Status status,
                        std::vector<internal::DurablePair> durable,
                        absl::AnyInvocable<void(absl::Status)> finish, DeferredCommit deferred) {
  std::vector<EndArrival> batch;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (Registered* found = FindModuleLocked(g, module)) {
      Registered& reg = *found;
      std::vector<EndArrival>& arrived = reg.end_batches[k];
      arrived.push_back(EndArrival{caller.rank, true, std::move(status), std::move(durable),
                                   std::move(finish), std::move(deferred)});
      size_t local = 0;
      for (const std::vector<UnitShard>& s : reg.shards_by_rank) local += s.empty() ? 0 : 1;
      if (arrived.size() < local) return;  // the last local rank copies for every rank
      batch = std::move(arrived);
      reg.end_batches.erase(k);
      // Ends whose other ranks never came (their agreement failed there) are long over.
      while (!reg.end_batches.empty() && reg.end_batches.begin()->first + 64 < k) {
        reg.end_batches.erase(reg.end_batches.begin());
      }
    } else {
      batch.push_back(EndArrival{caller.rank, true, std::move(status), std::move(durable),
                                 std::move(finish), std::move(deferred)});
    }
  }
  // The records and the commit copies are blocking work: the durable worker runs them.
  RunDurable(caller.group, [this, group = caller.group, module, target, kind,
                            batch = std::move(batch)]() mutable {
    ProcessEndBatch(group, module, target, kind, std::move(batch));
  });
}

void Records::EndNotApplied(const Caller& caller, const std::string& module, uint64_t k) {
  std::vector<EndArrival> batch;
  uint64_t target = 0;
  std::string kind;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    Registered* found = FindModuleLocked(g, module);
    if (found == nullptr) return;
    Registered& reg = *found;
    std::vector<EndArrival>& arrived = reg.end_batches[k];
    EndArrival a;
    a.rank = caller.rank;
    arrived.push_back(std::move(a));
    size_t local = 0;
    for (const std::vector<UnitShard>& s : reg.shards_by_rank) local += s.empty() ? 0 : 1;
    if (arrived.size() < local) return;
    batch = std::move(arrived);
    reg.end_batches.erase(k);
    if (reg.pending_commit.has_value()) {
      target = reg.pending_commit->generation;
      kind = reg.pending_commit->kind;
    }
  }
  const char* recorded_kind = kind == "init" ? "init" : "end";
  RunDurable(caller.group, [this, group = caller.group, module, target, recorded_kind,
                            batch = std::move(batch)]() mutable {
    ProcessEndBatch(group, module, target, recorded_kind, std::move(batch));
  });
}

void Records::ProcessEndBatch(const std::string& group, const std::string& module, uint64_t target,
                              const char* kind, std::vector<EndArrival> batch) {
  std::vector<EndArrival*> applying;
  for (EndArrival& a : batch) {
    if (a.applying && a.status.ok()) applying.push_back(&a);
  }
  // One fsync per End, as per Commit (CommitDone): the "ready" record's. The "done" record is
  // written but not fsynced: it survives the daemon's death, and after a machine crash the
  // shared-memory shards and summon segments it lists are gone anyway.
  auto record = [&](bool ready) {
    EditAndRecord(
        group, module,
        [&](Registered& reg) {
          if (ready) {
            NoteCommitAgreed(reg, target, kind);
            std::vector<int32_t>& r = reg.pending_commit->ready_ranks;
            for (EndArrival* a : applying) {
              if (std::find(r.begin(), r.end(), a->rank) == r.end()) r.push_back(a->rank);
            }
            std::sort(r.begin(), r.end());
          } else {
            for (EndArrival* a : applying) {
              if (!a->status.ok()) continue;
              MarkCommitDoneLocked(reg, a->rank, target);
              // Listed in this record (ModuleSnapshot), so a restart copies them from the summon's
              // segments; the caller runs the copy once the End answered.
              if (a->deferred.copy) reg.pending_committed.Add(a->rank, a->deferred.copy);
            }
          }
          return true;
        },
        /*sync=*/ready);
  };
  for (EndArrival& a : batch) {
    // A deferred copy runs only for a rank whose End is applied here.
    if (!(a.applying && a.status.ok())) a.deferred = {};
  }
  if (!applying.empty()) {
    // An earlier End's copies still pending into these committed copies complete first
    // (recorded done), so they never overwrite what this one copies.
    std::vector<std::shared_ptr<PendingCopy>> pending;
    {
      std::shared_ptr<Group> held = table_.FindOrGone(group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (Registered* reg = FindModuleLocked(g, module)) {
        for (EndArrival* a : applying) {
          std::vector<std::shared_ptr<PendingCopy>> more = reg->pending_committed.Of(a->rank);
          pending.insert(pending.end(), more.begin(), more.end());
        }
      }
    }
    for (const std::shared_ptr<PendingCopy>& p : pending) p->Finish();
    // Every local rank's shards hold the new generation: one record says so before any
    // committed copy is overwritten, one after all of them are (the deferred own ranges:
    // after they are listed in it, issue 24).
    record(/*ready=*/true);
    TestingPauseMidCopy(applying.front()->rank, applying.front()->durable,
                        applying.front()->deferred.copy != nullptr);
    // Every host rank's copies in one batch, on several threads (ParallelCopier).
    std::vector<ParallelCopier::Copy> host;
    for (EndArrival* a : applying) {
      if (a->deferred.copy) {
        host.insert(host.end(), a->deferred.gaps.begin(), a->deferred.gaps.end());
        continue;
      }
      a->status = devices_.DeviceOf(a->rank) == nullptr
                      ? AppendHostCopies(a->rank, a->durable, /*to_committed=*/true, &host)
                      : CopyCommitted(a->rank, a->durable, /*to_committed=*/true);
    }
    {
      ForegroundCopies::Scope foreground(ForegroundCopies::Shared());
      ParallelCopier::Shared().Run(host);
    }
    record(/*ready=*/false);
  }
  for (EndArrival& a : batch) {
    if (a.applying && !a.status.ok()) {
      FS_LOG(ERROR) << "group=" << group << " rank=" << a.rank
                    << ": writeback failed after every rank agreed: " << a.status;
    }
    if (a.finish) a.finish(std::move(a.status));
  }
}

void Records::TestingPauseMidCopy(int32_t rank, const std::vector<internal::DurablePair>& durable,
                                  bool deferred) const {
  if (testing_commit_copy_pause_ <= absl::ZeroDuration() || durable.empty()) return;
  // Tears the committed copy on purpose: the first buffer is copied, the others not yet. Not
  // when its own range is deferred: that copy comes from the summon's buffer, after the answer.
  if (!deferred) {
    devices_.CopyEach(rank, {durable[0].live.get()}, {durable[0].committed.get()}).IgnoreError();
  }
  FS_LOG(WARNING) << "testing: commit copy of rank " << rank << " paused for "
                  << absl::FormatDuration(testing_commit_copy_pause_)
                  << (deferred ? "" : " with its committed copy torn");
  absl::SleepFor(testing_commit_copy_pause_);
}

absl::Status Records::CopyCommitted(int32_t rank, const std::vector<internal::DurablePair>& durable,
                                    bool to_committed) const {
  if (devices_.DeviceOf(rank) == nullptr) {
    std::vector<ParallelCopier::Copy> host;
    absl::Status s = AppendHostCopies(rank, durable, to_committed, &host);
    ParallelCopier::Shared().Run(host);
    return s;
  }
  std::vector<const Buffer*> live, kept;
  for (const internal::DurablePair& d : durable) {
    if (d.live == nullptr || d.committed == nullptr) continue;
    live.push_back(d.live.get());
    kept.push_back(d.committed.get());
  }
  return to_committed ? devices_.CopyEach(rank, live, kept) : devices_.CopyEach(rank, kept, live);
}

}  // namespace flatshard::server
