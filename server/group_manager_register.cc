// GroupManager::Register: planning, the agreement exchange and allocation of shards.

#include "server/group_manager.h"

#include <array>
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/planner.h"
#include "common/sha256.h"

#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::Display;
using internal::Nested;
using internal::UnitSummary;

namespace {

// What each rank puts into a registration's agreement exchange (an all-gather): enough for
// every rank to reach the same verdict, so all of them commit or none.
struct RegisterRecord {
  char fingerprint[64];
  uint32_t units;
  uint8_t planned;    // 1: the rank's manifest and policy were accepted
  uint8_t allocated;  // 1: the rank's shards (and init buffers) are allocated
  uint8_t init;
  uint8_t reserved;
  char text[440];  // why planning or allocation failed; NUL-padded, truncated
};
static_assert(sizeof(RegisterRecord) == 512);

// Per-unit digests (16 hex digits of a SHA-256) find the first differing unit.
constexpr size_t kUnitDigestBytes = 16;
// A unit's one-line description, exchanged once the first differing unit is known.
constexpr size_t kUnitSummaryBytes = 384;

using internal::CopyText;
using internal::TextOf;

std::string UnitDigest(const PlanUnit& u) {
  std::string canon = absl::StrCat(u.module, "|", u.module_type, "|", DTypeName(u.dtype), "|",
                                   u.requires_grad, "|", u.numel, "|", u.padded_numel, "|",
                                   u.shard_numel);
  for (const PlanParam& p : u.params) {
    absl::StrAppend(&canon, "|", p.fqn, ":", absl::StrJoin(p.shape, "x"), "@", p.offset);
  }
  for (const SharedParam& sp : u.shared) absl::StrAppend(&canon, "|", sp.fqn, "=", sp.same_as);
  return Sha256Hex(canon).substr(0, kUnitDigestBytes);
}

}  // namespace

// One rank's registration between its arrival and the verdict: up to three all-gathers over
// the group's collectives (records; on differing plans, unit digests; then the differing
// unit's summary), so every rank names the same first difference.
struct GroupManager::RegisterExchange {
  Caller caller;
  std::string module;
  absl::StatusOr<Plan> plan;
  Manifest manifest;
  InitMode init = InitMode::kZeros;
  absl::Time deadline;
  RegisterCallback done;
  std::shared_ptr<collective::CollectiveGroup> coll;
  int32_t world_size = 0;
  // Allocated before the exchange, so the verdict covers allocation too.
  std::vector<UnitShard> shards;
  std::vector<std::shared_ptr<Buffer>> committed;     // per unit: the committed copies
  std::vector<std::shared_ptr<Buffer>> init_buffers;  // per unit; null where none
  int step = 0;
  RegisterRecord mine{};
  std::vector<RegisterRecord> all;
  int64_t max_units = 0;
  std::string my_digests;
  std::string all_digests;
  int32_t diff_rank = 0;  // the first rank whose plan differs from rank 0's
  int64_t diff_unit = 0;
  std::array<char, kUnitSummaryBytes> my_summary{};
  std::vector<char> all_summaries;
};

