// Modules: summons (unshard into kept buffers, one read-only node copy, rank0_only).

#include "server/module/modules.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/reduce.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/strategy_collectives.h"
#include "server/module/summon_steps.h"
#include "server/module/unit_ops.h"

namespace flatshard::server {

using summon_steps::AllAtHand;
using summon_steps::GetViewBuffers;
using summon_steps::kSummonRounds;
using summon_steps::TryKept;

using internal::CastsForCompute;
using internal::ConstOf;
using internal::Display;
using internal::kAlreadyUnsharding;
using internal::MutableOf;
using internal::SelectUnits;

std::shared_ptr<KeptBuffers> Modules::KeptOf(Registered& reg) {
  if (!reg.kept) {
    reg.kept = kept_pool_->NewSet();
    for (const auto& [key, buffer] : reg.adopted_kept) reg.kept->Adopt(key, buffer);
    reg.adopted_kept.clear();
  }
  return reg.kept;
}

int32_t Modules::KeptUnit(Registered& reg, int32_t unit, int nth) {
  if (reg.kept_class.empty()) {
    // Units of one class share kept buffers, so every buffer of a class has one size: the
    // mixed-precision dtypes are part of the class.
    std::map<std::tuple<int64_t, DType, DType, DType>, int32_t> class_of;
    reg.kept_class.reserve(reg.plan.units.size());
    for (const PlanUnit& u : reg.plan.units) {
      const auto [it, fresh] =
          class_of.try_emplace({u.padded_numel, u.dtype, u.ComputeDType(), u.ReduceDType()},
                               static_cast<int32_t>(reg.kept_class_units.size()));
      if (fresh) reg.kept_class_units.emplace_back();
      reg.kept_class_units[it->second].push_back(static_cast<int32_t>(reg.kept_class.size()));
      reg.kept_class.push_back(it->second);
    }
  }
  return reg.kept_class_units[reg.kept_class[unit]][nth];
}

void Modules::ReleaseKept(Registered& reg) {
  if (reg.kept) reg.kept->Release();
}

void Modules::Summon(const Caller& caller, const std::string& module, const std::string& path,
                     const SummonOptions& options, absl::Time deadline, SummonCallback done,
                     const gpu::IpcEventRef& written) {
  // The trainer's last writes to its shards (an optimizer step) land before they are read.
  // Device-side ordering: whether the wait is a stream wait or a host wait depends on the
  // summon's work, known once it is decided (SummonWritten); nothing reads the shards before.
  if (devices_.device_ordering()) {
    SummonWritten(caller, module, path, options, deadline, std::move(done), written);
    return;
  }
  devices_.AfterTrainerWrites(caller.rank, written,
                              [this, caller, module, path, options, deadline,
                               done = std::move(done)](absl::Status s) mutable {
                                if (!s.ok()) {
                                  done(std::move(s));
                                  return;
                                }
                                SummonWritten(caller, module, path, options, deadline,
                                              std::move(done));
                              });
}

void Modules::UnmarkMaking(std::shared_ptr<SummonSlot> slot,
                           std::vector<std::pair<int32_t, KeptUse>>* marked, AfterUnlock* waiting) {
  for (const auto& m : *marked) slot->making.erase(m);
  marked->clear();
  for (auto& w : slot->on_made) waiting->Call(std::move(w));
  slot->on_made.clear();
}

void Modules::SummonWritten(const Caller& caller, const std::string& module,
                            const std::string& path, const SummonOptions& options,
                            absl::Time deadline, SummonCallback done,
                            const gpu::IpcEventRef& unwaited) {
  auto start = std::make_shared<SummonStart>();
  ViewBuffers got;  // held across rounds; dropped (back to the cache, unused) when done
  // The slot whose node copies this summon is making without mu_ (SummonSlot::making), and
  // the other local ranks' summons that wait for them, run again once mu_ is released.
  std::shared_ptr<SummonSlot> making;
  std::vector<std::pair<int32_t, KeptUse>> marked;  // in making->making, by this summon
  AfterUnlock waiting;
  absl::Status error;
  bool parked = false;  // `done` went to the slot's on_made
  std::shared_ptr<Group> held = table_.Find(caller.group);
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
        decision.slot->on_made.push_back([this, caller, module, path, options, deadline,
                                          done = std::move(done), unwaited]() mutable {
          SummonWritten(caller, module, path, options, deadline, std::move(done), unwaited);
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
      error = absl::AbortedError(absl::StrCat(
          "group ", caller.group, " rank ", caller.rank, ": the buffers of the summon of ",
          Display(path), " changed ", kSummonRounds, " times while being allocated; summon again"));
    }
    // Without mu_: the kept-buffer cache allocates what is missing. The cache outlives the
    // module if that is dropped meanwhile (the next round then fails with NOT_FOUND). A
    // writeback summon first finishes the rank's last writeback End's copy, which holds that
    // End's buffers (pending_committed.h): the cache hands them out again instead of making
    // new ones.
    if (error.ok() && options.writeback && round == 0) {
      FinishPendingCopies(caller.group, module, caller.rank);
    }
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
  // HYBRID_* over part of the world: each all-gather's scratch, without mu_ (like the view:
  // shared memory, pinned or device memory).
  for (SummonRegroup& r : start->regroups) {
    absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
        BufferKind::kStaging, r.scratch_bytes,
        absl::StrCat("group=", caller.group, " rank=", caller.rank, " summon scratch"), -1,
        r.view->placement());
    if (!b.ok()) {
      // Nothing was handed out: end the summon without writeback.
      FinishEnd(caller, start->result.summon, b.status(),
                [done = std::move(done), s = b.status()](absl::Status) mutable { done(s); });
      return;
    }
    r.scratch = *std::move(b);
    start->ops[r.op].output = MutableOf(r.scratch.get(), r.dtype);
  }
  if (unwaited.id == 0) {
    UnshardWritten(caller, deadline, std::move(start), std::move(done));
    return;
  }
  const bool on_stream = start->ops.empty() && start->casts.empty() && start->regroups.empty() &&
                         start->shared_slot == nullptr && !start->shard_group_gather;
  if (!on_stream || devices_.DeviceOf(caller.rank) == nullptr) {
    // Collectives and casts read the shards off the rank's stream (the backends' streams, the
    // host): the host waits for the trainer's event.
    devices_.AfterTrainerWrites(
        caller.rank, unwaited,
        [this, caller, deadline, start, done = std::move(done)](absl::Status s) mutable {
          if (!s.ok()) {
            // Nothing was handed out: end the summon without writeback.
            FinishEnd(caller, start->result.summon, s,
                      [done = std::move(done), s](absl::Status) mutable { done(s); });
            return;
          }
          UnshardWritten(caller, deadline, std::move(start), std::move(done));
        });
    return;
  }
  // Device-side ordering (a world-1 or NO_SHARD unshard: device copies only): the rank's stream
  // waits for the trainer's event, the copies follow, StartUnshard records the ready event
  // after them, and the summon is answered at enqueue: no host wait, no synchronize. An error
  // of these copies that shows later fails the rank's next operation (CheckStream).
  absl::Status s = devices_.OrderOnDevice(caller.rank, unwaited);
  for (const auto& [dst, src] : start->copies) {
    if (!s.ok()) break;
    s = devices_.CopyAsync(caller.rank, dst->data(), src->data(),
                           static_cast<size_t>(src->bytes()));
  }
  // The buffers stay alive until the stream is past the copies (a group dropped meanwhile).
  devices_.ReleaseAfterStream(caller.rank,
                              std::make_shared<decltype(start->copies)>(std::move(start->copies)));
  start->copies.clear();
  if (!s.ok()) {
    FinishEnd(caller, start->result.summon, s,
              [done = std::move(done), s](absl::Status) mutable { done(s); });
    return;
  }
  StartUnshard(caller, deadline, std::move(start), std::move(done));
}

void Modules::UnshardWritten(const Caller& caller, absl::Time deadline,
                             std::shared_ptr<SummonStart> start, SummonCallback done) {
  if (start->copies.empty() && start->casts.empty()) {
    StartUnshard(caller, deadline, std::move(start), std::move(done));
    return;
  }
  // NO_SHARD: the views are copies of the shards. Mixed precision: each shard cast into its
  // own block of the view, the all-gather's input (in place, as NCCL's). The unit is marked
  // summoned, so no End or reduce-scatter of this rank touches these buffers until the summon
  // is answered. On the rank's device worker for GPU ranks.
  devices_.RunBlocking(
      caller.rank,
      [this, rank = caller.rank, start] {
        for (const auto& [dst, src] : start->copies) {
          FS_RETURN_IF_ERROR(devices_.CopyBytes(rank, dst->data(), src->data(),
                                                static_cast<size_t>(src->bytes())));
        }
        for (const SummonCast& c : start->casts) {
          FS_RETURN_IF_ERROR(devices_.CastBytes(rank, c.from->data(), c.from_dtype,
                                                static_cast<char*>(c.to->data()) + c.to_offset,
                                                c.to_dtype, c.count));
        }
        return absl::OkStatus();
      },
      [this, caller, deadline, start, done = std::move(done)](absl::Status s) mutable {
        start->copies.clear();
        start->casts.clear();
        if (!s.ok()) {
          // Nothing was handed out: end the summon without writeback.
          FinishEnd(caller, start->result.summon, s,
                    [done = std::move(done), s](absl::Status) mutable { done(s); });
          return;
        }
        StartUnshard(caller, deadline, std::move(start), std::move(done));
      });
}

absl::StatusOr<Registered*> Modules::InitializedModule(Group& g, const std::string& module) {
  auto it = g.registered.find(module);
  if (it == g.registered.end()) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(module), " is not registered"));
  }
  // Never zeros as the model: CheckUsable says why it is not initialised.
  if (!it->second.initialized) return CheckUsable(g, module, it->second);
  return &it->second;
}

