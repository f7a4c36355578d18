// GroupManager: summons (unshard, writeback, rank0_only), kept buffers, gradients.

#include "server/group_manager.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/reduce.h"

#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::ConstOf;
using internal::Display;
using internal::kAlreadyUnsharding;
using internal::MutableOf;
using internal::SelectUnits;

std::shared_ptr<KeptBuffers> GroupManager::KeptOf(Registered& reg) {
  if (!reg.kept) reg.kept = kept_pool_->NewSet();
  return reg.kept;
}

void GroupManager::ReleaseKept(Registered& reg) {
  if (reg.kept) reg.kept->Release();
}

// ---- Summon, step by step ----
// 1. Summon: the trainer's writes to its shards land first (RankDevices::AfterTrainerWrites;
//    off the caller's thread for GPU ranks).
// 2. SummonWritten: DecideSummon (under mu_) checks the call and lists the view buffers not at
//    hand; GetViewBuffers takes them from the module's kept buffers WITHOUT mu_ (allocation:
//    shm create, fchown, cudaHostRegister); then, under mu_ again, DecideSummon runs afresh
//    (anything may have changed in the gap) and OpenSummonLocked opens the summon once every
//    buffer is at hand. Nothing of the group changes before that last step, so a failed
//    allocation, a session that ended or a group that failed in the gap leave no trace.
// 3. CopyUnsharded (NO_SHARD: the shard is the whole buffer), without mu_ and for GPU ranks on
//    the device's worker; then StartUnshard submits the all-gathers and answers once the
//    views are whole.

// One view buffer a summon (or a rank0_only End) needs from the module's kept buffers.
struct GroupManager::ViewNeed {
  int32_t unit = 0;
  KeptUse use = KeptUse::kParams;
  KeptKey key;
  int64_t bytes = 0;
  std::string label;
};

// What a summon of one rank needs, as DecideSummon found it.
struct GroupManager::SummonDecision {
  std::vector<int32_t> units;
  bool sharded = false;
  bool shared = false;  // one read-only copy per node, assembled by the local ranks together
  Placement placement;  // of the views
  int64_t owner_uid = -1;
  std::shared_ptr<KeptBuffers> kept;
  std::vector<ViewNeed> needs;  // view buffers to get (a slot's node copy already made is not one)
  // Read-only summons (`shared`): the slot of this summon, the node copies this rank would
  // make, and whether another local rank is making one this summon needs.
  std::shared_ptr<SummonSlot> slot;
  std::vector<std::pair<int32_t, KeptUse>> make;
  bool wait = false;
};

// A summon OpenSummonLocked opened: what the steps after mu_ need.
struct GroupManager::SummonStart {
  SummonResult result;
  std::vector<collective::CollectiveOp> ops;
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::shared_ptr<SummonSlot> shared_slot;  // a read-only copy several local ranks assemble
  int32_t shared_locals = 0;
  // NO_SHARD: the whole shard into the view (dst, src).
  std::vector<std::pair<std::shared_ptr<Buffer>, std::shared_ptr<Buffer>>> copies;
};

namespace {

// Takes the buffers of `needs` not in `got` yet from `kept`. Allocates: REQUIRES no mu_.
template <typename Needs, typename Got>
absl::Status GetViewBuffers(KeptBuffers& kept, const Needs& needs, BufferKind kind,
                            int64_t owner_uid, Placement placement, Got* got) {
  for (const auto& need : needs) {
    if (got->contains({need.unit, need.use})) continue;
    absl::StatusOr<std::shared_ptr<Buffer>> b =
        kept.Get(need.key, kind, need.bytes, need.label, owner_uid, placement);
    if (!b.ok()) return b.status();
    (*got)[{need.unit, need.use}] = *std::move(b);
  }
  return absl::OkStatus();
}

// Takes the buffers of `needs` not in `got` yet that `kept` has ready (no allocation, no
// syscall: safe under mu_).
template <typename Needs, typename Got>
void TryKept(KeptBuffers& kept, const Needs& needs, Placement placement, Got* got) {
  for (const auto& need : needs) {
    if (got->contains({need.unit, need.use})) continue;
    if (std::shared_ptr<Buffer> b = kept.TryGet(need.key, placement)) {
      (*got)[{need.unit, need.use}] = std::move(b);
    }
  }
}

template <typename Needs, typename Got>
bool AllAtHand(const Needs& needs, const Got& got) {
  for (const auto& need : needs) {
    if (!got.contains({need.unit, need.use})) return false;
  }
  return true;
}

// A summon re-decides after each round of allocations; a round only repeats when a node copy
// another local rank was making vanished in the gap (its slot was dropped), so this bound is
// never reached in practice.
constexpr int kSummonRounds = 4;

}  // namespace

void GroupManager::Summon(const Caller& caller, const std::string& module,
                          const std::string& path, const SummonOptions& options,
                          absl::Time deadline, SummonCallback done,
                          const gpu::IpcEventRef& written) {
  // The trainer's last writes to its shards (an optimizer step) land before they are read.
  devices_.AfterTrainerWrites(
      caller.rank, written,
      [this, caller, module, path, options, deadline, done = std::move(done)](
          absl::Status s) mutable {
        if (!s.ok()) {
          done(std::move(s));
          return;
        }
        SummonWritten(caller, module, path, options, deadline, std::move(done));
      });
}

void GroupManager::UnmarkMaking(std::shared_ptr<SummonSlot> slot,
                                std::vector<std::pair<int32_t, KeptUse>>* marked,
                                AfterUnlock* waiting) {
  for (const auto& m : *marked) slot->making.erase(m);
  marked->clear();
  for (auto& w : slot->on_made) waiting->Call(std::move(w));
  slot->on_made.clear();
}