void GroupManager::Register(const Caller& caller, const std::string& module,
                            const absl::StatusOr<Manifest>& manifest,
                            const absl::StatusOr<Policy>& policy, InitMode init,
                            absl::Time deadline, RegisterCallback done) {
  int32_t world_size = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    absl::Status s = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                               : CheckCallerLocked(caller);
    if (!s.ok()) {
      done(s);
      return;
    }
    world_size = groups_.at(caller.group)->world_size;
  }
  // Planning can take milliseconds on a large model: do it outside the lock.
  PlanOptions options;
  options.world_size = world_size;
  absl::StatusOr<Plan> plan = !manifest.ok() ? absl::StatusOr<Plan>(manifest.status())
                              : !policy.ok()  ? absl::StatusOr<Plan>(policy.status())
                                              : BuildPlan(*manifest, *policy, options);

  auto x = std::make_shared<RegisterExchange>();
  absl::Status error;
  {
    absl::ReleasableMutexLock lock(&mu_);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(caller);
    if (error.ok()) {
      Group& g = *groups_.at(caller.group);
      auto known = g.registered.find(module);
      if (known != g.registered.end()) {
        Registered& r = known->second;
        const bool same_model = plan.ok() && plan->fingerprint == r.plan.fingerprint;
        if (r.initialized && r.attached_session[caller.rank] != caller.session && same_model &&
            !r.shards_by_rank[caller.rank].empty()) {
          // A restarted trainer re-attaches: same model, new session; no collective. It gets
          // the last committed generation (a rollback, if due, ran at the re-form).
          if (r.rollback_pending) {
            error = absl::UnavailableError(absl::StrCat(
                "group ", g.id, ": module ", Display(module),
                " is being rolled back to its committed generation; register again"));
          } else {
            r.attached_session[caller.rank] = caller.session;
            r.stale[caller.rank] = false;
            FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank
                         << " re-attached to module " << Display(module) << " at generation "
                         << r.generation[caller.rank];
            RegisterResult result{r.plan, r.shards_by_rank[caller.rank], std::nullopt,
                                  r.generation[caller.rank]};
            lock.Release();
            done(std::move(result));
            return;
          }
        } else if (!r.initialized && same_model) {
          // Its initialisation never committed on every rank: this registration runs it again
          // (collective, like the first). An init summon this rank still holds is void.
          for (auto it = g.open_summons.begin(); it != g.open_summons.end();) {
            if (it->second.rank == caller.rank && it->second.module == module &&
                !it->second.ending) {
              for (int32_t u : it->second.units) r.summoned[caller.rank][u] = false;
              it = g.open_summons.erase(it);
            } else {
              ++it;
            }
          }
          ReleaseKept(r);
          FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " registers module "
                       << Display(module) << " again: it was not initialised ("
                       << (r.uninitialized_why.empty() ? "init not ended" : r.uninitialized_why)
                       << ")";
        } else {
          error = absl::AlreadyExistsError(absl::StrCat(
              "group ", g.id, ": module ", Display(module), " is already registered",
              plan.ok() && plan->fingerprint != r.plan.fingerprint ? " (with a different model)"
                                                                   : " by this session"));
        }
      }
      for (const auto& [other, r] : g.registered) {
        if (error.ok() && other != module && Nested(other, module)) {
          error = absl::InvalidArgumentError(absl::StrCat(
              "group ", g.id, ": module ", Display(module), " already has flatshard applied: ",
              "it overlaps the registered module ", Display(other)));
        }
      }
      if (error.ok() && g.registering.contains({module, caller.rank})) {
        error = absl::FailedPreconditionError(absl::StrCat(
            "group ", g.id, " rank ", caller.rank, " is already registering module ",
            Display(module)));
      }
      if (error.ok()) {
        g.registering.insert({module, caller.rank});
        x->coll = g.coll;
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  x->caller = caller;
  x->module = module;
  x->init = init;
  x->deadline = deadline;
  x->done = std::move(done);
  x->world_size = world_size;
  x->manifest = manifest.ok() ? *manifest : Manifest{};
  x->plan = std::move(plan);

  // This rank's shards (zeros) and init buffers, before the verdict.
  absl::Status alloc;
  if (x->plan.ok()) {
    const bool init_views =
        init == InitMode::kFromEveryRank || (init == InitMode::kFromRank0 && caller.rank == 0);
    for (const PlanUnit& u : x->plan->units) {
      absl::StatusOr<std::shared_ptr<Buffer>> shard = store_->Allocate(
          BufferKind::kShard, u.shard_numel * ItemSize(u.dtype),
          absl::StrCat("group=", caller.group, " module=", module, " unit=", u.index,
                       " rank=", caller.rank),
          caller.uid, PlacementOf(caller.rank));
      if (!shard.ok()) {
        alloc = shard.status();
        break;
      }
      x->shards.push_back(UnitShard{u.index, *std::move(shard), nullptr});
      // The committed copy of the shard (semantics.md §3a): what a rollback restores.
      absl::StatusOr<std::shared_ptr<Buffer>> kept = store_->Allocate(
          BufferKind::kShard, u.shard_numel * ItemSize(u.dtype),
          absl::StrCat("group=", caller.group, " module=", module, " unit=", u.index,
                       " rank=", caller.rank, " committed"),
          caller.uid, PlacementOf(caller.rank));
      if (!kept.ok()) {
        alloc = kept.status();
        break;
      }
      x->committed.push_back(*std::move(kept));
      std::shared_ptr<Buffer> view;
      if (init_views) {
        absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
            BufferKind::kUnsharded, u.padded_numel * ItemSize(u.dtype),
            absl::StrCat("group=", caller.group, " unit=", u.index, " rank=", caller.rank,
                         " init"),
            caller.uid, PlacementOf(caller.rank));
        if (!b.ok()) {
          alloc = b.status();
          break;
        }
        view = *std::move(b);
      }
      x->init_buffers.push_back(std::move(view));
    }
    if (!alloc.ok()) {
      x->shards.clear();
      x->committed.clear();
      x->init_buffers.clear();
    }
  }
  RegisterRecord& r = x->mine;
  std::memset(&r, 0, sizeof(r));
  r.planned = x->plan.ok() ? 1 : 0;
  r.allocated = alloc.ok() ? 1 : 0;
  r.init = static_cast<uint8_t>(init);
  if (x->plan.ok()) {
    std::memcpy(r.fingerprint, x->plan->fingerprint.data(),
                std::min<size_t>(x->plan->fingerprint.size(), sizeof(r.fingerprint)));
    r.units = static_cast<uint32_t>(x->plan->units.size());
  }
  CopyText(!x->plan.ok() ? x->plan.status().message() : alloc.message(), r.text, sizeof(r.text));
  x->all.resize(world_size);
  RegisterStep(std::move(x));
}

void GroupManager::RegisterStep(std::shared_ptr<RegisterExchange> x) {
  using collective::CollectiveOp;
  auto bytes_of = [](auto* p, size_t n) { return collective::MutableBuffer{p, n}; };
  std::vector<CollectiveOp> ops;
  switch (x->step) {
    case 0:
      ops.push_back(CollectiveOp::AllGather(
          -1, collective::ConstBuffer{&x->mine, sizeof(RegisterRecord)},
          bytes_of(x->all.data(), x->all.size() * sizeof(RegisterRecord))));
      break;
    case 1:
      ops.push_back(CollectiveOp::AllGather(
          -1, collective::ConstBuffer{x->my_digests.data(), x->my_digests.size()},
          bytes_of(x->all_digests.data(), x->all_digests.size())));
      break;
    default:
      ops.push_back(CollectiveOp::AllGather(
          -1, collective::ConstBuffer{x->my_summary.data(), x->my_summary.size()},
          bytes_of(x->all_summaries.data(), x->all_summaries.size())));
      break;
  }
  ops.back().name = "register";
  const int32_t rank = x->caller.rank;
  auto coll = x->coll;
  const absl::Duration timeout = x->deadline - clock_->Now();
  coll->SubmitAll(rank, std::move(ops), timeout, [this, x](absl::Status s) mutable {
    if (!s.ok()) {
      FinishRegister(std::move(x), s);
      return;
    }
    const std::string where =
        absl::StrCat("group ", x->caller.group, ": ranks registered different models for module ",
                     Display(x->module), ": ");
    if (x->step == 0) {
      for (int32_t k = 0; k < x->world_size; ++k) {
        if (x->all[k].planned) continue;
        FinishRegister(
            std::move(x),
            k == x->caller.rank
                ? x->plan.status()
                : absl::InvalidArgumentError(absl::StrCat(
                      "group ", x->caller.group, ": rank ", k, "'s registration of module ",
                      Display(x->module), " was refused: ",
                      TextOf(x->all[k].text, sizeof(x->all[k].text)))));
        return;
      }
      for (int32_t k = 0; k < x->world_size; ++k) {
        // Units come from plans, which have at most one per module path; a larger count is a
        // corrupt record and must not size the digest exchange.
        if (x->all[k].units <= PlanOptions().max_module_paths) continue;
        FinishRegister(std::move(x), absl::InternalError(absl::StrCat(
                                         "group ", x->caller.group, ": rank ", k,
                                         "'s registration record claims ", x->all[k].units,
                                         " units")));
        return;
      }
      const RegisterRecord& first = x->all[0];
      for (int32_t k = 1; k < x->world_size; ++k) {
        if (std::memcmp(first.fingerprint, x->all[k].fingerprint, sizeof(first.fingerprint)) != 0) {
          // Find the first differing unit: exchange per-unit digests.
          x->diff_rank = k;
          x->max_units = 0;
          for (const RegisterRecord& rec : x->all) {
            x->max_units = std::max<int64_t>(x->max_units, rec.units);
          }
          x->my_digests.assign(x->max_units * kUnitDigestBytes, '-');
          for (const PlanUnit& u : x->plan->units) {
            x->my_digests.replace(u.index * kUnitDigestBytes, kUnitDigestBytes, UnitDigest(u));
          }
          x->all_digests.assign(x->my_digests.size() * x->world_size, '\0');
          x->step = 1;
          RegisterStep(std::move(x));
          return;
        }
        if (x->all[k].init != first.init) {
          FinishRegister(std::move(x), absl::InvalidArgumentError(absl::StrCat(
                                           where, "rank 0 and rank ", k,
                                           " asked for different init modes")));
          return;
        }
      }
      for (int32_t k = 0; k < x->world_size; ++k) {
        if (x->all[k].allocated) continue;
        FinishRegister(std::move(x), absl::ResourceExhaustedError(absl::StrCat(
                                         "group ", x->caller.group, ": rank ", k,
                                         " could not allocate the shards of module ",
                                         Display(x->module), ": ",
                                         TextOf(x->all[k].text, sizeof(x->all[k].text)))));
        return;
      }
      FinishRegister(std::move(x), absl::OkStatus());
      return;
    }
    const uint32_t units_a = x->all[0].units;
    const uint32_t units_b = x->all[x->diff_rank].units;
    if (x->step == 1) {
      const size_t stride = x->max_units * kUnitDigestBytes;
      const char* a = x->all_digests.data();
      const char* b = a + x->diff_rank * stride;
      int64_t i = 0;
      while (i < std::min(units_a, units_b) &&
             std::memcmp(a + i * kUnitDigestBytes, b + i * kUnitDigestBytes, kUnitDigestBytes) == 0) {
        ++i;
      }
      x->diff_unit = i;
      if (i < std::min(units_a, units_b)) {
        const std::string summary =
            i < static_cast<int64_t>(x->plan->units.size()) ? UnitSummary(x->plan->units[i]) : "";
        CopyText(summary, x->my_summary.data(), x->my_summary.size());
        x->all_summaries.assign(kUnitSummaryBytes * x->world_size, '\0');
        x->step = 2;
        RegisterStep(std::move(x));
        return;
      }
      FinishRegister(
          std::move(x),
          absl::InvalidArgumentError(
              units_a != units_b
                  ? absl::StrCat(where, "rank 0 has ", units_a, " units, rank ", x->diff_rank,
                                 " has ", units_b, " (first difference at unit ", i, ")")
                  : absl::StrCat(where, "the plans differ outside the units (ignored "
                                        "parameters or options)")));
      return;
    }
    const char* sa = x->all_summaries.data();
    const char* sb = sa + x->diff_rank * kUnitSummaryBytes;
    FinishRegister(std::move(x),
                   absl::InvalidArgumentError(absl::StrCat(
                       where, "first difference at unit ", x->diff_unit, ": rank 0 has ",
                       TextOf(sa, kUnitSummaryBytes), ", rank ", x->diff_rank, " has ",
                       TextOf(sb, kUnitSummaryBytes))));
  });
}

void GroupManager::FinishRegister(std::shared_ptr<RegisterExchange> x, absl::Status status) {
  const Caller& caller = x->caller;
  absl::StatusOr<RegisterResult> result =
      status.ok() ? absl::StatusOr<RegisterResult>(absl::InternalError("unset")) : status;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(caller.group);
    if (it == groups_.end()) {
      result = absl::UnavailableError(absl::StrCat("group ", caller.group, " is gone"));
    } else {
      Group& g = *it->second;
      g.registering.erase({x->module, caller.rank});
      if (absl::IsDeadlineExceeded(status) || absl::IsAborted(status) ||
          absl::IsUnavailable(status)) {
        result = absl::Status(status.code(),
                              absl::StrCat("group ", g.id, ": registration of module ",
                                           Display(x->module), " failed: ", status.message()));
      }
      if (status.ok()) {
        auto [pos, created] = g.registered.try_emplace(x->module);
        Registered& reg = pos->second;
        if (created) {
          reg.plan = *x->plan;
          reg.manifest = x->manifest;
          reg.summoned.assign(g.world_size, std::vector<bool>(reg.plan.units.size(), false));
          reg.summon_count.assign(g.world_size, 0);
          reg.attached_session.assign(g.world_size, 0);
          reg.shards_by_rank.resize(g.world_size);
          reg.committed.resize(g.world_size);
          reg.generation.assign(g.world_size, 0);
          reg.stale.assign(g.world_size, false);
          FS_LOG(INFO) << "group=" << g.id << " module=" << Display(x->module) << " registered: "
                       << reg.plan.units.size() << " units, fingerprint "
                       << reg.plan.fingerprint.substr(0, 16);
        }
        reg.shards_by_rank[caller.rank] = x->shards;
        reg.committed[caller.rank] = x->committed;
        reg.generation[caller.rank] = 0;
        reg.stale[caller.rank] = false;
        reg.attached_session[caller.rank] = caller.session;
        // Zeros are the model when asked for; initial values are, once the init summon's End
        // agreed on every rank (EndSummon).
        reg.initialized = x->init == InitMode::kZeros;
        if (!reg.initialized) reg.uninitialized_why.clear();
        RegisterResult r{reg.plan, x->shards, std::nullopt, 0};
        if (x->init != InitMode::kZeros) {
          // Initial values come through a summon that is already open: each rank (or rank 0)
          // fills its full buffers and ends it with writeback. The shards are zeros, so there
          // is nothing to all-gather first.
          const bool rank0_only = x->init == InitMode::kFromRank0;
          // Every rank's k-th summon shares a slot; a repeated init is the next k on every rank.
          const uint64_t k = ++reg.summon_count[caller.rank];
          std::shared_ptr<SummonSlot>& slot = reg.slots[k];
          if (!slot) slot = std::make_shared<SummonSlot>();
          OpenSummon open;
          open.id = g.next_summon++;
          open.rank = caller.rank;
          open.k = k;
          open.module = x->module;
          open.options = SummonOptions{true, true, rank0_only, false, false};
          open.slot = slot;
          open.coll = g.coll;
          open.ready = true;
          for (const PlanUnit& u : reg.plan.units) {
            open.units.push_back(u.index);
            open.views.push_back(SummonedUnit{u.index, x->init_buffers[u.index], nullptr});
            if (rank0_only && caller.rank == 0) slot->rank0_params[u.index] = x->init_buffers[u.index];
            reg.summoned[caller.rank][u.index] = true;
          }
          SummonResult init{open.id, open.units, {}, "", {}};
          if (!rank0_only || caller.rank == 0) init.views = open.views;
          r.init_summon = std::move(init);
          g.open_summons.emplace(open.id, std::move(open));
        }
        result = std::move(r);
      } else {
        FS_LOG(WARNING) << "group=" << g.id << " rank=" << caller.rank << " registration of "
                        << Display(x->module) << " failed: " << result.status();
      }
    }
  }
  x->shards.clear();
  x->committed.clear();
  x->init_buffers.clear();
  x->done(std::move(result));
}

}  // namespace flatshard::server
