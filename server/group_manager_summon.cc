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
using internal::kKeptIdleRelease;
using internal::MutableOf;
using internal::SelectUnits;

absl::StatusOr<std::shared_ptr<Buffer>> GroupManager::KeptBuffer(
    Group& g, Registered& reg, int32_t owner, int32_t unit, int what, BufferKind kind,
    int64_t bytes, const std::string& label, Placement placement) {
  // Two buffers are kept per (owner, unit, what), the second under key what + 16. EndSummon
  // is not collective, so a fast rank's next summon often arrives while a slower rank still
  // holds the previous summon's buffer (a read-only summon's node-shared copy above all). With
  // one kept buffer that summon got a fresh, unkept one: a new segment for every client to
  // map, every other summon. The second copy takes that turn instead, and two suffice: a
  // rank's summon k+2 of a unit starts after its summon k+1 completed, which every rank joined
  // only after ending summon k, so summon k's buffer is free again by then.
  constexpr int kKeptCopies = 2;
  constexpr int kCopyStride = 16;  // `what` is 0..2
  Registered::Kept* vacant = nullptr;
  for (int copy = 0; copy < kKeptCopies; ++copy) {
    Registered::Kept& kept = reg.kept[{owner, unit, what + copy * kCopyStride}];
    if (kept.buffer && kept.buffer->placement() != placement) {
      // offload_to_cpu toggled between summons: the other placement's buffer goes.
      if (kept.buffer.use_count() == 1) kept.buffer.reset();
    }
    if (!kept.buffer) {
      if (vacant == nullptr) vacant = &kept;
      continue;
    }
    if (kept.buffer.use_count() != 1) continue;  // in use: try the other copy
    // Only this map holds it: free to reuse.
    if (!kept.buffer->committed()) {
      absl::Status s = kept.buffer->Commit();
      if (absl::IsResourceExhausted(s)) {
        DecommitIdle(absl::InfiniteFuture());  // make room from other idle buffers, then retry
        s = kept.buffer->Commit();
      }
      FS_RETURN_IF_ERROR(s);
    }
    kept.idle_since = absl::InfiniteFuture();
    return kept.buffer;
  }
  absl::StatusOr<std::shared_ptr<Buffer>> fresh =
      store_->Allocate(kind, bytes, label, g.owner_uid, placement);
  if (absl::IsResourceExhausted(fresh.status())) {
    DecommitIdle(absl::InfiniteFuture());
    fresh = store_->Allocate(kind, bytes, label, g.owner_uid, placement);
  }
  if (!fresh.ok()) return fresh.status();
  if (vacant != nullptr) vacant->buffer = *fresh;
  return *fresh;
}

void GroupManager::ReleaseKept(Registered& reg) {
  const absl::Time now = clock_->Now();
  for (auto& [key, kept] : reg.kept) {
    if (kept.buffer.use_count() == 1 && kept.idle_since == absl::InfiniteFuture()) {
      kept.idle_since = now;
    }
  }
}

void GroupManager::DecommitIdle(absl::Time now) {
  for (auto& [id, g] : groups_) {
    for (auto& [module, reg] : g->registered) {
      for (auto& [key, kept] : reg.kept) {
        if (kept.buffer.use_count() != 1 || !kept.buffer->committed()) continue;
        const bool all = now == absl::InfiniteFuture();
        if (!all && (kept.idle_since == absl::InfiniteFuture() ||
                     now - kept.idle_since < kKeptIdleRelease)) {
          continue;
        }
        absl::Status s = kept.buffer->Decommit();
        if (!s.ok()) FS_LOG(WARNING) << "decommit of " << kept.buffer->segment_name() << ": " << s;
      }
    }
  }
}

