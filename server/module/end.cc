// Modules: the End of a summon: writeback after an agreement every rank reaches, rank0_only
// broadcasts, and the agreement all-gather Commit shares.

#include "server/module/modules.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/plan.h"
#include "common/status_macros.h"
#include "server/collective/reduce.h"
#include "server/durable/parallel_copier.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/foreground_copies.h"
#include "server/module/generations.h"
#include "server/module/init_undo.h"
#include "server/module/summon_steps.h"
#include "server/module/unit_ops.h"
#include "server/module/writeback_end.h"

namespace flatshard::server {

using summon_steps::GetViewBuffers;

using internal::ConstOf;
using internal::Display;
using internal::kAlreadyUnsharding;
using internal::MutableOf;
using internal::SelectUnits;

namespace {

// Host ranks: RankDevices::CopyOwnRange as a copy for ParallelCopier (appended to `out`), so
// that every unit's writeback runs on several threads at once.
absl::Status AppendOwnRange(int32_t rank, const Plan& plan, const PlanUnit& unit, int32_t r,
                            const Buffer& full, const Buffer& shard,
                            std::vector<ParallelCopier::Copy>* out) {
  FS_ASSIGN_OR_RETURN(RankDevices::OwnRangeBytes copy,
                      RankDevices::OwnRange(rank, plan, unit, r, full, shard));
  if (copy.bytes > 0) out->push_back({copy.dst, copy.src, copy.bytes});
  return absl::OkStatus();
}

// Without records (no crash to order against), the writeback's bytes go into each shard and its
// committed copy in one pass (ParallelCopier::Copy::also): `copies` get their committed
// destinations, and the committed copies' other bytes (padding, optimizer state) are appended.
// With `later`, the committed destinations go there instead, read from the same sources (the
// summon's buffers, never the shards), for a copy after the End answered (CommitInBackground).
// Returns whether every durable pair could be covered so; if not, `copies` is left unchanged.
// With `gaps_out` the committed copies' other bytes go there instead of into `copies` (with a
// state directory they are copied only after the End's "ready" record).
bool FuseCommitCopies(const std::vector<internal::DurablePair>& durable,
                      std::vector<ParallelCopier::Copy>* copies,
                      std::vector<ParallelCopier::Copy>* later,
                      std::vector<ParallelCopier::Copy>* gaps_out = nullptr) {
  std::vector<ParallelCopier::Copy> deferred;
  std::vector<ParallelCopier::Copy> all_gaps;
  std::vector<ParallelCopier::Copy> fused = *copies;
  for (const internal::DurablePair& d : durable) {
    if (d.live == nullptr || d.committed == nullptr) continue;
    if (d.live->bytes() != d.committed->bytes()) return false;
    char* live = static_cast<char*>(d.live->data());
    char* kept = static_cast<char*>(d.committed->data());
    const size_t bytes = static_cast<size_t>(d.live->bytes());
    // The writeback ranges inside this buffer, in order; the bytes between them copied as before.
    std::vector<ParallelCopier::Copy*> inside;
    for (ParallelCopier::Copy& c : fused) {
      char* dst = static_cast<char*>(c.dst);
      if (dst >= live && dst + c.bytes <= live + bytes) inside.push_back(&c);
    }
    std::sort(inside.begin(), inside.end(),
              [](const auto* a, const auto* b) { return a->dst < b->dst; });
    size_t at = 0;
    std::vector<ParallelCopier::Copy> gaps;
    for (ParallelCopier::Copy* c : inside) {
      const size_t off = static_cast<size_t>(static_cast<char*>(c->dst) - live);
      if (off < at) return false;  // overlapping ranges: not expected, copy as before
      if (off > at) gaps.push_back({kept + at, live + at, off - at});
      if (later != nullptr) {
        deferred.push_back({kept + off, c->src, c->bytes});
      } else {
        c->also = kept + off;
      }
      at = off + c->bytes;
    }
    if (at < bytes) gaps.push_back({kept + at, live + at, bytes - at});
    std::vector<ParallelCopier::Copy>& into = gaps_out != nullptr ? all_gaps : fused;
    into.insert(into.end(), gaps.begin(), gaps.end());
  }
  *copies = std::move(fused);
  if (later != nullptr) *later = std::move(deferred);
  if (gaps_out != nullptr) *gaps_out = std::move(all_gaps);
  return true;
}

// What a state record says of `later` (FuseCommitCopies' deferred copies of `rank` at
// `generation`): for each, the unit whose committed copy it writes and where its bytes lie in
// a segment of `sources`. False when one cannot be said (then nothing is deferred).
bool DeferredRecordsOf(int32_t rank, uint64_t generation,
                       const std::vector<internal::DurablePair>& durable,
                       const std::vector<ParallelCopier::Copy>& later,
                       const std::vector<std::shared_ptr<Buffer>>& sources,
                       std::vector<state::DeferredRecord>* out) {
  auto inside = [](const void* p, size_t n, const Buffer& b) {
    const char* at = static_cast<const char*>(p);
    const char* data = static_cast<const char*>(b.data());
    return data != nullptr && at >= data && at + n <= data + b.bytes();
  };
  for (const ParallelCopier::Copy& c : later) {
    const internal::DurablePair* to = nullptr;
    for (const internal::DurablePair& d : durable) {
      if (d.what == "shard" && d.committed != nullptr && inside(c.dst, c.bytes, *d.committed)) {
        to = &d;
      }
    }
    const Buffer* from = nullptr;
    for (const std::shared_ptr<Buffer>& b : sources) {
      if (!b->on_device() && inside(c.src, c.bytes, *b)) from = b.get();
    }
    if (to == nullptr || from == nullptr) return false;
    out->push_back(state::DeferredRecord{
        rank, to->unit, generation, from->segment_name(), static_cast<int32_t>(from->kind()),
        from->segment_bytes(),
        from->offset() + (static_cast<const char*>(c.src) - static_cast<const char*>(from->data())),
        static_cast<const char*>(c.dst) - static_cast<const char*>(to->committed->data()),
        static_cast<int64_t>(c.bytes)});
  }
  return true;
}

}  // namespace

absl::Status Modules::PrepareRank0Broadcast(const Caller& caller, uint64_t summon, const Plan& plan,
                                            const std::vector<UnitShard>& shards,
                                            const std::shared_ptr<KeptBuffers>& kept,
                                            const std::vector<ViewNeed>& needs, int64_t owner_uid,
                                            OpenSummon* copy,
                                            std::vector<collective::CollectiveOp>* broadcasts) {
  // Without mu_: the kept-buffer cache may allocate.
  ViewBuffers got;
  absl::Status status = GetViewBuffers(*kept, needs, BufferKind::kUnsharded, owner_uid,
                                       PlacementOf(caller.rank), &got);
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("group ", caller.group, " rank ", caller.rank, ": summon ", summon,
                     " was dropped while its writeback was being prepared (the group is gone)"));
  }
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  // Invariant: the summon was marked `ending` before the lock was released, so no other End
  // of it ran in the gap and its views and slot are as they were; only the rank's session
  // ending (DropSummons) or the group's removal can have taken it away, checked here.
  auto it = g.removed ? g.open_summons.end() : g.open_summons.find(summon);
  if (it == g.open_summons.end()) {
    return absl::UnavailableError(absl::StrCat(
        "group ", caller.group, " rank ", caller.rank, ": summon ", summon,
        " was dropped while its writeback was being prepared (the rank's session ended)"));
  }
  if (!status.ok()) {
    it->second.ending = false;
    return status;
  }
  // beyond FSDP: rank 0's edits reach every shard. Rank 0 broadcasts its buffers when it
  // ends; each node receives one copy, which all its ranks share. The agreement after it is
  // the barrier: no rank writes back before every rank has the bytes.
  for (int32_t u : copy->units) {
    const PlanUnit& unit = plan.units[u];
    for (KeptUse use : {KeptUse::kParams, KeptUse::kGrads}) {
      if (use == KeptUse::kGrads && !(copy->options.with_grads && shards[u].grad)) continue;
      auto& map = use == KeptUse::kParams ? copy->slot->rank0_params : copy->slot->rank0_grads;
      std::shared_ptr<Buffer> target;
      if (gpus_.empty() || caller.rank == 0) {
        // The node's copy: the first local rank's to get here (or rank 0's own views).
        if (!map[u]) map[u] = got.at({u, use});
        target = map[u];
      } else {
        target = got.at({u, use});
        copy->own_rank0[{u, use == KeptUse::kParams ? 0 : 1}] = target;
      }
      broadcasts->push_back(
          collective::CollectiveOp::Broadcast(u, MutableOf(target.get(), unit.dtype), 0));
      broadcasts->back().name = "writeback";
    }
  }
  return absl::OkStatus();
}