absl::Status Modules::DecideSummon(Group& g, const Caller& caller, const std::string& module,
                                   const std::string& path, const SummonOptions& options,
                                   SummonDecision* d) {
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
      return absl::FailedPreconditionError(absl::StrCat(kAlreadyUnsharding, " (unit ", u, " ",
                                                        Display(reg.plan.units[u].module), ")"));
    }
  }
  if (options.compute_precision && (options.writeback || options.rank0_only)) {
    return absl::InvalidArgumentError(
        absl::StrCat("summon of ", Display(path), " in module ", Display(module),
                     ": compute_precision is for forward/backward summons; a summon with ",
                     options.writeback ? "writeback" : "rank0_only", " is always full precision"));
  }
  d->sharded = reg.plan.shard_world_size > 1;
  // One read-only copy per node; GPU ranks each need theirs on their own device. HYBRID_*
  // across daemons assembles it from the local ranks' shards (kShardGroupGather).
  d->shared = !options.writeback && !options.rank0_only && d->sharded && gpus_.empty();
  if (d->shared && strategy::UnshardOf(reg.plan, true) == strategy::Unshard::kShardGroupGather) {
    // The node's copy needs every local rank's shard: fail now, as the group's collectives do
    // once a rank left, rather than wait for one that is gone.
    for (int32_t r : g.local_ranks) {
      if (g.session_of_rank[r] != 0) continue;
      return absl::UnavailableError(absl::StrCat(
          "group ", g.id, ": summon of ", Display(path), " in module ", Display(module),
          " needs every local rank's shard (HYBRID_* shard group) but rank ", r,
          " has no session (it left or has not joined again)"));
    }
  }
  // GPU ranks: device views, or pinned host views under offload_to_cpu (the collective
  // stages them through the device).
  d->placement = gpus_.empty() || !options.offload_to_cpu ? PlacementOf(rank) : Placement::Pinned();
  d->owner_uid = g.owner_uid;
  d->kept = KeptOf(reg);
  // The slot this summon will meet the other local ranks' in: its node copies may be made
  // (or being made) already.
  if (d->shared) {
    std::shared_ptr<SummonSlot>& slot = reg.slots[reg.summon_count[rank] + 1];
    if (!slot) slot = std::make_shared<SummonSlot>();
    d->slot = slot;
  }
  // KeptUnit's n: how many units of each size came before (a summon of one unit, the hot
  // path, has none and allocates nothing).
  std::map<int32_t, int> nth_of_size;
  for (int32_t u : d->units) {
    const PlanUnit& unit = reg.plan.units[u];
    const UnitShard& shard = reg.shards_by_rank[rank][u];
    const int32_t kept_unit =
        d->units.size() == 1 ? KeptUnit(reg, u) : KeptUnit(reg, u, nth_of_size[KeptUnit(reg, u)]++);
    const bool cast = CastsForCompute(options, unit);
    for (KeptUse use : {cast ? KeptUse::kComputeParams : KeptUse::kParams, KeptUse::kGrads}) {
      // Gradients exist for every rank of a unit or for none (made by one collective).
      if (use == KeptUse::kGrads && !(options.with_grads && shard.grad)) continue;
      const std::string label = absl::StrCat("group=", g.id, " unit=", u, " ",
                                             use == KeptUse::kGrads ? "grads"
                                             : cast                 ? "compute params"
                                                                    : "params");
      const DType view_dtype = use == KeptUse::kComputeParams ? unit.ComputeDType() : unit.dtype;
      const int64_t bytes = unit.padded_numel * ItemSize(view_dtype);
      // Buffers this rank sees: shared per node (read-only use), rank 0's only, or private.
      if (options.rank0_only) {
        if (rank == 0) {
          d->needs.push_back(
              {u, use, KeptKey::Rank(0, kept_unit, use), bytes, absl::StrCat(label, " rank=0")});
        }
      } else if (d->shared) {
        const auto& map = use != KeptUse::kGrads ? d->slot->shared_params : d->slot->shared_grads;
        if (map.contains(u) && map.at(u) != nullptr) continue;  // another rank made it
        if (d->slot->making.contains({u, use})) {
          d->wait = true;  // another rank is making it
          continue;
        }
        d->needs.push_back({u, use, KeptKey::NodeShared(kept_unit, use), bytes, label});
        d->make.emplace_back(u, use);
      } else {
        d->needs.push_back({u, use, KeptKey::Rank(rank, kept_unit, use), bytes,
                            absl::StrCat(label, " rank=", rank)});
      }
    }
  }
  return absl::OkStatus();
}

