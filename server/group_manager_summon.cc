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
using internal::CopyOwnRange;
using internal::Display;
using internal::kAlreadyUnsharding;
using internal::kKeptIdleRelease;
using internal::MutableOf;
using internal::SelectUnits;
using internal::SubmitAll;

absl::StatusOr<std::shared_ptr<Buffer>> GroupManager::KeptBuffer(
    Group& g, Registered& reg, int32_t owner, int32_t unit, int what, BufferKind kind,
    int64_t bytes, const std::string& label) {
  Registered::Kept& kept = reg.kept[{owner, unit, what}];
  if (kept.buffer && kept.buffer.use_count() == 1) {  // only this map holds it: free to reuse
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
  absl::StatusOr<std::shared_ptr<Buffer>> fresh = store_->Allocate(kind, bytes, label, g.owner_uid);
  if (absl::IsResourceExhausted(fresh.status())) {
    DecommitIdle(absl::InfiniteFuture());
    fresh = store_->Allocate(kind, bytes, label, g.owner_uid);
  }
  if (!fresh.ok()) return fresh.status();
  if (!kept.buffer) kept.buffer = *fresh;
  return *fresh;
}

void GroupManager::ReleaseKept(Registered& reg) {
  const absl::Time now = absl::Now();
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
                          absl::Time deadline, SummonCallback done) {
  absl::Status error;
  SummonResult result;
  std::vector<collective::CollectiveOp> ops;
  std::shared_ptr<collective::CollectiveGroup> coll;
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
        if (!FindModulePath(reg->manifest, path)) {
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
      const bool shared = !options.writeback && !options.rank0_only && sharded;
      OpenSummon open;
      open.id = g->next_summon++;
      open.rank = rank;
      open.k = k;
      open.module = module;
      open.options = options;
      open.units = result.units;
      open.slot = slot;
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
          FS_ASSIGN_OR_RETURN(rank0_map[u], KeptBuffer(*g, *reg, 0, u, kind, BufferKind::kUnsharded,
                                                       bytes, absl::StrCat(label, " rank=0")));
          return rank0_map[u];
        }
        if (shared) {
          if (!shared_map[u]) {
            FS_ASSIGN_OR_RETURN(shared_map[u], KeptBuffer(*g, *reg, -1, u, kind,
                                                          BufferKind::kUnsharded, bytes, label));
          }
          return shared_map[u];
        }
        return KeptBuffer(*g, *reg, rank, u, kind, BufferKind::kUnsharded, bytes,
                          absl::StrCat(label, " rank=", rank));
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
          std::memcpy(view.params->data(), shard.shard->data(), shard.shard->bytes());
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
            std::memcpy(view.grads->data(), shard.grad->data(), shard.grad->bytes());
          }
        }
        open.views.push_back(std::move(view));
      }
      if (error.ok()) {
        for (int32_t u : result.units) reg->summoned[rank][u] = true;
        reg->NoteOp(result.units, "summon", rank, true);
        result.summon = open.id;
        if (result.units.empty()) result.note = absl::StrCat(Display(path), " is not a unit root: nothing unsharded");
        if (!options.rank0_only || rank == 0) result.views = open.views;
        g->open_summons.emplace(open.id, std::move(open));
        coll = g->coll;
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
  SubmitAll(coll, caller.rank, std::move(ops), deadline,
            [this, caller, id, result = std::move(result),
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
              done(std::move(result));
            });
}