void GroupManager::SummonWritten(const Caller& caller, const std::string& module,
                                 const std::string& path, const SummonOptions& options,
                                 absl::Time deadline, SummonCallback done) {
  auto start = std::make_shared<SummonStart>();
  ViewBuffers got;  // held across rounds; dropped (back to the cache, unused) when done
  // The slot whose node copies this summon is making without mu_ (SummonSlot::making), and
  // the other local ranks' summons that wait for them, run again once mu_ is released.
  std::shared_ptr<SummonSlot> making;
  std::vector<std::pair<int32_t, KeptUse>> marked;  // in making->making, by this summon
  AfterUnlock waiting;
  absl::Status error;
  bool parked = false;  // `done` went to the slot's on_made
  std::shared_ptr<Group> held = FindGroup(caller.group);
  if (held == nullptr) {
    done(absl::NotFoundError(absl::StrCat("unknown group ", caller.group)));
    return;
  }
  Group& g = *held;
  for (int round = 0;; ++round) {
    SummonDecision decision;
    bool opened = false;
    {
      absl::MutexLock lock(&g.mu);
      // Our marks go whatever happens next; the ranks that waited for them decide afresh.
      if (making != nullptr) UnmarkMaking(std::move(making), &marked, &waiting);
      error = DecideSummon(g, caller, module, path, options, &decision);
      if (error.ok() && decision.wait) {
        // Another local rank is making a node copy this summon shares: decide again once it
        // made it (or gave up), instead of allocating a second one.
        decision.slot->on_made.push_back(
            [this, caller, module, path, options, deadline, done = std::move(done)]() mutable {
              SummonWritten(caller, module, path, options, deadline, std::move(done));
            });
        parked = true;
      } else if (error.ok()) {
        // The steady state (every buffer kept, committed and unused) needs no allocation: the
        // summon opens in this one critical section.
        TryKept(*decision.kept, decision.needs, decision.placement, &got);
        if (AllAtHand(decision.needs, got)) {
          OpenSummonLocked(g, caller, module, path, options, decision, got, start.get());
          opened = true;
        } else if (!decision.make.empty()) {
          // Invariant: while `making` is marked, the other local ranks' k-th summons wait
          // for this one (on_made) rather than make the same node copy; the marks go at the
          // next re-take of mu_, on every path.
          making = decision.slot;
          for (const auto& m : decision.make) {
            if (making->making.insert(m).second) marked.push_back(m);
          }
        }
      }
    }
    if (parked || opened) break;
    if (error.ok() && round + 1 == kSummonRounds) {
      error = absl::AbortedError(absl::StrCat("group ", caller.group, " rank ", caller.rank,
                                              ": the buffers of the summon of ", Display(path),
                                              " changed ", kSummonRounds,
                                              " times while being allocated; summon again"));
    }
    // Without mu_: the kept-buffer cache allocates what is missing. The cache outlives the
    // module if that is dropped meanwhile (the next round then fails with NOT_FOUND).
    if (error.ok()) {
      error = GetViewBuffers(*decision.kept, decision.needs, BufferKind::kUnsharded,
                             decision.owner_uid, decision.placement, &got);
    }
    if (!error.ok()) {
      if (making != nullptr) {
        absl::MutexLock lock(&g.mu);
        UnmarkMaking(std::move(making), &marked, &waiting);
      }
      break;
    }
  }
  got.clear();
  held = nullptr;
  waiting.Run();
  if (parked) return;  // runs again from on_made
  if (!error.ok()) {
    done(error);
    return;
  }
  if (start->copies.empty()) {
    StartUnshard(caller, deadline, std::move(start), std::move(done));
    return;
  }
  // NO_SHARD: the views are copies of the shards. The unit is marked summoned, so no End or
  // reduce-scatter of this rank touches these buffers until the summon is answered.
  devices_.RunBlocking(
      caller.rank,
      [this, rank = caller.rank, start] {
        for (const auto& [dst, src] : start->copies) {
          FS_RETURN_IF_ERROR(devices_.CopyBytes(rank, dst->data(), src->data(),
                                                static_cast<size_t>(src->bytes())));
        }
        return absl::OkStatus();
      },
      [this, caller, deadline, start, done = std::move(done)](absl::Status s) mutable {
        start->copies.clear();
        if (!s.ok()) {
          // Nothing was handed out: end the summon without writeback.
          FinishEnd(caller, start->result.summon, s,
                    [done = std::move(done), s](absl::Status) mutable { done(s); });
          return;
        }
        StartUnshard(caller, deadline, std::move(start), std::move(done));
      });
}

absl::StatusOr<GroupManager::Registered*> GroupManager::InitializedModule(
    Group& g, const std::string& module) {
  auto it = g.registered.find(module);
  if (it == g.registered.end()) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(module), " is not registered"));
  }
  // Never zeros as the model: CheckUsable says why it is not initialised.
  if (!it->second.initialized) return CheckUsable(g, module, it->second);
  return &it->second;
}

absl::Status GroupManager::DecideSummon(Group& g, const Caller& caller,
                                        const std::string& module, const std::string& path,
                                        const SummonOptions& options, SummonDecision* d) {
  FS_RETURN_IF_ERROR(shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                               : CheckCallerLocked(g, caller));
  FS_ASSIGN_OR_RETURN(Registered * found, InitializedModule(g, module));
  Registered& reg = *found;
  if (!FindModulePath(reg.manifest, path)) {
    return absl::NotFoundError(
        absl::StrCat("module ", Display(module), " has no submodule ", Display(path)));
  }
  const int32_t rank = caller.rank;
  d->units = SelectUnits(reg.plan, path, options.recurse);
  for (int32_t u : d->units) {
    if (reg.summoned[rank][u]) {
      return absl::FailedPreconditionError(absl::StrCat(
          kAlreadyUnsharding, " (unit ", u, " ", Display(reg.plan.units[u].module), ")"));
    }
  }
  d->sharded = reg.plan.shard_world_size > 1;
  // One read-only copy per node; GPU ranks each need theirs on their own device.
  d->shared = !options.writeback && !options.rank0_only && d->sharded && gpus_.empty();
  // GPU ranks: device views, or pinned host views under offload_to_cpu (the collective
  // stages them through the device).
  d->placement = gpus_.empty() || !options.offload_to_cpu ? PlacementOf(rank)
                                                          : Placement::Pinned();
  d->owner_uid = g.owner_uid;
  d->kept = KeptOf(reg);
  // The slot this summon will meet the other local ranks' in: its node copies may be made
  // (or being made) already.
  if (d->shared) {
    std::shared_ptr<SummonSlot>& slot = reg.slots[reg.summon_count[rank] + 1];
    if (!slot) slot = std::make_shared<SummonSlot>();
    d->slot = slot;
  }
  for (int32_t u : d->units) {
    const PlanUnit& unit = reg.plan.units[u];
    const UnitShard& shard = reg.shards_by_rank[rank][u];
    for (KeptUse use : {KeptUse::kParams, KeptUse::kGrads}) {
      // Gradients exist for every rank of a unit or for none (made by one collective).
      if (use == KeptUse::kGrads && !(options.with_grads && shard.grad)) continue;
      const std::string label = absl::StrCat("group=", g.id, " unit=", u, " ",
                                             use == KeptUse::kParams ? "params" : "grads");
      const int64_t bytes = unit.padded_numel * ItemSize(unit.dtype);
      // Buffers this rank sees: shared per node (read-only use), rank 0's only, or private.
      if (options.rank0_only) {
        if (rank == 0) {
          d->needs.push_back({u, use, KeptKey::Rank(0, u, use), bytes,
                              absl::StrCat(label, " rank=0")});
        }
      } else if (d->shared) {
        const auto& map =
            use == KeptUse::kParams ? d->slot->shared_params : d->slot->shared_grads;
        if (map.contains(u) && map.at(u) != nullptr) continue;  // another rank made it
        if (d->slot->making.contains({u, use})) {
          d->wait = true;  // another rank is making it
          continue;
        }
        d->needs.push_back({u, use, KeptKey::NodeShared(u, use), bytes, label});
        d->make.emplace_back(u, use);
      } else {
        d->needs.push_back({u, use, KeptKey::Rank(rank, u, use), bytes,
                            absl::StrCat(label, " rank=", rank)});
      }
    }
  }
  return absl::OkStatus();
}