void Modules::EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline,
                        StatusCallback done, const gpu::IpcEventRef& written) {
  // The trainer's writes to the views land before they are written back. A failure here is
  // this rank's "no" in the agreement, so the other ranks fail at once too.
  devices_.AfterTrainerWrites(
      caller.rank, written,
      [this, caller, summon, deadline, done = std::move(done)](absl::Status local) mutable {
        EndSummonWritten(caller, summon, deadline, std::move(done), std::move(local));
      });
}

// What the lock-held start of an End gathered (StartEndLocked).
struct Modules::EndStart {
  OpenSummon copy;
  const Plan* plan = nullptr;  // registrations are never removed while the group lives
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::vector<UnitShard> shards;
  std::vector<internal::DurablePair> durable;  // what an agreed writeback commits
  internal::AgreeRecord record{};
  int32_t world_size = 0;
  bool is_init = false;
  std::vector<int32_t> init_locals;  // an init End: the daemon's local ranks
  bool other_daemons = false;        // other daemons host ranks of the group
  absl::Status reformed;             // the summon predates the group's re-form
  // rank0_only writeback: the buffers rank 0's broadcast lands in that are not at hand yet.
  std::vector<ViewNeed> rank0_needs;
  std::shared_ptr<KeptBuffers> rank0_kept;
  int64_t owner_uid = -1;
};