void GroupManager::Summon(const Caller& caller, const std::string& module,
                          const std::string& path, const SummonOptions& options,
                          absl::Time deadline, SummonCallback done,
                          const gpu::IpcEventRef& written) {
  // The trainer's last writes to its shards (an optimizer step) land before they are read.
  if (absl::Status s = WaitForTrainer(caller.rank, written); !s.ok()) {
    done(s);
    return;
  }
  absl::Status error;
  SummonResult result;
  std::vector<collective::CollectiveOp> ops;
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::shared_ptr<SummonSlot> shared_slot;  // a read-only copy several local ranks assemble
  int32_t shared_locals = 0;
  {
    absl::MutexLock lock(&mu_);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(caller);
    Group* g = error.ok() ? groups_.at(caller.group).get() : nullptr;
    Registered* reg = nullptr;
    if (error.ok()) {
      auto it = g->registered.find(module);
      if (it == g->registered.end()) {
        error = absl::NotFoundError(
            absl::StrCat("group ", g->id, ": module ", Display(module), " is not registered"));
      } else {
        reg = &it->second;
        if (!reg->initialized) {
          error = CheckUsable(*g, module, *reg);  // never hands out zeros as the model
        } else if (!FindModulePath(reg->manifest, path)) {
          error = absl::NotFoundError(absl::StrCat("module ", Display(module), " has no submodule ",
                                                   Display(path)));
        }
      }
    }
    const int32_t rank = caller.rank;
    if (error.ok()) {
      result.units = SelectUnits(reg->plan, path, options.recurse);
      for (int32_t u : result.units) {
        if (reg->summoned[rank][u]) {
          error = absl::FailedPreconditionError(absl::StrCat(
              kAlreadyUnsharding, " (unit ", u, " ", Display(reg->plan.units[u].module), ")"));
          break;
        }
      }
    }
    if (error.ok()) {
      const uint64_t k = ++reg->summon_count[rank];
      std::shared_ptr<SummonSlot>& slot = reg->slots[k];
      if (!slot) slot = std::make_shared<SummonSlot>();
      const bool sharded = reg->plan.shard_world_size > 1;
      // One read-only copy per node; GPU ranks each need theirs on their own device.
      const bool shared = !options.writeback && !options.rank0_only && sharded && gpus_.empty();
      // GPU ranks: device views, or pinned host views under offload_to_cpu (the collective
      // stages them through the device).
      const Placement view_placement = gpus_.empty() || !options.offload_to_cpu
                                           ? PlacementOf(rank)
                                           : Placement::Pinned();
      OpenSummon open;
      open.id = g->next_summon++;
      open.rank = rank;
      open.k = k;
      open.module = module;
      open.options = options;
      open.units = result.units;
      open.slot = slot;
      open.coll = g->coll;
      // Buffers this rank sees: shared per node (read-only use), rank 0's only, or private.
      auto buffer_for = [&](std::map<int32_t, std::shared_ptr<Buffer>>& shared_map,
                            std::map<int32_t, std::shared_ptr<Buffer>>& rank0_map, int32_t u,
                            absl::string_view what) -> absl::StatusOr<std::shared_ptr<Buffer>> {
        const PlanUnit& unit = reg->plan.units[u];
        const int64_t bytes = unit.padded_numel * ItemSize(unit.dtype);
        const std::string label = absl::StrCat("group=", g->id, " unit=", u, " ", what);
        const int kind = what == "params" ? 0 : 1;
        if (options.rank0_only) {
          if (rank != 0) return std::shared_ptr<Buffer>();
          FS_ASSIGN_OR_RETURN(rank0_map[u],
                              KeptBuffer(*g, *reg, 0, u, kind, BufferKind::kUnsharded, bytes,
                                         absl::StrCat(label, " rank=0"), view_placement));
          return rank0_map[u];
        }
        if (shared) {
          if (!shared_map[u]) {
            FS_ASSIGN_OR_RETURN(shared_map[u], KeptBuffer(*g, *reg, -1, u, kind,
                                                          BufferKind::kUnsharded, bytes, label,
                                                          view_placement));
          }
          return shared_map[u];
        }
        return KeptBuffer(*g, *reg, rank, u, kind, BufferKind::kUnsharded, bytes,
                          absl::StrCat(label, " rank=", rank), view_placement);
      };
      for (int32_t u : result.units) {
        const PlanUnit& unit = reg->plan.units[u];
        const UnitShard& shard = reg->shards_by_rank[rank][u];
        SummonedUnit view{u, nullptr, nullptr};
        absl::StatusOr<std::shared_ptr<Buffer>> params =
            buffer_for(slot->shared_params, slot->rank0_params, u, "params");
        if (!params.ok()) {
          error = params.status();
          break;
        }
        view.params = *params;
        if (sharded) {
          ops.push_back(options.rank0_only
                            ? collective::CollectiveOp::Gather(
                                  u, ConstOf(*shard.shard, unit.dtype),
                                  MutableOf(view.params.get(), unit.dtype), 0)
                            : collective::CollectiveOp::AllGather(
                                  u, ConstOf(*shard.shard, unit.dtype),
                                  MutableOf(view.params.get(), unit.dtype)));
        } else if (view.params) {  // NO_SHARD: the shard is the whole buffer
          error = CopyBytes(rank, view.params->data(), shard.shard->data(), shard.shard->bytes());
          if (!error.ok()) break;
        }
        // Gradients exist for every rank of a unit or for none (made by one collective).
        if (options.with_grads && shard.grad) {
          absl::StatusOr<std::shared_ptr<Buffer>> grads =
              buffer_for(slot->shared_grads, slot->rank0_grads, u, "grads");
          if (!grads.ok()) {
            error = grads.status();
            break;
          }
          view.grads = *grads;
          if (sharded) {
            ops.push_back(options.rank0_only
                              ? collective::CollectiveOp::Gather(
                                    u, ConstOf(*shard.grad, unit.dtype),
                                    MutableOf(view.grads.get(), unit.dtype), 0)
                              : collective::CollectiveOp::AllGather(
                                    u, ConstOf(*shard.grad, unit.dtype),
                                    MutableOf(view.grads.get(), unit.dtype)));
          } else if (view.grads) {
            error = CopyBytes(rank, view.grads->data(), shard.grad->data(), shard.grad->bytes());
            if (!error.ok()) break;
          }
        }
        open.views.push_back(std::move(view));
      }
      if (error.ok()) {
        for (int32_t u : result.units) reg->summoned[rank][u] = true;
        reg->NoteOp(result.units, "summon", rank, true, clock_->Now());
        result.summon = open.id;
        if (result.units.empty()) result.note = absl::StrCat(Display(path), " is not a unit root: nothing unsharded");
        if (!options.rank0_only || rank == 0) result.views = open.views;
        g->open_summons.emplace(open.id, std::move(open));
        coll = g->coll;
        if (shared && !ops.empty() && g->local_ranks.size() > 1) {
          shared_slot = slot;
          shared_locals = static_cast<int32_t>(g->local_ranks.size());
        }
      } else {
        --reg->summon_count[rank];
        if (slot->shared_params.empty() && slot->rank0_params.empty()) reg->slots.erase(k);
        ops.clear();
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  const uint64_t id = result.summon;
  auto finish = [this, caller, id, result = std::move(result),
                 done = std::move(done)](absl::Status s) mutable {
              if (!s.ok()) {
                // Nothing was handed out: end the summon without writeback.
                FinishEnd(caller, id, s, [done = std::move(done), s](absl::Status) mutable {
                  done(s);
                });
                return;
              }
              {
                absl::MutexLock lock(&mu_);
                auto g = groups_.find(caller.group);
                if (g != groups_.end()) {
                  auto it = g->second->open_summons.find(id);
                  if (it != g->second->open_summons.end()) it->second.ready = true;
                }
              }
              result.ready = RecordReady(caller.rank);
              done(std::move(result));
  };
  if (shared_slot == nullptr) {
    coll->SubmitAll(caller.rank, std::move(ops), deadline - clock_->Now(), std::move(finish));
    return;
  }
  // The node's one read-only copy is assembled by every local rank's op together (each
  // block lands once, through whichever local rank receives it), so one rank's op may
  // complete before the copy is whole: every local rank answers once all of theirs have
  // completed, with the first error if any did not (bounded by the ops' deadlines).
  coll->SubmitAll(caller.rank, std::move(ops), deadline - clock_->Now(),
                  [this, shared_slot, local = shared_locals,
                   finish = std::move(finish)](absl::Status s) mutable {
                    std::vector<absl::AnyInvocable<void(absl::Status)>> ready;
                    absl::Status verdict;
                    {
                      absl::MutexLock lock(&mu_);
                      if (!s.ok() && shared_slot->assembly_error.ok())
                        shared_slot->assembly_error = s;
                      ++shared_slot->assembled;
                      shared_slot->waiting.push_back(std::move(finish));
                      // A failure answers at once (a rank that died never submits: nobody waits
                      // for it); success waits for the last local rank.
                      if (shared_slot->assembly_error.ok() && shared_slot->assembled < local)
                        return;
                      ready.swap(shared_slot->waiting);
                      verdict = shared_slot->assembly_error;
                    }
                    for (auto& f : ready) f(verdict);
                  });
}

void GroupManager::EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline,
                             StatusCallback done, const gpu::IpcEventRef& written) {
  // The trainer's writes to the views land before they are written back. A failure here is
  // this rank's "no" in the agreement, so the other ranks fail at once too.
  const absl::Status local = WaitForTrainer(caller.rank, written);
  absl::Status error;
  OpenSummon copy;
  const Plan* plan = nullptr;
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::vector<UnitShard> shards;
  std::vector<std::shared_ptr<Buffer>> committed;
  std::vector<collective::CollectiveOp> broadcasts;
  internal::AgreeRecord record{};
  int32_t world_size = 0;
  bool is_init = false;
  absl::Status reformed;  // the summon predates the group's re-form
  {
    absl::MutexLock lock(&mu_);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(caller);
    if (error.ok()) {
      Group& g = *groups_.at(caller.group);
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
        committed = reg.committed[caller.rank];
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
          // beyond FSDP: rank 0's edits reach every shard. Rank 0 broadcasts its buffers when
          // it ends; each node receives one copy, which all its ranks share. The agreement
          // after it is the barrier: no rank writes back before every rank has the bytes.
          for (int32_t u : copy.units) {
            const PlanUnit& unit = plan->units[u];
            const int64_t bytes = unit.padded_numel * ItemSize(unit.dtype);
            for (int what : {0, 1}) {
              if (what == 1 && !(copy.options.with_grads && shards[u].grad)) continue;
              auto& map = what == 0 ? copy.slot->rank0_params : copy.slot->rank0_grads;
              // GPU ranks each receive rank 0's copy on their own device (rank 0 broadcasts
              // from its own buffer), host ranks share one per node.
              std::shared_ptr<Buffer> own;
              std::shared_ptr<Buffer>& target = gpus_.empty() || caller.rank == 0 ? map[u] : own;
              if (!target) {
                absl::StatusOr<std::shared_ptr<Buffer>> b = KeptBuffer(
                    g, reg, gpus_.empty() ? -2 : -3 - caller.rank, u, what,
                    BufferKind::kUnsharded, bytes,
                    absl::StrCat("group=", g.id, " unit=", u, " rank 0's copy"),
                    PlacementOf(caller.rank));
                if (!b.ok()) {
                  error = b.status();
                  break;
                }
                target = *b;
              }
              broadcasts.push_back(collective::CollectiveOp::Broadcast(
                  u, MutableOf(target.get(), unit.dtype), 0));
              broadcasts.back().name = "writeback";
              if (own) copy.own_rank0[{u, what}] = std::move(own);
            }
          }
          if (!error.ok()) it->second.ending = false;
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
  auto write_back = [this, plan, shards, committed, caller](std::unique_ptr<OpenSummon> copy) {
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
      status = CopyOwnRange(caller.rank, *plan, unit, r, *params, *shard.shard);
      const Buffer* grads = from_rank0 ? rank0_copy(1) : copy->views[i].grads.get();
      if (status.ok() && grads != nullptr && shard.grad) {
        status = CopyOwnRange(caller.rank, *plan, unit, r, *grads, *shard.grad);
      }
    }
    copy.reset();
    if (status.ok()) status = CopyCommitted(caller.rank, shards, committed, /*to_committed=*/true);
    if (!status.ok()) {
      FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                    << ": writeback failed after every rank agreed: " << status;
    }
    return status;
  };
  // Every rank agreed: this rank applies (the daemon does, whatever its trainer does now).
  auto apply = [this, caller, summon, module = owned->module, is_init, generation = record.generation,
                write_back](std::unique_ptr<OpenSummon> owned, StatusCallback done) mutable {
    {
      absl::MutexLock lock(&mu_);
      auto g = groups_.find(caller.group);
      if (g != groups_.end()) ++g->second->registered.at(module).busy;
    }
    absl::Status s = write_back(std::move(owned));
    std::vector<absl::AnyInvocable<void()>> run;
    {
      absl::MutexLock lock(&mu_);
      auto g = groups_.find(caller.group);
      if (g != groups_.end()) {
        Registered& reg = g->second->registered.at(module);
        if (s.ok()) {
          if (is_init) {
            reg.initialized = true;
            reg.uninitialized_why.clear();
            FS_LOG(INFO) << "group=" << caller.group << " rank=" << caller.rank << " module="
                         << Display(module) << " initialised on every rank (generation 0)";
          } else {
            reg.generation[caller.rank] = generation + 1;
          }
        }
        DoneCopying(*g->second, reg, &run);
      }
    }
    for (auto& f : run) f();
    FinishEnd(caller, summon, std::move(s), std::move(done));
  };
  auto agree = [this, caller, summon, coll, record, world_size, deadline, apply,
                module = owned->module](std::unique_ptr<OpenSummon> owned,
                                        StatusCallback done) mutable {
    Agree(coll, caller, record, world_size, internal::kEndAgreeUnit,
          absl::StrCat("the writeback of summon ", summon),
          deadline,
          [this, caller, summon, apply, module, owned = std::move(owned),
           done = std::move(done)](absl::Status s, bool stale) mutable {
            if (s.ok()) {
              apply(std::move(owned), std::move(done));
              return;
            }
            owned.reset();
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

void GroupManager::FinishEnd(const Caller& caller, uint64_t summon, absl::Status status,
                             StatusCallback done) {
  {
    absl::MutexLock lock(&mu_);
    auto g = groups_.find(caller.group);
    if (g != groups_.end()) {
      Group& group = *g->second;
      auto it = group.open_summons.find(summon);
      if (it != group.open_summons.end()) {
        OpenSummon& open = it->second;
        Registered& reg = group.registered.at(open.module);
        for (int32_t u : open.units) reg.summoned[open.rank][u] = false;
        // A summon that never became ready failed before anything was handed out.
        reg.NoteOp(open.units, open.ready ? "end" : "summon", open.rank, status.ok(),
                   clock_->Now());
        if (++open.slot->ended == static_cast<int32_t>(group.local_ranks.size())) {
          reg.slots.erase(open.k);
        }
        if (!status.ok() && open.ready && open.options.writeback) {
          if (!reg.initialized) reg.uninitialized_why = std::string(status.message());
          group.failed_ends[summon] = {open.rank, status};
          while (group.failed_ends.size() > internal::kFailedEndsKept) {
            group.failed_ends.erase(group.failed_ends.begin());
          }
        }
        group.open_summons.erase(it);  // drops this rank's references to the buffers
        ReleaseKept(reg);
      }
    }
  }
  done(status);
}

absl::Status GroupManager::CopyCommitted(int32_t rank, const std::vector<UnitShard>& shards,
                                         const std::vector<std::shared_ptr<Buffer>>& committed,
                                         bool to_committed) const {
  for (size_t u = 0; u < shards.size() && u < committed.size(); ++u) {
    if (!shards[u].shard || !committed[u]) continue;
    const Buffer& live = *shards[u].shard;
    const Buffer& kept = *committed[u];
    FS_RETURN_IF_ERROR(to_committed ? CopyBytes(rank, kept.data(), live.data(), live.bytes())
                                    : CopyBytes(rank, live.data(), kept.data(), live.bytes()));
  }
  return absl::OkStatus();
}

void GroupManager::DoneCopying(Group& g, Registered& reg,
                               std::vector<absl::AnyInvocable<void()>>* run) {
  --reg.busy;
  if (reg.busy > 0 || !reg.rollback_pending) return;
  for (auto& [module, r] : g.registered) {
    if (&r == &reg) {
      RollbackNow(g, module, reg, run);
      return;
    }
  }
}

void GroupManager::StartRollback(Group& g, std::vector<absl::AnyInvocable<void()>>* run) {
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
                               std::vector<absl::AnyInvocable<void()>>* run) {
  // Taking `busy` here keeps every other copy out until the rollback is done; the copies run
  // from `run`, after mu_ is released (before the join callbacks queued after them).
  ++reg.busy;
  std::vector<std::pair<int32_t, std::vector<UnitShard>>> work;
  std::vector<std::vector<std::shared_ptr<Buffer>>> kept;
  for (int32_t r : g.local_ranks) {
    if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) || reg.shards_by_rank[r].empty()) {
      continue;
    }
    work.emplace_back(r, reg.shards_by_rank[r]);
    kept.push_back(reg.committed[r]);
    reg.stale[r] = true;
  }
  run->push_back([this, group = g.id, module, work = std::move(work), kept = std::move(kept)] {
    absl::Status status;
    for (size_t i = 0; i < work.size(); ++i) {
      absl::Status s = CopyCommitted(work[i].first, work[i].second, kept[i], /*to_committed=*/false);
      if (!s.ok() && status.ok()) status = s;
    }
    std::vector<absl::AnyInvocable<void()>> more;
    {
      absl::MutexLock lock(&mu_);
      auto g = groups_.find(group);
      if (g == groups_.end()) return;
      auto reg = g->second->registered.find(module);
      if (reg == g->second->registered.end()) return;
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
      DoneCopying(*g->second, reg->second, &more);
    }
    for (auto& f : more) f();
  });
}

void GroupManager::RollbackRank(const Caller& caller, const std::string& module) {
  std::vector<absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    auto g = groups_.find(caller.group);
    if (g == groups_.end()) return;
    auto reg = g->second->registered.find(module);
    if (reg == g->second->registered.end() || !reg->second.initialized) return;
    // A refused commit: this rank's part of rolling the whole group back (every rank got the
    // same verdict). Its views are stale from now on.
    Registered& r = reg->second;
    ++r.busy;
    r.stale[caller.rank] = true;
    run.push_back([this, caller, module, shards = r.shards_by_rank[caller.rank],
                   kept = r.committed[caller.rank]] {
      absl::Status s = CopyCommitted(caller.rank, shards, kept, /*to_committed=*/false);
      if (!s.ok()) {
        FS_LOG(ERROR) << "group=" << caller.group << " rank=" << caller.rank
                      << ": rollback after a refused commit failed: " << s;
      }
      std::vector<absl::AnyInvocable<void()>> more;
      {
        absl::MutexLock lock(&mu_);
        auto g = groups_.find(caller.group);
        if (g == groups_.end()) return;
        auto reg = g->second->registered.find(module);
        if (reg != g->second->registered.end()) DoneCopying(*g->second, reg->second, &more);
      }
      for (auto& f : more) f();
    });
  }
  for (auto& f : run) f();
}

void GroupManager::Commit(const Caller& caller, const std::string& module, absl::Time deadline,
                          CommitCallback done, const gpu::IpcEventRef& written) {
  // The optimizer's writes land before the shards are copied; a failure is this rank's "no".
  const absl::Status local = WaitForTrainer(caller.rank, written);
  absl::Status error;
  internal::AgreeRecord record{};
  std::shared_ptr<collective::CollectiveGroup> coll;
  int32_t world_size = 0;
  {
    absl::MutexLock lock(&mu_);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(caller);
    if (error.ok()) {
      Group& g = *groups_.at(caller.group);
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
          std::vector<UnitShard> shards;
          std::vector<std::shared_ptr<Buffer>> committed;
          {
            absl::MutexLock lock(&mu_);
            auto g = groups_.find(caller.group);
            if (g == groups_.end()) {
              done(absl::UnavailableError(absl::StrCat("group ", caller.group, " is gone")));
              return;
            }
            Registered& reg = g->second->registered.at(module);
            ++reg.busy;  // every rank agreed: this rank commits, whatever its trainer does now
            shards = reg.shards_by_rank[caller.rank];
            committed = reg.committed[caller.rank];
          }
          s = CopyCommitted(caller.rank, shards, committed, /*to_committed=*/true);
          std::vector<absl::AnyInvocable<void()>> run;
          {
            absl::MutexLock lock(&mu_);
            auto g = groups_.find(caller.group);
            if (g != groups_.end()) {
              Registered& reg = g->second->registered.at(module);
              if (s.ok()) reg.generation[caller.rank] = generation + 1;
              DoneCopying(*g->second, reg, &run);
            }
          }
          for (auto& f : run) f();
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

void GroupManager::DropSummons(Group& g, int32_t rank) {
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
    if (++open.slot->ended == static_cast<int32_t>(g.local_ranks.size())) reg.slots.erase(open.k);
    FS_LOG(WARNING) << "group=" << g.id << " rank=" << rank << " summon " << open.id
                    << " ended without writeback (session ended)";
    it = g.open_summons.erase(it);
  }
  for (auto& [module, reg] : g.registered) {
    for (auto s = reg.grad_staging.begin(); s != reg.grad_staging.end();) {
      s = s->first.first == rank ? reg.grad_staging.erase(s) : std::next(s);
    }
    for (auto s = reg.new_grads.begin(); s != reg.new_grads.end();) {
      s = s->first.first == rank ? reg.new_grads.erase(s) : std::next(s);
    }
    ReleaseKept(reg);
  }
}

absl::StatusOr<std::shared_ptr<Buffer>> GroupManager::BeginReduceScatter(
    const Caller& caller, const std::string& module, int32_t unit) {
  absl::MutexLock lock(&mu_);
  FS_RETURN_IF_ERROR(CheckCallerLocked(caller));
  Group& g = *groups_.at(caller.group);
  auto it = g.registered.find(module);
  if (it == g.registered.end()) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(module), " is not registered"));
  }
  Registered& reg = it->second;
  if (!reg.initialized) return CheckUsable(g, module, reg);
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
  if (!reg.shards_by_rank[caller.rank][unit].grad && !reg.new_grads.contains({caller.rank, unit})) {
    absl::StatusOr<std::shared_ptr<Buffer>> grad =
        store_->Allocate(BufferKind::kGradShard, u.shard_numel * item,
                         absl::StrCat("group=", g.id, " unit=", unit, " rank=", caller.rank,
                                      " grad"),
                         g.owner_uid, PlacementOf(caller.rank));
    if (!grad.ok()) return grad.status();
    reg.new_grads[{caller.rank, unit}] = *std::move(grad);
  }
  reg.failed_finishes.erase({caller.rank, unit});
  auto& staging = reg.grad_staging[{caller.rank, unit}];
  if (!staging) {
    FS_ASSIGN_OR_RETURN(staging, KeptBuffer(g, reg, caller.rank, unit, 2, BufferKind::kStaging,
                                            u.padded_numel * item,
                                            absl::StrCat("group=", g.id, " unit=", unit,
                                                         " rank=", caller.rank, " full grad"),
                                            PlacementOf(caller.rank)));
  }
  return staging;
}

void GroupManager::FinishReduceScatter(const Caller& caller, const std::string& module,
                                       int32_t unit, ReduceOp op, bool accumulate,
                                       absl::Time deadline, StatusCallback done,
                                       const gpu::IpcEventRef& written) {
  // The trainer's gradient is written before it is reduced.
  if (absl::Status s = WaitForTrainer(caller.rank, written); !s.ok()) {
    done(s);
    return;
  }
  absl::Status error;
  std::shared_ptr<Buffer> staging, grad;
  bool fresh = false;  // the unit had no gradient shard: `grad` is installed on success
  DType dtype = DType::kFloat32;
  std::shared_ptr<collective::CollectiveGroup> coll;
  {
    absl::MutexLock lock(&mu_);
    error = CheckCallerLocked(caller);
    if (error.ok()) {
      Group& g = *groups_.at(caller.group);
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
  coll->SubmitAll(
      caller.rank, std::move(ops), deadline - clock_->Now(),
      [this, caller, module, unit, staging, grad, fresh, scratch, scratch_buffer, scratch_host,
       dtype, accumulate, done = std::move(done)](absl::Status s) mutable {
        if (s.ok()) {
          s = ApplyReducedGrad(caller.rank, scratch.AsConst(), *grad, dtype, accumulate && !fresh);
        }
        scratch_buffer.reset();
        scratch_host.reset();
        staging.reset();  // the staging buffer's pages go back until the next step
        {
          absl::MutexLock lock(&mu_);
          auto g = groups_.find(caller.group);
          if (g != groups_.end()) {
            auto reg = g->second->registered.find(module);
            if (reg != g->second->registered.end()) {
              if (fresh) {
                reg->second.new_grads.erase({caller.rank, unit});
                if (s.ok()) reg->second.shards_by_rank[caller.rank][unit].grad = grad;
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
        done(s);
      });
}

absl::Status GroupManager::ApplyReducedGrad(int32_t rank, collective::ConstBuffer reduced,
                                            Buffer& grad, DType dtype, bool accumulate) const {
  const size_t bytes = static_cast<size_t>(grad.bytes());
  if (!accumulate) return CopyBytes(rank, grad.data(), reduced.data, bytes);
  if (!grad.on_device()) {
    const void* srcs[] = {grad.data(), reduced.data};
    collective::ReduceInto(dtype, srcs, grad.data(), bytes / ItemSize(dtype),
                           collective::ReduceOp::kSum, 1);
    return absl::OkStatus();
  }
  // Device shards accumulate through host memory: correct, not fast (no device kernels yet).
  std::vector<char> sum(bytes), add(bytes);
  FS_RETURN_IF_ERROR(CopyBytes(rank, sum.data(), grad.data(), bytes));
  FS_RETURN_IF_ERROR(CopyBytes(rank, add.data(), reduced.data, bytes));
  const void* srcs[] = {sum.data(), add.data()};
  collective::ReduceInto(dtype, srcs, sum.data(), bytes / ItemSize(dtype),
                         collective::ReduceOp::kSum, 1);
  return CopyBytes(rank, grad.data(), sum.data(), bytes);
}

}  // namespace flatshard::server