void GroupManager::OpenSummonLocked(Group& g, const Caller& caller, const std::string& module,
                                    const std::string& path, const SummonOptions& options,
                                    const SummonDecision& d, const ViewBuffers& got,
                                    SummonStart* out) {
  Registered& reg = g.registered.at(module);
  const int32_t rank = caller.rank;
  const uint64_t k = ++reg.summon_count[rank];
  std::shared_ptr<SummonSlot>& slot = reg.slots[k];
  if (!slot) slot = std::make_shared<SummonSlot>();
  OpenSummon open;
  open.id = g.next_summon++;
  open.rank = rank;
  open.k = k;
  open.module = module;
  open.options = options;
  open.units = d.units;
  open.slot = slot;
  open.coll = g.coll;
  // The buffer this rank sees of (unit, use): rank 0's only, the node's copy (the first local
  // rank's to arrive), or its own.
  auto view_of = [&](int32_t u, KeptUse use) -> std::shared_ptr<Buffer> {
    const bool params = use == KeptUse::kParams;
    if (options.rank0_only) {
      if (rank != 0) return nullptr;
      auto& rank0 = params ? slot->rank0_params : slot->rank0_grads;
      return rank0[u] = got.at({u, use});
    }
    if (d.shared) {
      std::shared_ptr<Buffer>& node = (params ? slot->shared_params : slot->shared_grads)[u];
      if (!node) node = got.at({u, use});
      return node;
    }
    return got.at({u, use});
  };
  for (int32_t u : d.units) {
    const PlanUnit& unit = reg.plan.units[u];
    const UnitShard& shard = reg.shards_by_rank[rank][u];
    // Sharded: the all-gather (a gather to rank 0 under rank0_only) fills the view; NO_SHARD:
    // the shard is the whole buffer, copied after mu_ (CopyUnsharded).
    auto unshard = [&](const std::shared_ptr<Buffer>& from, const std::shared_ptr<Buffer>& to) {
      if (!d.sharded) {
        if (to != nullptr) out->copies.emplace_back(to, from);
        return;
      }
      out->ops.push_back(options.rank0_only
                             ? collective::CollectiveOp::Gather(u, ConstOf(*from, unit.dtype),
                                                                MutableOf(to.get(), unit.dtype), 0)
                             : collective::CollectiveOp::AllGather(
                                   u, ConstOf(*from, unit.dtype), MutableOf(to.get(), unit.dtype)));
    };
    SummonedUnit view{u, nullptr, nullptr};
    view.params = view_of(u, KeptUse::kParams);
    unshard(shard.shard, view.params);
    // Gradients exist for every rank of a unit or for none (made by one collective).
    if (options.with_grads && shard.grad) {
      view.grads = view_of(u, KeptUse::kGrads);
      unshard(shard.grad, view.grads);
    }
    open.views.push_back(std::move(view));
  }
  for (int32_t u : d.units) reg.summoned[rank][u] = true;
  reg.NoteOp(d.units, "summon", rank, true, clock_->Now());
  SummonResult& result = out->result;
  result.summon = open.id;
  result.units = d.units;
  if (d.units.empty()) result.note = absl::StrCat(Display(path), " is not a unit root: nothing unsharded");
  if (!options.rank0_only || rank == 0) result.views = open.views;
  g.open_summons.emplace(open.id, std::move(open));
  out->coll = g.coll;
  if (d.shared && !out->ops.empty() && g.local_ranks.size() > 1) {
    out->shared_slot = slot;
    out->shared_locals = static_cast<int32_t>(g.local_ranks.size());
  }
}

void GroupManager::StartUnshard(const Caller& caller, absl::Time deadline,
                                std::shared_ptr<SummonStart> start, SummonCallback done) {
  const uint64_t id = start->result.summon;
  auto finish = [this, caller, id, result = std::move(start->result),
                 done = std::move(done)](absl::Status s) mutable {
    if (!s.ok()) {
      // Nothing was handed out: end the summon without writeback.
      FinishEnd(caller, id, s, [done = std::move(done), s](absl::Status) mutable { done(s); });
      return;
    }
    if (std::shared_ptr<Group> held = FindGroup(caller.group)) {
      absl::MutexLock lock(&held->mu);
      auto it = held->open_summons.find(id);
      if (it != held->open_summons.end()) it->second.ready = true;
    }
    result.ready = RecordReady(caller.rank);  // cudaEventRecord: no host wait
    done(std::move(result));
  };
  std::shared_ptr<SummonSlot> shared_slot = std::move(start->shared_slot);
  if (shared_slot == nullptr) {
    start->coll->SubmitAll(caller.rank, std::move(start->ops), deadline - clock_->Now(),
              std::move(finish));
    return;
  }
  // The node's one read-only copy is assembled by every local rank's op together (each
  // block lands once, through whichever local rank receives it), so one rank's op may
  // complete before the copy is whole: every local rank answers once all of theirs have
  // completed, with the first error if any did not (bounded by the ops' deadlines).
  start->coll->SubmitAll(caller.rank, std::move(start->ops), deadline - clock_->Now(),
            [this, shared_slot, local = start->shared_locals,
             finish = std::move(finish)](absl::Status s) mutable {
              std::vector<absl::AnyInvocable<void(absl::Status)>> ready;
              absl::Status verdict;
              {
                absl::MutexLock lock(&shared_slot->assembly_mu);
                if (!s.ok() && shared_slot->assembly_error.ok()) shared_slot->assembly_error = s;
                ++shared_slot->assembled;
                shared_slot->waiting.push_back(std::move(finish));
                // A failure answers at once (a rank that died never submits: nobody waits
                // for it); success waits for the last local rank.
                if (shared_slot->assembly_error.ok() && shared_slot->assembled < local) return;
                ready.swap(shared_slot->waiting);
                verdict = shared_slot->assembly_error;
              }
              for (auto& f : ready) f(verdict);
            });
}