void Modules::EndSummonWritten(const Caller& caller, uint64_t summon, absl::Time deadline,
                               StatusCallback done, absl::Status local) {
  absl::Status error;
  EndStart start;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(g, caller);
    if (error.ok()) error = StartEndLocked(g, caller, summon, local, &start);
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  if (!start.reformed.ok()) {
    FinishEnd(caller, summon, std::move(start.reformed), std::move(done));
    return;
  }
  std::vector<collective::CollectiveOp> broadcasts;
  if (start.copy.options.rank0_only && start.copy.options.writeback) {
    error = PrepareRank0Broadcast(caller, summon, *start.plan, start.shards, start.rank0_kept,
                                  start.rank0_needs, start.owner_uid, &start.copy, &broadcasts);
    if (!error.ok()) {
      done(error);
      return;
    }
  }
  const SummonOptions options = start.copy.options;
  auto owned = std::make_unique<OpenSummon>(std::move(start.copy));
  if (!options.writeback) {
    // A read-only End waits for nobody.
    owned.reset();
    FinishEnd(caller, summon, local, std::move(done));
    return;
  }
  auto end = std::make_shared<WritebackEnd>();
  end->caller = caller;
  end->summon = summon;
  end->module = owned->module;
  end->k = owned->k;
  end->plan = start.plan;
  end->shards = std::move(start.shards);
  end->durable = std::move(start.durable);
  end->is_init = start.is_init;
  if (start.is_init) {
    end->slot = owned->slot;
    end->locals = std::move(start.init_locals);
  }
  end->generation = start.record.generation;
  end->batched = records_.enabled() && gpus_.empty();
  end->vote = end->batched && start.other_daemons && !start.is_init;
  end->coll = start.coll;
  end->world_size = start.world_size;
  end->deadline = deadline;
  if (!options.rank0_only) {
    AgreeEnd(std::move(end), start.coll, start.record, start.world_size, deadline, std::move(owned),
             std::move(done));
    return;
  }
  auto coll = start.coll;
  coll->SubmitAll(
      caller.rank, std::move(broadcasts), deadline - clock_->Now(),
      [this, end = std::move(end), coll, record = start.record, world_size = start.world_size,
       deadline, owned = std::move(owned), done = std::move(done)](absl::Status s) mutable {
        if (s.ok()) {
          AgreeEnd(std::move(end), coll, record, world_size, deadline, std::move(owned),
                   std::move(done));
          return;
        }
        owned.reset();
        FinishEnd(end->caller, end->summon,
                  absl::Status(s.code(), absl::StrCat("summon ", end->summon,
                                                      ": no rank's writeback was "
                                                      "applied: ",
                                                      s.message())),
                  std::move(done));
      });
}

