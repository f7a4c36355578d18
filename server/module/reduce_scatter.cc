// Modules: reduce-scatter of gradients into the gradient shards.

#include "server/module/modules.h"

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
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/strategy_collectives.h"
#include "server/module/summon_steps.h"
#include "server/module/unit_ops.h"

namespace flatshard::server {

using summon_steps::GetViewBuffers;
using summon_steps::kSummonRounds;

using internal::ConstOf;
using internal::Display;
using internal::kAlreadyUnsharding;
using internal::MutableOf;
using internal::SelectUnits;

absl::StatusOr<std::shared_ptr<Buffer>> Modules::BeginReduceScatter(const Caller& caller,
                                                                    const std::string& module,
                                                                    int32_t unit,
                                                                    bool may_allocate) {
  // Decide under mu_, allocate without it, install under mu_ again. The buffers are only
  // installed in the last step, after every check ran afresh, so a failed allocation changes
  // nothing, and a buffer another call installed in the gap (a repeated begin) wins.
  std::shared_ptr<Buffer> grad_got, staging_got;
  for (int round = 0; round < kSummonRounds; ++round) {
    bool need_grad = false, need_staging = false;
    int64_t grad_bytes = 0, staging_bytes = 0;
    int64_t owner_uid = -1;
    std::shared_ptr<KeptBuffers> kept;
    int32_t kept_unit = unit;
    std::string label;
    {
      std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
      FS_ASSIGN_OR_RETURN(Registered * found, InitializedModule(g, module));
      Registered& reg = *found;
      if (unit < 0 || unit >= static_cast<int32_t>(reg.plan.units.size())) {
        return absl::NotFoundError(absl::StrCat("module ", Display(module), " has no unit ", unit,
                                                " (it has ", reg.plan.units.size(), ")"));
      }
      const PlanUnit& u = reg.plan.units[unit];
      const std::pair<int32_t, int32_t> key{caller.rank, unit};
      need_grad = !reg.shards_by_rank[caller.rank][unit].grad && !reg.new_grads.contains(key);
      auto staging = reg.grad_staging.find(key);
      need_staging = staging == reg.grad_staging.end() || !staging->second;
      if (need_staging && !staging_got) {
        // The steady state: the kept staging buffer is ready, no allocation needed.
        std::shared_ptr<KeptBuffers> kept_set = KeptOf(reg);
        staging_got =
            kept_set->TryGet(KeptKey::Rank(caller.rank, KeptUnit(reg, unit), KeptUse::kGradInput),
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
      if (!may_allocate) return std::shared_ptr<Buffer>();  // nothing changed
      // The gradient shard keeps the shards' precision; the trainer's full gradient comes in
      // the unit's reduce dtype (mixed precision), which the collective reduces in.
      grad_bytes = u.shard_numel * ItemSize(u.dtype);
      staging_bytes = u.padded_numel * ItemSize(u.ReduceDType());
      owner_uid = g.owner_uid;
      kept = KeptOf(reg);
      kept_unit = KeptUnit(reg, unit);
      label = absl::StrCat("group=", g.id, " unit=", unit, " rank=", caller.rank);
    }
    // Without mu_: shm creation, fchown, cudaHostRegister.
    if (need_grad && !grad_got) {
      FS_ASSIGN_OR_RETURN(grad_got, store_->Allocate(BufferKind::kGradShard, grad_bytes,
                                                     absl::StrCat(label, " grad"), owner_uid,
                                                     PlacementOf(caller.rank)));
    }
    if (need_staging && !staging_got) {
      FS_ASSIGN_OR_RETURN(
          staging_got,
          kept->Get(KeptKey::Rank(caller.rank, kept_unit, KeptUse::kGradInput),
                    BufferKind::kStaging, staging_bytes, absl::StrCat(label, " full grad"),
                    owner_uid, PlacementOf(caller.rank)));
    }
  }
  return absl::AbortedError(absl::StrCat("group ", caller.group, " rank ", caller.rank,
                                         ": the gradient buffers of unit ", unit, " of module ",
                                         Display(module), " changed ", kSummonRounds,
                                         " times while being allocated; begin again"));
}

void Modules::FinishReduceScatter(const Caller& caller, const std::string& module, int32_t unit,
                                  ReduceOp op, bool accumulate, absl::Time deadline,
                                  StatusCallback done, const gpu::IpcEventRef& written) {
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

// A reduce-scatter being finished: what its lock-held start took (TakeGradStagingLocked).
struct Modules::GradFinish {
  std::shared_ptr<Buffer> staging;
  std::shared_ptr<Buffer> grad;
  bool fresh = false;             // the unit had no gradient shard: `grad` is installed on success
  DType dtype = DType::kFloat32;  // of the gradient shard
  DType reduce_dtype = DType::kFloat32;  // of the staging buffer and the collective
  strategy::GradReduction reduction = strategy::GradReduction::kReduceScatter;
  int32_t world_size = 1;      // of `coll`
  int64_t reduced_offset = 0;  // kAllReduce: where this rank's shard starts, in elements
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::shared_ptr<KeptBuffers> kept;  // the module's, for the reduced shard's scratch
  int32_t kept_unit = 0;
};

void Modules::FinishReduceScatterWritten(const Caller& caller, const std::string& module,
                                         int32_t unit, ReduceOp op, bool accumulate,
                                         absl::Time deadline, StatusCallback done) {
  absl::Status error;
  GradFinish f;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    error = CheckCallerLocked(g, caller);
    if (error.ok()) error = TakeGradStagingLocked(g, caller, module, unit, &f);
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  // The collective reduces into a scratch shard; the gradient shard changes only once it
  // succeeded (replaced, or accumulated into), so a failed reduce-scatter changes nothing.
  // Host ranks reduce into private memory; GPU ranks into device memory of the pool.
  const std::shared_ptr<Buffer> grad = f.grad;
  const bool fresh = f.fresh;
  const DType dtype = f.dtype;
  // Mixed precision: the collective reduces in the reduce dtype (the host kernels add in
  // float32 and round once per reduction: once on one daemon); ApplyReducedGrad casts the
  // reduced shard into the full-precision gradient shard, as FSDP casts the sharded gradient
  // back to the parameters' dtype.
  const DType rd = f.reduce_dtype;
  // Reduce-scatter: the reduced shard. All-reduce (NO_SHARD, HYBRID_* over shard groups
  // smaller than the world): the trainer's whole gradient copied in, padded to a multiple of
  // the world size, reduced in place; the rank keeps its shard of it (f.reduced_offset).
  const bool all_reduce = f.reduction == strategy::GradReduction::kAllReduce;
  const int64_t shard_numel = grad->bytes() / ItemSize(dtype);
  const int64_t full_numel = f.staging->bytes() / ItemSize(rd);
  const int64_t scratch_bytes =
      (all_reduce ? strategy::AllReduceElements(full_numel, f.world_size) : shard_numel) *
      ItemSize(rd);
  const collective::ConstBuffer staged_grad = ConstOf(*f.staging, rd);
  // A kept buffer (no page faults per step once it has been touched; decommitted while idle),
  // unless the kept one is too small: then a fresh one, as before.
  std::shared_ptr<Buffer> scratch_buffer;
  const std::string scratch_label = absl::StrCat("group=", caller.group, " unit=", unit,
                                                 " rank=", caller.rank, " reduce-scatter scratch");
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      f.kept->Get(KeptKey::Rank(caller.rank, f.kept_unit, KeptUse::kGradScratch),
                  BufferKind::kStaging, scratch_bytes, scratch_label, -1, grad->placement());
  if (b.ok() && (*b)->bytes() < scratch_bytes) {
    b = store_->Allocate(BufferKind::kStaging, scratch_bytes, scratch_label, -1, grad->placement());
  }
  if (!b.ok()) {
    done(b.status());
    return;
  }
  scratch_buffer = *std::move(b);
  collective::MutableBuffer scratch = MutableOf(scratch_buffer.get(), rd);
  scratch.bytes = static_cast<size_t>(scratch_bytes);
  const collective::ReduceOp reduce =
      op == ReduceOp::kAvg ? collective::ReduceOp::kAvg : collective::ReduceOp::kSum;
  std::vector<collective::CollectiveOp> ops;
  if (all_reduce) {
    ops.push_back(collective::CollectiveOp::AllReduce(unit, scratch, reduce));
  } else {
    ops.push_back(collective::CollectiveOp::ReduceScatter(unit, staged_grad, scratch, reduce));
  }
  ops.back().name = "grads";
  // Once the collective completed: the reduced shard into the gradient shard (a device copy
  // for GPU ranks: on the device's worker, not on the engine's thread), then the outcome is
  // recorded under the group's lock.
  auto settle = [this, caller, module, unit, staging = f.staging, grad, fresh, scratch_buffer,
                 done = std::move(done)](absl::Status s) mutable {
    scratch_buffer.reset();
    staging.reset();  // the staging buffer's pages go back until the next step
    SettleReduceScatter(caller, module, unit, grad, fresh, s);
    done(s);
  };
  std::shared_ptr<collective::CollectiveGroup> coll = std::move(f.coll);
  const int64_t reduced_offset = all_reduce ? f.reduced_offset : 0;
  f = GradFinish{};  // the staging buffer lives in `settle` (and the op) only
  // The reduced gradient: the whole scratch shard, or the rank's shard of the all-reduce.
  const collective::ConstBuffer reduced{
      static_cast<const char*>(scratch.data) + reduced_offset * ItemSize(rd),
      static_cast<size_t>(shard_numel * ItemSize(rd)), rd, scratch.kind};
  auto submit = [this, rank = caller.rank, coll = std::move(coll), ops = std::move(ops), deadline,
                 grad, fresh, reduced, scratch_buffer, dtype, accumulate,
                 settle = std::move(settle)](absl::Status copied) mutable {
    if (!copied.ok()) {
      settle(std::move(copied));
      return;
    }
    coll->SubmitAll(rank, std::move(ops), deadline - clock_->Now(),
                    [this, rank, grad, fresh, reduced, scratch_buffer, dtype, accumulate,
                     settle = std::move(settle)](absl::Status s) mutable {
                      if (!s.ok()) {
                        settle(std::move(s));
                        return;
                      }
                      // The scratch buffers stay alive in this job until the copy is done.
                      devices_.RunBlocking(
                          rank,
                          [this, rank, grad, fresh, reduced, scratch_buffer, dtype, accumulate] {
                            return devices_.ApplyReducedGrad(rank, reduced, *grad, dtype,
                                                             accumulate && !fresh);
                          },
                          std::move(settle));
                    });
  };
  if (!all_reduce) {
    submit(absl::OkStatus());
    return;
  }
  // The all-reduce works in place: the trainer's gradient into the scratch first (a device
  // copy for GPU ranks, on the device's worker).
  devices_.RunBlocking(
      caller.rank,
      [this, rank = caller.rank, scratch, staged_grad] {  // `submit` holds the staging buffer
        return devices_.CopyBytes(rank, scratch.data, staged_grad.data, staged_grad.bytes);
      },
      std::move(submit));
}

absl::Status Modules::TakeGradStagingLocked(Group& g, const Caller& caller,
                                            const std::string& module, int32_t unit,
                                            GradFinish* out) {
  auto it = g.registered.find(module);
  if (it == g.registered.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, " rank ", caller.rank, ": no gradient buffer for unit ", unit,
                     " of module ", Display(module), " (begin the reduce-scatter first)"));
  }
  Registered& reg = it->second;
  auto s = reg.grad_staging.find({caller.rank, unit});
  if (s == reg.grad_staging.end()) {
    auto failed = reg.failed_finishes.find({caller.rank, unit});
    if (failed != reg.failed_finishes.end()) return failed->second;  // a repeated finish
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, " rank ", caller.rank, ": no gradient buffer for unit ", unit,
                     " of module ", Display(module), " (begin the reduce-scatter first)"));
  }
  out->staging = s->second;
  reg.grad_staging.erase(s);
  out->grad = reg.shards_by_rank[caller.rank][unit].grad;
  if (!out->grad) {
    out->fresh = true;
    out->grad = reg.new_grads.at({caller.rank, unit});
  }
  out->dtype = reg.plan.units[unit].dtype;
  out->reduce_dtype = reg.plan.units[unit].ReduceDType();
  out->reduction = strategy::GradReductionOf(reg.plan);
  out->reduced_offset = strategy::ReducedOffset(reg.plan, reg.plan.units[unit], caller.rank);
  out->world_size = reg.plan.world_size;
  out->coll = g.coll;
  out->kept = KeptOf(reg);
  out->kept_unit = KeptUnit(reg, unit);
  return absl::OkStatus();
}

void Modules::SettleReduceScatter(const Caller& caller, const std::string& module, int32_t unit,
                                  const std::shared_ptr<Buffer>& grad, bool fresh,
                                  const absl::Status& s) {
  AfterUnlock persist;  // the record, after the lock
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    auto reg = g.registered.find(module);
    if (reg == g.registered.end()) return;
    if (fresh) {
      reg->second.new_grads.erase({caller.rank, unit});
      if (s.ok()) reg->second.shards_by_rank[caller.rank][unit].grad = grad;
      if (s.ok()) records_.PersistModuleLater(g, module, &persist);  // a new durable buffer
    }
    reg->second.NoteOp({unit}, "reduce_scatter", caller.rank, s.ok(), clock_->Now());
    if (s.ok()) {
      reg->second.failed_finishes.erase({caller.rank, unit});
    } else {
      reg->second.failed_finishes[{caller.rank, unit}] = s;
    }
    ReleaseKept(reg->second);
  }
  persist.Run();
}

gpu::IpcEventRef Modules::RecordReady(int32_t rank) { return devices_.RecordReady(rank); }

}  // namespace flatshard::server