absl::Status GroupManager::PrepareRank0Broadcast(
    const Caller& caller, uint64_t summon, const Plan& plan, const std::vector<UnitShard>& shards,
    const std::shared_ptr<KeptBuffers>& kept, const std::vector<ViewNeed>& needs,
    int64_t owner_uid, OpenSummon* copy, std::vector<collective::CollectiveOp>* broadcasts) {
  // Without mu_: the kept-buffer cache may allocate.
  ViewBuffers got;
  absl::Status status = GetViewBuffers(*kept, needs, BufferKind::kUnsharded, owner_uid,
                                       PlacementOf(caller.rank), &got);
  std::shared_ptr<Group> held = FindGroup(caller.group);
  if (held == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "group ", caller.group, " rank ", caller.rank, ": summon ", summon,
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

void GroupManager::EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline,
                             StatusCallback done, const gpu::IpcEventRef& written) {
  // The trainer's writes to the views land before they are written back. A failure here is
  // this rank's "no" in the agreement, so the other ranks fail at once too.
  devices_.AfterTrainerWrites(
      caller.rank, written,
      [this, caller, summon, deadline, done = std::move(done)](absl::Status local) mutable {
        EndSummonWritten(caller, summon, deadline, std::move(done), std::move(local));
      });
}

void GroupManager::EndSummonWritten(const Caller& caller, uint64_t summon, absl::Time deadline,
                                    StatusCallback done, absl::Status local) {
  absl::Status error;
  OpenSummon copy;
  const Plan* plan = nullptr;
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::vector<UnitShard> shards;
  std::vector<internal::DurablePair> durable;  // what an agreed writeback commits
  std::vector<collective::CollectiveOp> broadcasts;
  internal::AgreeRecord record{};
  int32_t world_size = 0;
  bool is_init = false;
  absl::Status reformed;  // the summon predates the group's re-form
  // rank0_only writeback: the buffers rank 0's broadcast lands in that are not at hand yet.
  std::vector<ViewNeed> rank0_needs;
  std::shared_ptr<KeptBuffers> rank0_kept;
  int64_t owner_uid = -1;
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(g, caller);
    if (error.ok()) {
      auto it = g.open_summons.find(summon);
      auto failed = g.failed_ends.find(summon);
      if (it == g.open_summons.end() && failed != g.failed_ends.end() &&
          failed->second.first == caller.rank) {
        error = failed->second.second;  // a repeated End: the first one's cause
      } else if (it == g.open_summons.end() || it->second.rank != caller.rank) {
        error = absl::NotFoundError(absl::StrCat("group ", g.id, " rank ", caller.rank,
                                                 ": no open summon ", summon));
      } else if (it->second.ending || !it->second.ready) {
        error = absl::FailedPreconditionError(
            absl::StrCat("summon ", summon, " is ", it->second.ending ? "already ending" : "not ready"));
      } else if (it->second.options.writeback && it->second.coll != nullptr &&
                 it->second.coll != g.coll) {
        // Opened before the group failed and re-formed: the other ranks' halves of this
        // summon are gone, so it cannot commit anywhere. The first failure is the cause.
        reformed = absl::UnavailableError(absl::StrCat(
            "summon ", summon, ": no rank's writeback was applied: the group re-formed since "
            "it was opened, after: ", it->second.coll->status().message()));
      } else {
        it->second.ending = true;
        copy = it->second;
        Registered& reg = g.registered.at(copy.module);
        plan = &reg.plan;  // registrations are never removed while the group lives
        shards = reg.shards_by_rank[caller.rank];
        durable = internal::DurableBuffers(reg, caller.rank);
        coll = g.coll;
        world_size = g.world_size;
        is_init = !reg.initialized;
        std::memset(&record, 0, sizeof(record));
        record.ok = local.ok() && !reg.stale[caller.rank] ? 1 : 0;
        record.stale = reg.stale[caller.rank] ? 1 : 0;
        record.generation = reg.generation[caller.rank];
        internal::CopyText(!local.ok() ? std::string(local.message())
                           : record.stale
                               ? absl::StrCat("its views predate the rollback to generation ",
                                              record.generation, " (read them again first)")
                               : std::string(),
                           record.text, sizeof(record.text));
        if (copy.options.writeback && reg.rollback_pending) {
          error = absl::UnavailableError(absl::StrCat(
              "group ", g.id, ": module ", Display(copy.module),
              " is being rolled back to its committed generation; end the summon again"));
          it->second.ending = false;
        }
        if (error.ok() && copy.options.rank0_only && copy.options.writeback) {
          // Rank 0's broadcast lands in buffers got without mu_ (PrepareRank0Broadcast): the
          // node's copy where no local rank has made it yet (host ranks; rank 0 uses its own
          // views), or each GPU rank's own copy on its device.
          rank0_kept = KeptOf(reg);
          owner_uid = g.owner_uid;
          for (int32_t u : copy.units) {
            const PlanUnit& unit = plan->units[u];
            for (KeptUse use : {KeptUse::kParams, KeptUse::kGrads}) {
              if (use == KeptUse::kGrads && !(copy.options.with_grads && shards[u].grad)) continue;
              const auto& map =
                  use == KeptUse::kParams ? copy.slot->rank0_params : copy.slot->rank0_grads;
              const bool node = gpus_.empty() || caller.rank == 0;
              if (node && map.contains(u) && map.at(u) != nullptr) continue;
              rank0_needs.push_back(
                  {u, use,
                   gpus_.empty() ? KeptKey::NodeRank0Copy(u, use)
                                 : KeptKey::RankRank0Copy(caller.rank, u, use),
                   unit.padded_numel * ItemSize(unit.dtype),
                   absl::StrCat("group=", g.id, " unit=", u, " rank 0's copy")});
            }
          }
        }
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  if (!reformed.ok()) {
    FinishEnd(caller, summon, std::move(reformed), std::move(done));
    return;
  }
  if (copy.options.rank0_only && copy.options.writeback) {
    error = PrepareRank0Broadcast(caller, summon, *plan, shards, rank0_kept, rank0_needs,
                                  owner_uid, &copy, &broadcasts);
    if (!error.ok()) {
      done(error);
      return;
    }
  }
  const SummonOptions options = copy.options;
  auto owned = std::make_unique<OpenSummon>(std::move(copy));
  if (!options.writeback) {
    // A read-only End waits for nobody.
    owned.reset();
    FinishEnd(caller, summon, local, std::move(done));
    return;
  }
  // Writes back this rank's ranges and commits its shards. Takes the copy and lets its
  // buffer references go, so FinishEnd sees which kept buffers nobody uses any more.
  // Restarts, host daemons with a state directory: the copies into the committed copies wait
  // until every local rank has written back into its shards (EndArrive), so that a daemon
  // killed during them comes back with every rank at one generation.
  const bool batched = state_dir_ != nullptr && gpus_.empty();
  auto write_back = [this, plan, shards, durable, caller, module = owned->module, is_init,
                     target = is_init ? record.generation : record.generation + 1, batched](
                        std::unique_ptr<OpenSummon> copy) {
    const int32_t r = plan->ShardRank(caller.rank);
    absl::Status status;
    for (size_t i = 0; i < copy->units.size() && status.ok(); ++i) {
      const int32_t u = copy->units[i];
      const PlanUnit& unit = plan->units[u];
      const UnitShard& shard = shards[u];
      const bool from_rank0 = copy->options.rank0_only;
      auto rank0_copy = [&](int what) -> const Buffer* {
        auto own = copy->own_rank0.find({u, what});
        if (own != copy->own_rank0.end()) return own->second.get();
        const auto& map = what == 0 ? copy->slot->rank0_params : copy->slot->rank0_grads;
        return map.contains(u) ? map.at(u).get() : nullptr;
      };
      const Buffer* params = from_rank0 ? rank0_copy(0) : copy->views[i].params.get();
      status = devices_.CopyOwnRange(caller.rank, *plan, unit, r, *params, *shard.shard);
      const Buffer* grads = from_rank0 ? rank0_copy(1) : copy->views[i].grads.get();
      if (status.ok() && grads != nullptr && shard.grad) {
        status = devices_.CopyOwnRange(caller.rank, *plan, unit, r, *grads, *shard.grad);
      }
    }
    copy.reset();
    if (batched) return status;  // EndArrive copies, once every local rank got here
    // Restarts: this rank's shards hold the new generation completely; recorded durably before
    // its committed copy is overwritten (group_manager_state.cc).
    if (status.ok()) CommitReady(caller, module, target, is_init ? "init" : "end");
    if (status.ok()) TestingPauseMidCopy(caller.rank, durable);
    if (status.ok()) status = CopyCommitted(caller.rank, durable, /*to_committed=*/true);
    if (status.ok()) CommitDone(caller, module, target);
    if (!status.ok()) {
      FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                    << ": writeback failed after every rank agreed: " << status;
    }
    return status;
  };
  // Every rank agreed: this rank applies (the daemon does, whatever its trainer does now).
  // Held in a shared_ptr so that, while a checkpoint holds the committed copies, it can queue
  // itself to run again once the checkpoint is done (Registered::after_ckpt).
  using ApplyFn = std::function<void(std::unique_ptr<OpenSummon>, StatusCallback)>;
  auto apply = std::make_shared<ApplyFn>();
  *apply = [this, caller, summon, module = owned->module, is_init, generation = record.generation,
            write_back, batched, k = owned->k, durable,
            self = std::weak_ptr<ApplyFn>(apply)](std::unique_ptr<OpenSummon> owned,
                                                  StatusCallback done) mutable {
    {
      std::shared_ptr<Group> held = GroupOrGone(caller.group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (!g.removed) {
        Registered& reg = g.registered.at(module);
        if (reg.ckpt_hold > 0) {
          reg.after_ckpt.push_back(
              [fn = self.lock(), owned = std::move(owned), done = std::move(done)]() mutable {
                (*fn)(std::move(owned), std::move(done));
              });
          return;
        }
        ++reg.busy;
        NoteCommitAgreed(reg, is_init ? generation : generation + 1, is_init ? "init" : "end");
      }
    }
    auto finish = [this, caller, summon, module, is_init, generation,
                   done = std::move(done)](absl::Status s) mutable {
          AfterUnlock run;
          {
            std::shared_ptr<Group> held = GroupOrGone(caller.group);
            Group& g = *held;
            absl::MutexLock lock(&g.mu);
            if (!g.removed) {
              Registered& reg = g.registered.at(module);
              if (s.ok()) {
                if (is_init) {
                  reg.initialized = true;
                  reg.uninitialized_why.clear();
                  FS_LOG(INFO) << "group=" << caller.group << " rank=" << caller.rank
                               << " module=" << Display(module)
                               << " initialised on every rank (generation 0)";
                } else {
                  reg.generation[caller.rank] = generation + 1;
                }
              }
              DoneCopying(g, reg, &run);
            }
          }
          run.Run();
          FinishEnd(caller, summon, std::move(s), std::move(done));
    };
    if (batched) {
      // Host ranks: the writeback runs here; the copy waits for the other local ranks.
      absl::Status s = write_back(std::move(owned));
      EndArrive(caller, module, k, is_init ? generation : generation + 1,
                is_init ? "init" : "end", std::move(s), durable, std::move(finish));
      return;
    }
    // The copies run without mu_ (GPU ranks: on the device's worker, not on the engine's
    // thread). Invariant: `busy`, taken above, keeps every rollback out until DoneCopying, and
    // the summon is `ending`, so no other call touches its views or this rank's shards' copy.
    devices_.RunBlocking(
        caller.rank,
        [write_back, owned = std::move(owned)]() mutable { return write_back(std::move(owned)); },
        std::move(finish));
  };
  auto agree = [this, caller, summon, coll, record, world_size, deadline, apply, batched,
                k = owned->k, module = owned->module](std::unique_ptr<OpenSummon> owned,
                                                      StatusCallback done) mutable {
    Agree(coll, caller, record, world_size, internal::kEndAgreeUnit,
          absl::StrCat("the writeback of summon ", summon),
          deadline,
          [this, caller, summon, apply, module, batched, k, owned = std::move(owned),
           done = std::move(done)](absl::Status s, bool stale) mutable {
            if (s.ok()) {
              (*apply)(std::move(owned), std::move(done));
              return;
            }
            owned.reset();
            if (batched) EndNotApplied(caller, module, k);
            if (stale) RollbackRank(caller, module);
            FinishEnd(caller, summon,
                      absl::Status(s.code(), absl::StrCat("summon ", summon,
                                                          ": no rank's writeback was applied: ",
                                                          s.message())),
                      std::move(done));
          });
  };
  if (!options.rank0_only) {
    agree(std::move(owned), std::move(done));
    return;
  }
  coll->SubmitAll(
      caller.rank, std::move(broadcasts), deadline - clock_->Now(),
      [this, caller, summon, agree, owned = std::move(owned),
       done = std::move(done)](absl::Status s) mutable {
        if (s.ok()) {
          agree(std::move(owned), std::move(done));
          return;
        }
        owned.reset();
        FinishEnd(caller, summon,
                  absl::Status(s.code(),
                               absl::StrCat("summon ", summon,
                                            ": no rank's writeback was applied: ", s.message())),
                  std::move(done));
      });
}

void GroupManager::Agree(const std::shared_ptr<collective::CollectiveGroup>& coll,
                         const Caller& caller, const internal::AgreeRecord& mine,
                         int32_t world_size, int64_t unit, const std::string& what,
                         absl::Time deadline,
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
        for (size_t k = 0; k < st->all.size(); ++k) {
          const internal::AgreeRecord& r = st->all[k];
          if (r.ok) continue;
          done(absl::FailedPreconditionError(
                   absl::StrCat("group ", group, ": ", what, " was refused by rank ", k, ": ",
                                internal::TextOf(r.text, sizeof(r.text)))),
               std::any_of(st->all.begin(), st->all.end(),
                           [](const internal::AgreeRecord& x) { return x.stale != 0; }));
          return;
        }
        for (size_t k = 1; k < st->all.size(); ++k) {
          if (st->all[k].generation == st->all[0].generation) continue;
          done(absl::FailedPreconditionError(absl::StrCat(
                   "group ", group, ": ", what, " was refused: rank 0 holds generation ",
                   st->all[0].generation, ", rank ", k, " generation ", st->all[k].generation)),
               false);
          return;
        }
        done(absl::OkStatus(), false);
      });
}

void GroupManager::ReleaseBuffers(OpenSummon& open, AfterUnlock* after) {
  for (SummonedUnit& v : open.views) {
    after->Release(v.params);
    after->Release(v.grads);
  }
  for (auto& [key, b] : open.own_rank0) after->Release(b);
  after->Release(open.slot);
}

void GroupManager::FinishEnd(const Caller& caller, uint64_t summon, absl::Status status,
                             StatusCallback done) {
  AfterUnlock after;  // the summon's buffer references go after the lock (munmap, unlink)
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto it = g.removed ? g.open_summons.end() : g.open_summons.find(summon);
    if (it != g.open_summons.end()) {
      OpenSummon& open = it->second;
      Registered& reg = g.registered.at(open.module);
      for (int32_t u : open.units) reg.summoned[open.rank][u] = false;
      // A summon that never became ready failed before anything was handed out.
      reg.NoteOp(open.units, open.ready ? "end" : "summon", open.rank, status.ok(),
                 clock_->Now());
      if (++open.slot->ended == static_cast<int32_t>(g.local_ranks.size())) {
        if (auto slot = reg.slots.find(open.k); slot != reg.slots.end()) {
          after.Destroy(reg.slots.extract(slot));
        }
      }
      if (!status.ok() && open.ready && open.options.writeback) {
        if (!reg.initialized) reg.uninitialized_why = std::string(status.message());
        g.failed_ends[summon] = {open.rank, status};
        while (g.failed_ends.size() > internal::kFailedEndsKept) {
          g.failed_ends.erase(g.failed_ends.begin());
        }
      }
      // Drops this rank's references to the buffers, so ReleaseKept sees which kept buffers
      // nobody uses any more; a last reference (the kept set dropped it) goes after the lock.
      ReleaseBuffers(open, &after);
      g.open_summons.erase(it);
      ReleaseKept(reg);
    }
  }
  after.Run();
  done(status);
}

absl::Status GroupManager::CopyCommitted(int32_t rank,
                                         const std::vector<internal::DurablePair>& durable,
                                         bool to_committed) const {
  std::vector<const Buffer*> live, kept;
  for (const internal::DurablePair& d : durable) {
    if (d.live == nullptr || d.committed == nullptr) continue;
    live.push_back(d.live.get());
    kept.push_back(d.committed.get());
  }
  return to_committed ? devices_.CopyEach(rank, live, kept) : devices_.CopyEach(rank, kept, live);
}

void GroupManager::DoneCopying(Group& g, Registered& reg,
                               AfterUnlock* run) {
  --reg.busy;
  if (reg.busy > 0 || !reg.rollback_pending) return;
  for (auto& [module, r] : g.registered) {
    if (&r == &reg) {
      RollbackNow(g, module, reg, run);
      return;
    }
  }
}

void GroupManager::StartRollback(Group& g, AfterUnlock* run) {
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

void GroupManager::RollbackNow(Group& g, const std::string& module, Registered& reg,
                               AfterUnlock* run) {
  // Deferred behind copies (DoneCopying): a module whose local ranks ended at different
  // generations is dropped as lost, never rolled back into a mix (DropMixedModules; the
  // caller returns right after, so erasing it here is safe).
  if (!internal::MixedGenerations(reg).empty() && reg.busy == 0 &&
      internal::DropMixedModules(g, absl::StrCat("at the rollback of epoch ", g.epoch), run) > 0) {
    return;
  }
  // Taking `busy` here keeps every other copy out until the rollback is done; the copies run
  // from `run`, after mu_ is released (before the join callbacks queued after them).
  ++reg.busy;
  std::vector<std::pair<int32_t, std::vector<internal::DurablePair>>> work;
  for (int32_t r : g.local_ranks) {
    if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) || reg.shards_by_rank[r].empty()) {
      continue;
    }
    work.emplace_back(r, internal::DurableBuffers(reg, r));
    reg.stale[r] = true;
  }
  run->Call([this, group = g.id, module, work = std::move(work)] {
    absl::Status status;
    for (size_t i = 0; i < work.size(); ++i) {
      absl::Status s = CopyCommitted(work[i].first, work[i].second, /*to_committed=*/false);
      if (!s.ok() && status.ok()) status = s;
    }
    AfterUnlock more;
    {
      std::shared_ptr<Group> held = GroupOrGone(group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (g.removed) return;
      auto reg = g.registered.find(module);
      if (reg == g.registered.end()) return;
      reg->second.rollback_pending = false;
      const uint64_t generation =
          work.empty() ? 0 : reg->second.generation[work.front().first];
      if (status.ok()) {
        FS_LOG(INFO) << "group=" << group << " module=" << Display(module)
                     << " rolled back to generation " << generation << " on ranks "
                     << work.size() << " local rank(s)";
      } else {
        FS_LOG(ERROR) << "group=" << group << " module=" << Display(module)
                      << ": rollback failed: " << status;
      }
      DoneCopying(g, reg->second, &more);
    }
    more.Run();
  });
}

void GroupManager::RollbackRank(const Caller& caller, const std::string& module) {
  AfterUnlock run;
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
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
      absl::Status s = CopyCommitted(caller.rank, durable, /*to_committed=*/false);
      if (!s.ok()) {
        FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                      << ": rollback after a refused commit failed: " << s;
      }
      AfterUnlock more;
      {
        std::shared_ptr<Group> held = GroupOrGone(caller.group);
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

void GroupManager::Commit(const Caller& caller, const std::string& module, absl::Time deadline,
                          CommitCallback done, const gpu::IpcEventRef& written) {
  // The optimizer's writes land before the shards are copied; a failure is this rank's "no".
  devices_.AfterTrainerWrites(
      caller.rank, written,
      [this, caller, module, deadline, done = std::move(done)](absl::Status local) mutable {
        CommitWritten(caller, module, deadline, std::move(done), std::move(local));
      });
}

void GroupManager::CommitWritten(const Caller& caller, const std::string& module,
                                 absl::Time deadline, CommitCallback done, absl::Status local) {
  absl::Status error;
  internal::AgreeRecord record{};
  std::shared_ptr<collective::CollectiveGroup> coll;
  int32_t world_size = 0;
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
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
          error = absl::FailedPreconditionError(absl::StrCat(
              "group ", g.id, " rank ", caller.rank, " holds no shards of module ",
              Display(module), " (register it first)"));
        }
        if (error.ok()) {
          std::memset(&record, 0, sizeof(record));
          record.stale = reg.stale[caller.rank] ? 1 : 0;
          record.ok = record.stale || !local.ok() ? 0 : 1;
          record.generation = reg.generation[caller.rank];
          internal::CopyText(!local.ok()    ? std::string(local.message())
                             : record.stale ? absl::StrCat("its views predate the rollback to "
                                                         "generation ",
                                                         record.generation,
                                                         " (read them again first)")
                                          : std::string(),
                             record.text, sizeof(record.text));
          coll = g.coll;
          world_size = g.world_size;
        }
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  Agree(coll, caller, record, world_size, internal::kCommitAgreeUnit,
        absl::StrCat("the commit of module ", Display(module)),
        deadline,
        [this, caller, module, generation = record.generation,
         done = std::move(done)](absl::Status s, bool stale) mutable {
          if (!s.ok()) {
            if (stale) RollbackRank(caller, module);
            done(absl::Status(s.code(), absl::StrCat("generation ", generation + 1,
                                                     " was not committed on any rank: ",
                                                     s.message())));
            return;
          }
          CommitAgreed(caller, module, generation, std::move(done));
        });
}

void GroupManager::CommitAgreed(const Caller& caller, const std::string& module,
                                uint64_t generation, CommitCallback done) {
          std::vector<internal::DurablePair> durable;
          bool gone = false;
          {
            std::shared_ptr<Group> held = GroupOrGone(caller.group);
            Group& g = *held;
            absl::MutexLock lock(&g.mu);
            gone = g.removed;
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
            NoteCommitAgreed(reg, generation + 1, "commit");
            durable = internal::DurableBuffers(reg, caller.rank);
            }
          }
          if (gone) {
            done(absl::UnavailableError(absl::StrCat("group ", caller.group, " is gone")));
            return;
          }
          // The copies run without mu_ (GPU ranks: on the device's worker). Invariant: `busy`
          // keeps every rollback out until DoneCopying.
          devices_.RunBlocking(
              caller.rank,
              [this, caller, module, generation, durable = std::move(durable)] {
                // Restarts: the intent is durable before the committed copy is overwritten,
                // the new generation before the trainer is answered (group_manager_state.cc).
                CommitReady(caller, module, generation + 1, "commit");
                TestingPauseMidCopy(caller.rank, durable);
                absl::Status s = CopyCommitted(caller.rank, durable, /*to_committed=*/true);
                if (s.ok()) CommitDone(caller, module, generation + 1);
                return s;
              },
              [this, caller, module, generation, done = std::move(done)](absl::Status s) mutable {
                AfterUnlock run;
                {
                  std::shared_ptr<Group> held = GroupOrGone(caller.group);
                  Group& g = *held;
                  absl::MutexLock lock(&g.mu);
                  if (!g.removed) {
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
                FS_VLOG(2) << "group=" << caller.group << " rank=" << caller.rank << " module="
                           << Display(module) << " committed generation " << generation + 1;
                done(generation + 1);
              });
}

absl::Status GroupManager::CheckUsable(const Group& g, const std::string& module,
                                       const Registered& reg) const {
  if (!reg.initialized) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", g.id, ": module ", Display(module),
        " is not initialised: its initial values did not commit on every rank",
        reg.uninitialized_why.empty() ? std::string(" (yet)")
                                      : absl::StrCat(" (", reg.uninitialized_why, ")"),
        "; register it again on every rank"));
  }
  if (reg.rollback_pending) {
    return absl::UnavailableError(absl::StrCat("group ", g.id, ": module ", Display(module),
                                               " is being rolled back to its committed "
                                               "generation"));
  }
  return absl::OkStatus();
}