absl::Status Modules::StartEndLocked(Group& g, const Caller& caller, uint64_t summon,
                                     const absl::Status& local, EndStart* out) {
  auto it = g.open_summons.find(summon);
  auto failed = g.failed_ends.find(summon);
  if (it == g.open_summons.end() && failed != g.failed_ends.end() &&
      failed->second.first == caller.rank) {
    return failed->second.second;  // a repeated End: the first one's cause
  }
  if (it == g.open_summons.end() || it->second.rank != caller.rank) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, " rank ", caller.rank, ": no open summon ", summon));
  }
  if (it->second.ending || !it->second.ready) {
    return absl::FailedPreconditionError(absl::StrCat(
        "summon ", summon, " is ", it->second.ending ? "already ending" : "not ready"));
  }
  if (it->second.options.writeback && it->second.coll != nullptr && it->second.coll != g.coll) {
    // Opened before the group failed and re-formed: the other ranks' halves of this
    // summon are gone, so it cannot commit anywhere. The first failure is the cause.
    out->reformed = absl::UnavailableError(
        absl::StrCat("summon ", summon,
                     ": no rank's writeback was applied: the group re-formed since "
                     "it was opened, after: ",
                     it->second.coll->status().message()));
    return absl::OkStatus();
  }
  auto found = g.registered.find(it->second.module);
  if (found == g.registered.end()) {
    // Dropped (lost at a re-form) while this summon was open: nothing to end into.
    auto lost = g.lost.find(it->second.module);
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, " rank ", caller.rank, ": summon ", summon, " of module ",
                     Display(it->second.module), " cannot end: the module was dropped (",
                     lost != g.lost.end() ? lost->second : "lost at a re-form", ")"));
  }
  it->second.ending = true;
  OpenSummon& copy = out->copy;
  copy = it->second;
  Registered& reg = found->second;
  if (copy.options.writeback && reg.rollback_pending) {
    it->second.ending = false;
    return absl::UnavailableError(
        absl::StrCat("group ", g.id, ": module ", Display(copy.module),
                     " is being rolled back to its committed generation; end the summon again"));
  }
  out->plan = &reg.plan;
  out->shards = reg.shards_by_rank[caller.rank];
  out->durable = internal::DurableBuffers(reg, caller.rank);
  out->coll = g.coll;
  out->world_size = g.world_size;
  out->is_init = !reg.initialized;
  // Every local rank: the registration before an init is collective over every rank.
  if (out->is_init) out->init_locals = g.local_ranks;
  out->other_daemons = static_cast<int32_t>(g.local_ranks.size()) < g.world_size;
  internal::AgreeRecord& record = out->record;
  std::memset(&record, 0, sizeof(record));
  record.ok = local.ok() && !reg.stale[caller.rank] ? 1 : 0;
  record.stale = reg.stale[caller.rank] ? 1 : 0;
  record.generation = reg.generation[caller.rank];
  internal::CopyText(!local.ok()    ? std::string(local.message())
                     : record.stale ? absl::StrCat("its views predate the rollback to generation ",
                                                   record.generation, " (read them again first)")
                                    : std::string(),
                     record.text, sizeof(record.text));
  if (!(copy.options.rank0_only && copy.options.writeback)) return absl::OkStatus();
  // Rank 0's broadcast lands in buffers got without the lock (PrepareRank0Broadcast): the
  // node's copy where no local rank has made it yet (host ranks; rank 0 uses its own views),
  // or each GPU rank's own copy on its device.
  out->rank0_kept = KeptOf(reg);
  out->owner_uid = g.owner_uid;
  for (int32_t u : copy.units) {
    const PlanUnit& unit = reg.plan.units[u];
    for (KeptUse use : {KeptUse::kParams, KeptUse::kGrads}) {
      if (use == KeptUse::kGrads && !(copy.options.with_grads && out->shards[u].grad)) continue;
      const auto& map = use == KeptUse::kParams ? copy.slot->rank0_params : copy.slot->rank0_grads;
      const bool node = gpus_.empty() || caller.rank == 0;
      if (node && map.contains(u) && map.at(u) != nullptr) continue;
      out->rank0_needs.push_back({u, use,
                                  gpus_.empty() ? KeptKey::NodeRank0Copy(u, use)
                                                : KeptKey::RankRank0Copy(caller.rank, u, use),
                                  unit.padded_numel * ItemSize(unit.dtype),
                                  absl::StrCat("group=", g.id, " unit=", u, " rank 0's copy")});
    }
  }
  return absl::OkStatus();
}