void Modules::OpenSummonLocked(Group& g, const Caller& caller, const std::string& module,
                               const std::string& path, const SummonOptions& options,
                               const SummonDecision& d, const ViewBuffers& got, SummonStart* out) {
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
    const bool params = use != KeptUse::kGrads;
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
  const strategy::Unshard how = strategy::UnshardOf(reg.plan, d.shared);
  const bool regroup = how == strategy::Unshard::kRegroup;
  // HYBRID_* across daemons, node copy: the shard group is this daemon's ranks; each copies
  // its own shard into its block of the copy (after mu_), no collective.
  const bool in_node = how == strategy::Unshard::kShardGroupGather;
  for (int32_t u : d.units) {
    const PlanUnit& unit = reg.plan.units[u];
    const UnitShard& shard = reg.shards_by_rank[rank][u];
    // HYBRID_* over part of the world: the op's output is a scratch of world_size shards
    // (allocated after mu_, SummonRegroup), this rank's shard group's copy goes to `to`.
    auto target = [&](const std::shared_ptr<Buffer>& to, DType dtype) {
      if (!regroup || to == nullptr) return MutableOf(to.get(), dtype);
      const int64_t item = ItemSize(dtype);
      out->regroups.push_back({out->ops.size(), to,
                               strategy::RegroupOffset(reg.plan, unit, rank) * item,
                               strategy::RegroupScratchElements(reg.plan, unit) * item,
                               unit.padded_numel * item, dtype, nullptr});
      return collective::MutableBuffer{nullptr, 0, dtype, MutableOf(to.get(), dtype).kind};
    };
    // Sharded: the all-gather (a gather to rank 0 under rank0_only) fills the view; NO_SHARD:
    // the shard is the whole buffer, copied after mu_ (CopyUnsharded).
    auto unshard = [&](const std::shared_ptr<Buffer>& from, const std::shared_ptr<Buffer>& to) {
      if (!d.sharded) {
        if (to != nullptr) out->copies.emplace_back(to, from);
        return;
      }
      if (in_node) {
        const int64_t offset = int64_t{reg.plan.ShardRank(rank)} * unit.shard_numel;
        out->casts.push_back(
            {from, unit.dtype, to, offset * ItemSize(unit.dtype), unit.dtype, unit.shard_numel});
        return;
      }
      collective::MutableBuffer full = target(to, unit.dtype);
      out->ops.push_back(
          options.rank0_only
              ? collective::CollectiveOp::Gather(u, ConstOf(*from, unit.dtype), full, 0)
              : collective::CollectiveOp::AllGather(u, ConstOf(*from, unit.dtype), full));
    };
    SummonedUnit view{u, nullptr, nullptr};
    if (CastsForCompute(options, unit) && d.sharded) {
      // Mixed precision: this rank's shard, cast into its own block of the low-precision
      // view (after mu_), is the all-gather's input: the bytes moved are low precision.
      view.params = view_of(u, KeptUse::kComputeParams);
      const DType cd = unit.ComputeDType();
      const int64_t offset = int64_t{reg.plan.ShardRank(rank)} * unit.shard_numel * ItemSize(cd);
      out->casts.push_back({shard.shard, unit.dtype, view.params, offset, cd, unit.shard_numel});
      collective::MutableBuffer all = MutableOf(view.params.get(), cd);
      collective::ConstBuffer own{static_cast<const char*>(all.data) + offset,
                                  static_cast<size_t>(unit.shard_numel * ItemSize(cd)), cd,
                                  all.kind};
      if (!in_node) {
        out->ops.push_back(collective::CollectiveOp::AllGather(u, own, target(view.params, cd)));
      }
    } else if (CastsForCompute(options, unit)) {
      // NO_SHARD: the whole shard cast into the view.
      view.params = view_of(u, KeptUse::kComputeParams);
      out->casts.push_back(
          {shard.shard, unit.dtype, view.params, 0, unit.ComputeDType(), unit.padded_numel});
    } else {
      view.params = view_of(u, KeptUse::kParams);
      unshard(shard.shard, view.params);
    }
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
  if (d.units.empty())
    result.note = absl::StrCat(Display(path), " is not a unit root: nothing unsharded");
  if (!options.rank0_only || rank == 0) result.views = open.views;
  g.open_summons.emplace(open.id, std::move(open));
  out->coll = g.coll;
  out->shard_group_gather = in_node && !d.units.empty();
  if (d.shared && (!out->ops.empty() || out->shard_group_gather) && g.local_ranks.size() > 1) {
    out->shared_slot = slot;
    out->shared_ranks = g.local_ranks;
  }
}

void Modules::StartUnshard(const Caller& caller, absl::Time deadline,
                           std::shared_ptr<SummonStart> start, SummonCallback done) {
  const uint64_t id = start->result.summon;
  const std::string what =
      absl::StrCat("group ", caller.group, " rank ", caller.rank, ": summon of units ",
                   absl::StrJoin(start->result.units, ", "));
  collective::DoneCallback finish = [this, caller, id, result = std::move(start->result),
                                     done = std::move(done)](absl::Status s) mutable {
    if (!s.ok()) {
      // Nothing was handed out: end the summon without writeback.
      FinishEnd(caller, id, s, [done = std::move(done), s](absl::Status) mutable { done(s); });
      return;
    }
    if (std::shared_ptr<Group> held = table_.Find(caller.group)) {
      absl::MutexLock lock(&held->mu);
      auto it = held->open_summons.find(id);
      if (it != held->open_summons.end()) it->second.ready = true;
    }
    result.ready = RecordReady(caller.rank);  // cudaEventRecord: no host wait
    done(std::move(result));
  };
  if (!start->regroups.empty()) {
    // HYBRID_* over part of the world: once the all-gathers completed, this rank's shard
    // group's copy of each unit from the scratch into the view (on the device's worker for
    // GPU ranks); the scratch goes after.
    finish = [this, rank = caller.rank, regroups = std::move(start->regroups),
              finish = std::move(finish)](absl::Status s) mutable {
      if (!s.ok()) {
        finish(std::move(s));
        return;
      }
      auto keep = std::make_shared<std::vector<SummonRegroup>>(std::move(regroups));
      devices_.RunBlocking(
          rank,
          [this, rank, keep] {
            for (const SummonRegroup& r : *keep) {
              FS_RETURN_IF_ERROR(
                  devices_.CopyBytes(rank, r.view->data(),
                                     static_cast<const char*>(r.scratch->data()) + r.scratch_offset,
                                     static_cast<size_t>(r.bytes)));
            }
            return absl::OkStatus();
          },
          [keep, finish = std::move(finish)](absl::Status copied) mutable {
            keep.reset();
            finish(std::move(copied));
          });
    };
  }
  std::shared_ptr<SummonSlot> shared_slot = std::move(start->shared_slot);
  if (shared_slot == nullptr) {
    start->coll->SubmitAll(caller.rank, std::move(start->ops), deadline - clock_->Now(),
                           std::move(finish));
    return;
  }
  // The node's one read-only copy is assembled by every local rank's part together (each
  // block lands once, through whichever local rank receives or copies it), so one rank's part
  // may be done before the copy is whole: NodeAssembly answers every local rank once all of
  // theirs are. Without a collective (kShardGroupGather) the summon's deadline bounds that
  // wait, and a group whose collectives failed fails the summon as its all-gather would.
  if (start->shard_group_gather) {
    assembly_.Arrive(shared_slot, caller.rank, start->shared_ranks, start->coll->status(), deadline,
                     what, std::move(finish));
    return;
  }
  start->coll->SubmitAll(caller.rank, std::move(start->ops), deadline - clock_->Now(),
                         [this, shared_slot, caller, ranks = std::move(start->shared_ranks),
                          finish = std::move(finish)](absl::Status s) mutable {
                           assembly_.Arrive(shared_slot, caller.rank, ranks, std::move(s),
                                            std::nullopt, "", std::move(finish));
                         });
}

absl::Status Modules::CheckUsable(const Group& g, const std::string& module,
                                  const Registered& reg) const {
  if (!reg.initialized) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, ": module ", Display(module),
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

void Modules::ReleaseBuffers(OpenSummon& open, AfterUnlock* after) {
  for (SummonedUnit& v : open.views) {
    after->Release(v.params);
    after->Release(v.grads);
  }
  for (auto& [key, b] : open.own_rank0) after->Release(b);
  after->Release(open.slot);
}

void Modules::FinishEnd(const Caller& caller, uint64_t summon, absl::Status status,
                        StatusCallback done) {
  AfterUnlock after;  // the summon's buffer references go after the lock (munmap, unlink)
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto it = g.removed ? g.open_summons.end() : g.open_summons.find(summon);
    if (it != g.open_summons.end()) {
      OpenSummon& open = it->second;
      // The module may have been dropped (lost at a re-form) while the summon was open.
      auto found = g.registered.find(open.module);
      Registered* reg = found == g.registered.end() ? nullptr : &found->second;
      if (reg != nullptr) {
        for (int32_t u : open.units) reg->summoned[open.rank][u] = false;
        // A summon that never became ready failed before anything was handed out.
        reg->NoteOp(open.units, open.ready ? "end" : "summon", open.rank, status.ok(),
                    clock_->Now());
        if (++open.slot->ended == static_cast<int32_t>(g.local_ranks.size())) {
          if (auto slot = reg->slots.find(open.k); slot != reg->slots.end()) {
            after.Destroy(reg->slots.extract(slot));
          }
        }
      }
      if (!status.ok() && open.ready && open.options.writeback) {
        if (reg != nullptr && !reg->initialized) {
          reg->uninitialized_why = std::string(status.message());
        }
        g.failed_ends[summon] = {open.rank, status};
        while (g.failed_ends.size() > internal::kFailedEndsKept) {
          g.failed_ends.erase(g.failed_ends.begin());
        }
      }
      // Drops this rank's references to the buffers, so ReleaseKept sees which kept buffers
      // nobody uses any more; a last reference (the kept set dropped it) goes after the lock.
      ReleaseBuffers(open, &after);
      g.open_summons.erase(it);
      if (reg != nullptr) ReleaseKept(*reg);
    }
  }
  after.Run();
  done(status);
}

void Modules::DropSummons(Group& g, int32_t rank, AfterUnlock* run) {
  for (auto it = g.open_summons.begin(); it != g.open_summons.end();) {
    OpenSummon& open = it->second;
    if (open.rank != rank) {
      ++it;
      continue;
    }
    auto found = g.registered.find(open.module);
    if (found == g.registered.end()) {  // dropped (lost at a re-form) while it was open
      ReleaseBuffers(open, run);
      it = g.open_summons.erase(it);
      continue;
    }
    Registered& reg = found->second;
    for (int32_t u : open.units) reg.summoned[rank][u] = false;
    if (!reg.initialized && open.options.writeback && !open.ending) {
      reg.uninitialized_why = absl::StrCat("rank ", rank,
                                           "'s session ended before it ended the "
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
  // Read-only node copies the rank did not add its part to yet: the other local ranks would
  // wait for it until their deadline; they fail now, naming it.
  std::vector<std::shared_ptr<SummonSlot>> slots;
  for (auto& [module, reg] : g.registered) {
    for (auto& [k, slot] : reg.slots) slots.push_back(slot);
  }
  if (!slots.empty()) {
    run->Call([this, rank, slots = std::move(slots),
               why = absl::UnavailableError(absl::StrCat(
                   "group ", g.id, ": local rank ", rank,
                   "'s session ended before it added its part to the node's summon copy"))] {
      for (const std::shared_ptr<SummonSlot>& slot : slots) assembly_.Fail(slot, rank, why);
    });
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

}  // namespace flatshard::server