void GroupManager::EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline,
                             StatusCallback done) {
  absl::Status error;
  OpenSummon copy;
  const Plan* plan = nullptr;
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::vector<UnitShard> shards;
  std::vector<collective::CollectiveOp> broadcasts;
  {
    absl::MutexLock lock(&mu_);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(caller);
    if (error.ok()) {
      Group& g = *groups_.at(caller.group);
      auto it = g.open_summons.find(summon);
      if (it == g.open_summons.end() || it->second.rank != caller.rank) {
        error = absl::NotFoundError(absl::StrCat("group ", g.id, " rank ", caller.rank,
                                                 ": no open summon ", summon));
      } else if (it->second.ending || !it->second.ready) {
        error = absl::FailedPreconditionError(
            absl::StrCat("summon ", summon, " is ", it->second.ending ? "already ending" : "not ready"));
      } else {
        it->second.ending = true;
        copy = it->second;
        Registered& reg = g.registered.at(copy.module);
        plan = &reg.plan;  // registrations are never removed while the group lives
        shards = reg.shards_by_rank[caller.rank];
        coll = g.coll;
        if (copy.options.rank0_only && copy.options.writeback) {
          // beyond FSDP: rank 0's edits reach every shard. Rank 0 broadcasts its buffers when
          // it ends (which is also the barrier: no rank writes back before rank 0 ended);
          // each node receives one copy, which all its ranks share.
          for (int32_t u : copy.units) {
            const PlanUnit& unit = plan->units[u];
            const int64_t bytes = unit.padded_numel * ItemSize(unit.dtype);
            for (int what : {0, 1}) {
              if (what == 1 && !(copy.options.with_grads && shards[u].grad)) continue;
              auto& map = what == 0 ? copy.slot->rank0_params : copy.slot->rank0_grads;
              if (!map[u]) {
                absl::StatusOr<std::shared_ptr<Buffer>> b =
                    KeptBuffer(g, reg, -2, u, what, BufferKind::kUnsharded, bytes,
                               absl::StrCat("group=", g.id, " unit=", u, " rank 0's copy"));
                if (!b.ok()) {
                  error = b.status();
                  break;
                }
                map[u] = *b;
              }
              broadcasts.push_back(collective::CollectiveOp::Broadcast(
                  u, MutableOf(map[u].get(), unit.dtype), 0));
              broadcasts.back().name = "writeback";
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
  // Writes back this rank's ranges. Takes the copy and lets its buffer references go, so
  // FinishEnd sees which kept buffers nobody uses any more.
  auto write_back = [plan, shards, caller](std::unique_ptr<OpenSummon> copy) {
    const int32_t r = plan->ShardRank(caller.rank);
    for (size_t i = 0; i < copy->units.size(); ++i) {
      const PlanUnit& unit = plan->units[copy->units[i]];
      const UnitShard& shard = shards[copy->units[i]];
      const bool from_rank0 = copy->options.rank0_only;
      const Buffer* params = from_rank0 ? copy->slot->rank0_params.at(copy->units[i]).get()
                                        : copy->views[i].params.get();
      CopyOwnRange(*plan, unit, r, *params, *shard.shard);
      const auto& grads_map = copy->slot->rank0_grads;
      const Buffer* grads =
          from_rank0 ? (grads_map.contains(copy->units[i]) ? grads_map.at(copy->units[i]).get()
                                                           : nullptr)
                     : copy->views[i].grads.get();
      if (grads != nullptr && shard.grad) CopyOwnRange(*plan, unit, r, *grads, *shard.grad);
    }
  };
  const SummonOptions options = copy.options;
  auto owned = std::make_unique<OpenSummon>(std::move(copy));
  if (!options.writeback) {
    owned.reset();
    FinishEnd(caller, summon, absl::OkStatus(), std::move(done));
    return;
  }
  if (!options.rank0_only) {
    write_back(std::move(owned));
    FinishEnd(caller, summon, absl::OkStatus(), std::move(done));
    return;
  }
  SubmitAll(coll, caller.rank, std::move(broadcasts), deadline,
            [this, caller, summon, write_back, owned = std::move(owned),
             done = std::move(done)](absl::Status s) mutable {
              if (s.ok()) {
                write_back(std::move(owned));
              } else {
                owned.reset();
              }
              FinishEnd(caller, summon, s, std::move(done));
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
        reg.NoteOp(open.units, open.ready ? "end" : "summon", open.rank, status.ok());
        if (++open.slot->ended == static_cast<int32_t>(group.local_ranks.size())) {
          reg.slots.erase(open.k);
        }
        group.open_summons.erase(it);  // drops this rank's references to the buffers
        ReleaseKept(reg);
      }
    }
  }
  done(status);
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
                         g.owner_uid);
    if (!grad.ok()) return grad.status();
    reg.new_grads[{caller.rank, unit}] = *std::move(grad);
  }
  auto& staging = reg.grad_staging[{caller.rank, unit}];
  if (!staging) {
    FS_ASSIGN_OR_RETURN(staging, KeptBuffer(g, reg, caller.rank, unit, 2, BufferKind::kStaging,
                                            u.padded_numel * item,
                                            absl::StrCat("group=", g.id, " unit=", unit,
                                                         " rank=", caller.rank, " full grad")));
  }
  return staging;
}

void GroupManager::FinishReduceScatter(const Caller& caller, const std::string& module,
                                       int32_t unit, GradReduce op, bool accumulate,
                                       absl::Time deadline, StatusCallback done) {
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
      if (it == g.registered.end() || s == it->second.grad_staging.end()) {
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
  auto scratch = std::make_shared<std::vector<char>>(grad->bytes());
  std::vector<collective::CollectiveOp> ops;
  ops.push_back(collective::CollectiveOp::ReduceScatter(
      unit, ConstOf(*staging, dtype),
      collective::MutableBuffer{scratch->data(), scratch->size(), dtype},
      op == GradReduce::kAvg ? collective::ReduceOp::kAvg : collective::ReduceOp::kSum));
  ops.back().name = "grads";
  SubmitAll(coll, caller.rank, std::move(ops), deadline,
            [this, caller, module, unit, staging, grad, fresh, scratch, dtype, accumulate,
             done = std::move(done)](absl::Status s) mutable {
              if (s.ok()) {
                if (accumulate && !fresh) {
                  const void* srcs[] = {grad->data(), scratch->data()};
                  collective::ReduceInto(dtype, srcs, grad->data(),
                                         grad->bytes() / ItemSize(dtype),
                                         collective::ReduceOp::kSum, 1);
                } else {
                  std::memcpy(grad->data(), scratch->data(), scratch->size());
                }
              }
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
                    reg->second.NoteOp({unit}, "reduce_scatter", caller.rank, s.ok());
                    ReleaseKept(reg->second);
                  }
                }
              }
              done(s);
            });
}

}  // namespace flatshard::server