void Modules::AgreeEnd(std::shared_ptr<const WritebackEnd> end,
                       std::shared_ptr<collective::CollectiveGroup> coll,
                       const internal::AgreeRecord& record, int32_t world_size, absl::Time deadline,
                       std::unique_ptr<OpenSummon> owned, StatusCallback done) {
  const Caller caller = end->caller;
  const uint64_t summon = end->summon;
  Agree(coll, caller, record, world_size, internal::kEndAgreeUnit,
        absl::StrCat("the writeback of summon ", summon), deadline,
        [this, end = std::move(end), owned = std::move(owned), done = std::move(done)](
            absl::Status s, bool stale) mutable {
          if (s.ok() && end->is_init && internal::TestingInitAgreementFails(end->caller.rank)) {
            s = absl::UnavailableError(absl::StrCat(
                "group ", end->caller.group, ": the agreement's all-gather failed on rank ",
                end->caller.rank, " alone (--testing_init_end_fails)"));
          }
          if (s.ok()) {
            ApplyEnd(std::move(end), std::move(owned), std::move(done));
            return;
          }
          owned.reset();
          if (end->vote) {
            records_.EndVoteArrive(end->caller, end->module, end->k, end->target(),
                                   /*applying=*/false, absl::OkStatus(), nullptr);
          }
          if (end->batched) records_.EndNotApplied(end->caller, end->module, end->k);
          if (stale) RollbackRank(end->caller, end->module);
          absl::Status failed(s.code(),
                              absl::StrCat("summon ", end->summon,
                                           ": no rank's writeback was applied: ", s.message()));
          if (end->is_init) {
            // Another local rank's agreement may have passed (a torn all-gather): it must
            // not initialise the module here alone.
            end->SettleInit(*this, std::move(failed), std::move(done));
            return;
          }
          FinishEnd(end->caller, end->summon, std::move(failed), std::move(done));
        });
}