void GroupManager::DropSummons(Group& g, int32_t rank, AfterUnlock* run) {
  for (auto it = g.open_summons.begin(); it != g.open_summons.end();) {
    OpenSummon& open = it->second;
    if (open.rank != rank) {
      ++it;
      continue;
    }
    Registered& reg = g.registered.at(open.module);
    for (int32_t u : open.units) reg.summoned[rank][u] = false;
    if (!reg.initialized && open.options.writeback && !open.ending) {
      reg.uninitialized_why = absl::StrCat("rank ", rank, "'s session ended before it ended the "
                                           "init summon");
    }
    if (++open.slot->ended == static_cast<int32_t>(g.local_ranks.size())) {
      if (auto slot = reg.slots.find(open.k); slot != reg.slots.end()) {
        run->Destroy(reg.slots.extract(slot));
      }
    }
    FS_LOG(WARNING) << "group=" << g.id << " rank=" << rank << " summon " << open.id
                    << " ended without writeback (session ended)";
    ReleaseBuffers(open, run);  // as FinishEnd
    it = g.open_summons.erase(it);
  }
  for (auto& [module, reg] : g.registered) {
    for (auto s = reg.grad_staging.begin(); s != reg.grad_staging.end();) {
      auto next = std::next(s);
      if (s->first.first == rank) run->Destroy(reg.grad_staging.extract(s));
      s = next;
    }
    for (auto s = reg.new_grads.begin(); s != reg.new_grads.end();) {
      auto next = std::next(s);
      if (s->first.first == rank) run->Destroy(reg.new_grads.extract(s));
      s = next;
    }
    ReleaseKept(reg);
  }
}