void Modules::ApplyEnd(std::shared_ptr<const WritebackEnd> end, std::unique_ptr<OpenSummon> owned,
                       StatusCallback done) {
  // Every rank agreed: this rank applies (the daemon does, whatever its trainer does now).
  std::optional<std::string> dropped;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(end->caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto found = g.removed ? g.registered.end() : g.registered.find(end->module);
    if (!g.removed && found == g.registered.end()) {
      // Dropped (lost at a re-form) since the agreement: nothing to write back into.
      auto lost = g.lost.find(end->module);
      dropped = lost != g.lost.end() ? lost->second : "its module was dropped";
    } else if (!g.removed) {
      Registered& reg = found->second;
      if (reg.ckpt_hold > 0) {
        // A checkpoint holds the committed copies: run again once it is done.
        reg.after_ckpt.push_back(
            [this, end, owned = std::move(owned), done = std::move(done)]() mutable {
              ApplyEnd(std::move(end), std::move(owned), std::move(done));
            });
        return;
      }
      ++reg.busy;
      // With a vote, the daemons agree to it only once every rank voted (VoteEnd).
      if (!end->vote) Records::NoteCommitAgreed(reg, end->target(), end->kind());
    }
  }
  if (dropped.has_value()) {
    owned.reset();
    // As when the agreement fails: the other local ranks' batch and vote do not wait for it.
    if (end->vote) {
      records_.EndVoteArrive(end->caller, end->module, end->k, end->target(),
                             /*applying=*/false, absl::OkStatus(), nullptr);
    }
    if (end->batched) records_.EndNotApplied(end->caller, end->module, end->k);
    absl::Status failed = absl::UnavailableError(
        absl::StrCat("summon ", end->summon, ": no rank's writeback was applied: ", *dropped));
    if (end->is_init) {
      end->SettleInit(*this, std::move(failed), std::move(done));
      return;
    }
    FinishEnd(end->caller, end->summon, std::move(failed), std::move(done));
    return;
  }
  absl::AnyInvocable<void(absl::Status)> finish = [this, end,
                                                   done = std::move(done)](absl::Status s) mutable {
    FinishAppliedEnd(*end, std::move(s), std::move(done));
  };
  if (end->batched) {
    // Host ranks keeping records: the writeback is a host copy and runs here, as without
    // records; the fsync'd records and the commit copies, which wait for the other local
    // ranks, run on the durable worker (Records::EndArrive).
    DeferredCommit deferred;
    absl::Status s = WriteBack(*end, std::move(owned), &deferred);
    if (end->is_init) {  // testing only, on the strand before the init's records
      records_.RunDurable(end->caller.group,
                          [] { internal::TestingPauseInit("end_before_intent"); });
    }
    if (deferred.copy) {
      // OK only once the "done" record listed the copy (Records::ProcessEndBatch): it runs
      // while the End answers.
      finish = [this, caller = end->caller, module = end->module, copy = deferred.copy,
                generation = end->target(), finish = std::move(finish)](absl::Status s) mutable {
        if (s.ok()) RunPendingInBackground(caller, module, copy, generation);
        finish(std::move(s));
      };
    }
    if (end->vote) {
      VoteEnd(std::move(end), std::move(s), std::move(finish), std::move(deferred));
      return;
    }
    records_.EndArrive(end->caller, end->module, end->k, end->target(), end->kind(), std::move(s),
                       end->durable, std::move(finish), std::move(deferred));
    return;
  }
  // The copies run without the lock (GPU ranks: on the device's worker, not on the engine's
  // thread). Invariant: `busy`, taken above, keeps every rollback out until DoneCopying, and
  // the summon is `ending`, so no other call touches its views or this rank's shards' copy.
  devices_.RunBlocking(
      end->caller.rank,
      [this, end, owned = std::move(owned)]() mutable { return WriteBack(*end, std::move(owned)); },
      std::move(finish));
}

absl::Status Modules::WriteBack(const WritebackEnd& end, std::unique_ptr<OpenSummon> copy,
                                DeferredCommit* deferral) {
  // Writes back this rank's ranges and commits its shards. Takes the copy and lets its
  // buffer references go, so FinishEnd sees which kept buffers nobody uses any more.
  const Caller& caller = end.caller;
  const Plan& plan = *end.plan;
  const int32_t r = plan.ShardRank(caller.rank);
  const bool host = devices_.DeviceOf(caller.rank) == nullptr;
  // The rank's last End's committed copy first: this one writes the committed copies too.
  FinishPendingCopies(caller.group, end.module, caller.rank);
  std::vector<ParallelCopier::Copy> host_copies;
  absl::Status status;
  for (size_t i = 0; i < copy->units.size() && status.ok(); ++i) {
    const int32_t u = copy->units[i];
    const PlanUnit& unit = plan.units[u];
    const UnitShard& shard = end.shards[u];
    const bool from_rank0 = copy->options.rank0_only;
    auto rank0_copy = [&](int what) -> const Buffer* {
      auto own = copy->own_rank0.find({u, what});
      if (own != copy->own_rank0.end()) return own->second.get();
      const auto& map = what == 0 ? copy->slot->rank0_params : copy->slot->rank0_grads;
      return map.contains(u) ? map.at(u).get() : nullptr;
    };
    auto write_back = [&](const Buffer& full, const Buffer& into) {
      return host ? AppendOwnRange(caller.rank, plan, unit, r, full, into, &host_copies)
                  : devices_.CopyOwnRange(caller.rank, plan, unit, r, full, into);
    };
    const Buffer* params = from_rank0 ? rank0_copy(0) : copy->views[i].params.get();
    status = write_back(*params, *shard.shard);
    const Buffer* grads = from_rank0 ? rank0_copy(1) : copy->views[i].grads.get();
    if (status.ok() && grads != nullptr && shard.grad) status = write_back(*grads, *shard.grad);
  }
  // Without records and on the host, the committed copies are written from the summon's
  // buffers after the End answered (pending_committed.h); an init, whose End completes the
  // registration, and a rank0_only End, whose source is the node's shared copy of rank 0's
  // buffers, write them in the same pass instead.
  const bool plain = status.ok() && host && !end.batched && !records_.enabled();
  std::vector<ParallelCopier::Copy> later;
  const bool background = plain && !end.is_init && !copy->options.rank0_only &&
                          FuseCommitCopies(end.durable, &host_copies, &later);
  const bool fused = plain && !background && FuseCommitCopies(end.durable, &host_copies, nullptr);
  // With a state directory the same split, its other bytes copied after the "ready" record
  // (Records::ProcessEndBatch) and the own ranges recorded where they lie (issue 24).
  std::vector<ParallelCopier::Copy> gaps;
  std::vector<std::shared_ptr<Buffer>> sources;
  for (const SummonedUnit& v : copy->views) {
    if (v.params) sources.push_back(v.params);
    if (v.grads) sources.push_back(v.grads);
  }
  std::vector<state::DeferredRecord> recorded;
  const bool deferred =
      deferral != nullptr && status.ok() && host && end.batched && !end.is_init &&
      !copy->options.rank0_only && FuseCommitCopies(end.durable, &host_copies, &later, &gaps) &&
      DeferredRecordsOf(caller.rank, end.target(), end.durable, later, sources, &recorded);
  if (fused || background) records_.CommitReady(caller, end.module, end.target(), end.kind());
  // Host ranks: every unit's range at once, on several threads, before the views go; the
  // copies Ends left for later wait meanwhile.
  if (status.ok()) {
    ForegroundCopies::Scope foreground(ForegroundCopies::Shared());
    ParallelCopier::Shared().Run(host_copies);
  }
  if (deferred) {
    copy.reset();
    for (const internal::DurablePair& d : end.durable) sources.push_back(d.committed);
    deferral->copy = std::make_shared<PendingCopy>(std::move(later), std::move(sources));
    deferral->copy->SetRecorded(
        std::move(recorded), [this, group = caller.group, module = end.module] {
          // The copy is complete: a record without its entries, before its segments may be
          // reused. Not fsynced: the segments die with the machine, as the record's shards.
          records_.EditAndRecord(
              group, module, [](Registered&) { return true; }, /*sync=*/false);
        });
    deferral->gaps = std::move(gaps);
    return status;
  }
  if (background) {
    copy.reset();
    CommitInBackground(end, std::move(later), std::move(sources));
    // Done for every reader: each finishes the copy before it reads the committed copies.
    records_.CommitDone(caller, end.module, end.target());
    return status;
  }
  copy.reset();
  if (end.batched) return status;  // EndArrive copies, once every local rank got here
  if (fused) {
    records_.CommitDone(caller, end.module, end.target());
    return status;
  }
  // Restarts: this rank's shards hold the new generation completely; recorded durably before
  // its committed copy is overwritten (server/durable/).
  if (status.ok()) records_.CommitReady(caller, end.module, end.target(), end.kind());
  if (status.ok()) records_.TestingPauseMidCopy(caller.rank, end.durable);
  if (status.ok()) status = records_.CopyCommitted(caller.rank, end.durable, /*to_committed=*/true);
  if (status.ok()) records_.CommitDone(caller, end.module, end.target());
  if (!status.ok()) {
    FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                  << ": writeback failed after every rank agreed: " << status;
  }
  return status;
}