absl::StatusOr<std::shared_ptr<Buffer>> GroupManager::BeginReduceScatter(
    const Caller& caller, const std::string& module, int32_t unit) {
  // Decide under mu_, allocate without it, install under mu_ again. The buffers are only
  // installed in the last step, after every check ran afresh, so a failed allocation changes
  // nothing, and a buffer another call installed in the gap (a repeated begin) wins.
  std::shared_ptr<Buffer> grad_got, staging_got;
  for (int round = 0; round < kSummonRounds; ++round) {
    bool need_grad = false, need_staging = false;
    int64_t grad_bytes = 0, staging_bytes = 0;
    int64_t owner_uid = -1;
    std::shared_ptr<KeptBuffers> kept;
    std::string label;
    {
      std::shared_ptr<Group> held = GroupOrGone(caller.group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
      FS_ASSIGN_OR_RETURN(Registered * found, InitializedModule(g, module));
      Registered& reg = *found;
      if (unit < 0 || unit >= static_cast<int32_t>(reg.plan.units.size())) {
        return absl::NotFoundError(absl::StrCat("module ", Display(module), " has no unit ", unit,
                                                " (it has ", reg.plan.units.size(), ")"));
      }
      if (reg.plan.sharding_strategy == ShardingStrategy::kNoShard) {
        return absl::FailedPreconditionError(
            "ReduceScatterGrads on a NO_SHARD model needs an all-reduce, which this daemon does "
            "not serve yet");
      }
      const PlanUnit& u = reg.plan.units[unit];
      const int64_t item = ItemSize(u.dtype);
      const std::pair<int32_t, int32_t> key{caller.rank, unit};
      need_grad = !reg.shards_by_rank[caller.rank][unit].grad && !reg.new_grads.contains(key);
      auto staging = reg.grad_staging.find(key);
      need_staging = staging == reg.grad_staging.end() || !staging->second;
      if (need_staging && !staging_got) {
        // The steady state: the kept staging buffer is ready, no allocation needed.
        staging_got = KeptOf(reg)->TryGet(KeptKey::Rank(caller.rank, unit, KeptUse::kGradInput),
                                          PlacementOf(caller.rank));
      }
      if ((!need_grad || grad_got) && (!need_staging || staging_got)) {
        // Every buffer is at hand: install them (commit point).
        if (need_grad) reg.new_grads[key] = std::move(grad_got);
        reg.failed_finishes.erase(key);
        std::shared_ptr<Buffer>& installed = reg.grad_staging[key];
        if (need_staging) installed = std::move(staging_got);
        return installed;
      }
      grad_bytes = u.shard_numel * item;
      staging_bytes = u.padded_numel * item;
      owner_uid = g.owner_uid;
      kept = KeptOf(reg);
      label = absl::StrCat("group=", g.id, " unit=", unit, " rank=", caller.rank);
    }
    // Without mu_: shm creation, fchown, cudaHostRegister.
    if (need_grad && !grad_got) {
      FS_ASSIGN_OR_RETURN(grad_got, store_->Allocate(BufferKind::kGradShard, grad_bytes,
                                                     absl::StrCat(label, " grad"), owner_uid,
                                                     PlacementOf(caller.rank)));
    }
    if (need_staging && !staging_got) {
      FS_ASSIGN_OR_RETURN(staging_got,
                          kept->Get(KeptKey::Rank(caller.rank, unit, KeptUse::kGradInput),
                                    BufferKind::kStaging, staging_bytes,
                                    absl::StrCat(label, " full grad"), owner_uid,
                                    PlacementOf(caller.rank)));
    }
  }
  return absl::AbortedError(absl::StrCat("group ", caller.group, " rank ", caller.rank,
                                         ": the gradient buffers of unit ", unit, " of module ",
                                         Display(module), " changed ", kSummonRounds,
                                         " times while being allocated; begin again"));
}

void GroupManager::FinishReduceScatter(const Caller& caller, const std::string& module,
                                       int32_t unit, ReduceOp op, bool accumulate,
                                       absl::Time deadline, StatusCallback done,
                                       const gpu::IpcEventRef& written) {
  // The trainer's gradient is written before it is reduced.
  devices_.AfterTrainerWrites(caller.rank, written,
                              [this, caller, module, unit, op, accumulate, deadline,
                               done = std::move(done)](absl::Status s) mutable {
                                if (!s.ok()) {
                                  done(std::move(s));
                                  return;
                                }
                                FinishReduceScatterWritten(caller, module, unit, op, accumulate,
                                                           deadline, std::move(done));
                              });
}

void GroupManager::FinishReduceScatterWritten(const Caller& caller, const std::string& module,
                                              int32_t unit, GradReduce op, bool accumulate,
                                              absl::Time deadline, StatusCallback done) {
  absl::Status error;
  std::shared_ptr<Buffer> staging, grad;
  bool fresh = false;  // the unit had no gradient shard: `grad` is installed on success
  DType dtype = DType::kFloat32;
  std::shared_ptr<collective::CollectiveGroup> coll;
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    error = CheckCallerLocked(g, caller);
    if (error.ok()) {
      auto it = g.registered.find(module);
      auto s = it == g.registered.end() ? decltype(it->second.grad_staging)::iterator{}
                                        : it->second.grad_staging.find({caller.rank, unit});
      auto failed = it == g.registered.end()
                        ? decltype(it->second.failed_finishes)::iterator{}
                        : it->second.failed_finishes.find({caller.rank, unit});
      if (it != g.registered.end() && s == it->second.grad_staging.end() &&
          failed != it->second.failed_finishes.end()) {
        error = failed->second;  // a repeated finish: the first one's cause
      } else if (it == g.registered.end() || s == it->second.grad_staging.end()) {
        error = absl::FailedPreconditionError(absl::StrCat(
            "group ", g.id, " rank ", caller.rank, ": no gradient buffer for unit ", unit,
            " of module ", Display(module), " (begin the reduce-scatter first)"));
      } else {
        Registered& reg = it->second;
        staging = s->second;
        reg.grad_staging.erase(s);
        grad = reg.shards_by_rank[caller.rank][unit].grad;
        if (!grad) {
          fresh = true;
          grad = reg.new_grads.at({caller.rank, unit});
        }
        dtype = reg.plan.units[unit].dtype;
        coll = g.coll;
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  // The collective reduces into a scratch shard; the gradient shard changes only once it
  // succeeded (replaced, or accumulated into), so a failed reduce-scatter changes nothing.
  // Host ranks reduce into private memory; GPU ranks into device memory of the pool.
  std::shared_ptr<Buffer> scratch_buffer;
  std::shared_ptr<std::vector<char>> scratch_host;
  collective::MutableBuffer scratch{nullptr, static_cast<size_t>(grad->bytes()), dtype};
  if (grad->on_device()) {
    absl::StatusOr<std::shared_ptr<Buffer>> b =
        store_->Allocate(BufferKind::kStaging, grad->bytes(),
                         absl::StrCat("group=", caller.group, " unit=", unit, " rank=",
                                      caller.rank, " reduce-scatter scratch"),
                         -1, grad->placement());
    if (!b.ok()) {
      done(b.status());
      return;
    }
    scratch_buffer = *std::move(b);
    scratch = MutableOf(scratch_buffer.get(), dtype);
  } else {
    scratch_host = std::make_shared<std::vector<char>>(grad->bytes());
    scratch.data = scratch_host->data();
  }
  std::vector<collective::CollectiveOp> ops;
  ops.push_back(collective::CollectiveOp::ReduceScatter(
      unit, ConstOf(*staging, dtype), scratch,
      op == ReduceOp::kAvg ? collective::ReduceOp::kAvg : collective::ReduceOp::kSum));
  ops.back().name = "grads";
  // Once the collective completed: the reduced shard into the gradient shard (a device copy
  // for GPU ranks: on the device's worker, not on the engine's thread), then the outcome is
  // recorded under mu_.
  auto settle = [this, caller, module, unit, staging, grad, fresh, scratch_buffer, scratch_host,
                 done = std::move(done)](absl::Status s) mutable {
    scratch_buffer.reset();
    scratch_host.reset();
    staging.reset();  // the staging buffer's pages go back until the next step
    AfterUnlock persist;  // the record, after mu_
    {
      std::shared_ptr<Group> held = GroupOrGone(caller.group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (!g.removed) {
        auto reg = g.registered.find(module);
        if (reg != g.registered.end()) {
          if (fresh) {
            reg->second.new_grads.erase({caller.rank, unit});
            if (s.ok()) reg->second.shards_by_rank[caller.rank][unit].grad = grad;
            if (s.ok()) PersistLater(g, &persist);  // a new durable buffer
          }
          reg->second.NoteOp({unit}, "reduce_scatter", caller.rank, s.ok(), clock_->Now());
          if (s.ok()) {
            reg->second.failed_finishes.erase({caller.rank, unit});
          } else {
            reg->second.failed_finishes[{caller.rank, unit}] = s;
          }
          ReleaseKept(reg->second);
        }
      }
    }
    persist.Run();
    done(s);
  };
  coll->SubmitAll(caller.rank, std::move(ops), deadline - clock_->Now(),
            [this, rank = caller.rank, grad, fresh, scratch, scratch_buffer, scratch_host, dtype,
             accumulate, settle = std::move(settle)](absl::Status s) mutable {
              if (!s.ok()) {
                settle(std::move(s));
                return;
              }
              // The scratch buffers stay alive in this job until the copy is done.
              devices_.RunBlocking(
                  rank,
                  [this, rank, grad, fresh, scratch, scratch_buffer, scratch_host, dtype,
                   accumulate] {
                    return devices_.ApplyReducedGrad(rank, scratch.AsConst(), *grad, dtype,
                                                     accumulate && !fresh);
                  },
                  std::move(settle));
            });
}

}  // namespace flatshard::server