void Modules::FinishAppliedEnd(const WritebackEnd& end, absl::Status s, StatusCallback done) {
  AfterUnlock run;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(end.caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto found = g.removed ? g.registered.end() : g.registered.find(end.module);
    if (found != g.registered.end()) {  // not dropped (lost at a re-form) meanwhile
      Registered& reg = found->second;
      if (s.ok() && end.is_init && reg.init_undone) {
        // The re-form undid the initialisation while this End copied (UndoInitLocked).
        reg.initialized = false;
        reg.pending_commit.reset();
        records_.PersistModuleLater(g, end.module, &run);
        s = absl::FailedPreconditionError(absl::StrCat("summon ", end.summon, ": module ",
                                                       Display(end.module), ": ",
                                                       reg.uninitialized_why, "; register again"));
      }
      if (s.ok() && !end.is_init) reg.generation[end.caller.rank] = end.generation + 1;
      DoneCopying(g, reg, &run);
    }
  }
  run.Run();
  if (end.is_init) {
    // Initialised here only once every local rank's init End applied (init_undo.cc).
    end.SettleInit(*this, std::move(s), std::move(done));
    return;
  }
  FinishEnd(end.caller, end.summon, std::move(s), std::move(done));
}

void Modules::Agree(const std::shared_ptr<collective::CollectiveGroup>& coll, const Caller& caller,
                    const internal::AgreeRecord& mine, int32_t world_size, int64_t unit,
                    const std::string& what, absl::Time deadline,
                    absl::AnyInvocable<void(absl::Status, bool)> done) {
  struct State {
    internal::AgreeRecord mine;
    std::vector<internal::AgreeRecord> all;
  };
  auto st = std::make_shared<State>();
  st->mine = mine;
  st->all.resize(world_size);
  std::vector<collective::CollectiveOp> ops;
  ops.push_back(collective::CollectiveOp::AllGather(
      unit, collective::ConstBuffer{&st->mine, sizeof(internal::AgreeRecord)},
      collective::MutableBuffer{st->all.data(), st->all.size() * sizeof(internal::AgreeRecord)}));
  ops.back().name = "agree";
  coll->SubmitAll(
      caller.rank, std::move(ops), deadline - clock_->Now(),
      [st, group = caller.group, what, done = std::move(done)](absl::Status s) mutable {
        if (!s.ok()) {
          done(std::move(s), false);
          return;
        }
        // A refusal is every rank's verdict (each got the same records): marked as such,
        // unlike a failed all-gather, whose outcome other ranks may not share.
        auto refused = [](absl::Status s) {
          s.SetPayload(internal::kAgreeRefusedPayload, absl::Cord("refused"));
          return s;
        };
        for (size_t k = 0; k < st->all.size(); ++k) {
          const internal::AgreeRecord& r = st->all[k];
          if (r.ok) continue;
          done(refused(absl::FailedPreconditionError(
                   absl::StrCat("group ", group, ": ", what, " was refused by rank ", k, ": ",
                                internal::TextOf(r.text, sizeof(r.text))))),
               std::any_of(st->all.begin(), st->all.end(),
                           [](const internal::AgreeRecord& x) { return x.stale != 0; }));
          return;
        }
        for (size_t k = 1; k < st->all.size(); ++k) {
          if (st->all[k].generation == st->all[0].generation) continue;
          done(refused(absl::FailedPreconditionError(absl::StrCat(
                   "group ", group, ": ", what, " was refused: rank 0 holds generation ",
                   st->all[0].generation, ", rank ", k, " generation ", st->all[k].generation))),
               false);
          return;
        }
        done(absl::OkStatus(), false);
      });
}

}  // namespace flatshard::server
