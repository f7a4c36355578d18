// Modules: registration (collective agreement, allocation, init summons) and re-attach.

#include "server/module/modules.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/planner.h"
#include "common/status_macros.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/init_undo.h"
#include "server/module/strategy_collectives.h"
#include "server/module/unit_ops.h"
#include "server/registration.h"

namespace flatshard::server {

using internal::Display;
using internal::Nested;

// One rank's registration from its arrival to the commit: what FinishRegister installs once
// the agreement (server/registration.h) said yes on every rank.
Modules::Modules(ModulesOptions options)
    : store_(options.store),
      devices_(*options.devices),
      clock_(options.clock),
      gpus_(std::move(options.gpus)),
      kept_pool_(std::move(options.kept_pool)),
      table_(*options.table),
      records_(*options.records),
      shutdown_(*options.shutdown) {}

struct Modules::RegisterExchange {
  Caller caller;
  std::shared_ptr<Group> group;  // the caller's (never removed while it registers)
  std::string module;
  std::shared_ptr<const absl::StatusOr<Plan>> plan;
  Manifest manifest;
  InitMode init = InitMode::kZeros;
  RegisterCallback done;
  // Allocated before the agreement, so the verdict covers allocation too.
  RegistrationBuffers buffers;
};

void Modules::Register(const Caller& caller, const std::string& module,
                       const absl::StatusOr<Manifest>& manifest,
                       const absl::StatusOr<Policy>& policy, InitMode init, absl::Time deadline,
                       RegisterCallback done) {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) {
    done(absl::NotFoundError(absl::StrCat("unknown group ", caller.group)));
    return;
  }
  Group& g = *held;
  const int32_t world_size = g.world_size;
  std::vector<std::string> rank_nodes;  // multi-daemon groups: the node of each rank
  {
    absl::Status s;
    {
      absl::ReaderMutexLock lock(&g.mu);
      s = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                    : CheckCallerLocked(g, caller);
      if (s.ok() && g.multi() && policy.ok()) {
        for (const peer::DaemonIdentity& d : g.table.rank_daemons) rank_nodes.push_back(d.node);
      }
    }
    if (!s.ok()) {
      done(s);  // after the lock
      return;
    }
  }
  // Planning can take milliseconds on a large model: do it outside the lock.
  // HYBRID_*: a node is a daemon, its ranks one shard group (strategy_collectives.h).
  PlanOptions options;
  options.world_size = world_size;
  absl::StatusOr<int32_t> per_node =
      policy.ok()
          ? strategy::RanksPerNode(caller.group, policy->sharding_strategy, world_size, rank_nodes)
          : absl::StatusOr<int32_t>(0);
  if (per_node.ok()) options.ranks_per_node = *per_node;
  absl::StatusOr<Plan> plan = !manifest.ok()   ? absl::StatusOr<Plan>(manifest.status())
                              : !policy.ok()   ? absl::StatusOr<Plan>(policy.status())
                              : !per_node.ok() ? absl::StatusOr<Plan>(per_node.status())
                                               : BuildPlan(*manifest, *policy, options);

  auto x = std::make_shared<RegisterExchange>();
  std::shared_ptr<collective::CollectiveGroup> coll;  // the group's, when the checks passed
  absl::Status error;
  AfterUnlock after;  // declared before the lock: runs after it
  std::optional<RegisterResult> reattached;
  {
    absl::MutexLock lock(&g.mu);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(g, caller);
    if (error.ok()) error = StartRegisterLocked(g, caller, module, plan, &reattached, &after);
    if (error.ok() && !reattached.has_value()) coll = g.coll;
  }
  if (reattached.has_value()) {
    done(*std::move(reattached));
    return;
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  x->caller = caller;
  x->group = held;
  x->module = module;
  x->init = init;
  x->done = std::move(done);
  x->manifest = manifest.ok() ? *manifest : Manifest{};
  x->plan = std::make_shared<const absl::StatusOr<Plan>>(std::move(plan));

  // This rank's shards (zeros) and init buffers, before the verdict; outside the lock (shm
  // creation, device allocation). `g.registering` keeps this rank from registering the
  // module twice meanwhile, and FinishRegister re-checks that the group still exists.
  if ((*x->plan).ok()) {
    x->buffers =
        AllocateRegistration(*store_, **x->plan, caller, module, init, PlacementOf(caller.rank));
  }
  RegistrationProposal proposal;
  proposal.group = caller.group;
  proposal.rank = caller.rank;
  proposal.world_size = world_size;
  proposal.module = module;
  proposal.plan = x->plan;
  proposal.init = init;
  proposal.allocation = x->buffers.status;
  AgreeOnRegistration(std::move(coll), std::move(proposal), deadline, clock_,
                      [this, x](absl::Status verdict) mutable {
                        FinishRegister(std::move(x), std::move(verdict));
                      });
}

absl::Status Modules::StartRegisterLocked(Group& g, const Caller& caller, const std::string& module,
                                          const absl::StatusOr<Plan>& plan,
                                          std::optional<RegisterResult>* reattached,
                                          AfterUnlock* after) {
  auto known = g.registered.find(module);
  if (known != g.registered.end()) {
    Registered& r = known->second;
    const bool same_model = plan.ok() && plan->fingerprint == r.plan.fingerprint;
    if (r.initialized && r.attached_session[caller.rank] != caller.session && same_model &&
        !r.shards_by_rank[caller.rank].empty()) {
      // A restarted trainer re-attaches: same model, new session; no collective. It gets
      // the last committed generation (a rollback, if due, ran at the re-form).
      if (r.rollback_pending) {
        return absl::UnavailableError(
            absl::StrCat("group ", g.id, ": module ", Display(module),
                         " is being rolled back to its committed generation; register again"));
      }
      r.attached_session[caller.rank] = caller.session;
      r.stale[caller.rank] = false;
      FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " re-attached to module "
                   << Display(module) << " at generation " << r.generation[caller.rank];
      RegisterResult result{r.plan, r.shards_by_rank[caller.rank], std::nullopt,
                            r.generation[caller.rank]};
      result.state_specs = r.state_specs;  // the optimizer state re-attaches too
      *reattached = std::move(result);
      return absl::OkStatus();
    }
    if (!r.initialized && same_model) {
      // Its initialisation never committed on every rank: this registration runs it again
      // (collective, like the first). An init summon this rank still holds is void.
      for (auto it = g.open_summons.begin(); it != g.open_summons.end();) {
        if (it->second.rank == caller.rank && it->second.module == module && !it->second.ending) {
          for (int32_t u : it->second.units) r.summoned[caller.rank][u] = false;
          auto next = std::next(it);
          after->Destroy(g.open_summons.extract(it));  // its views' buffers, after the lock
          it = next;
        } else {
          ++it;
        }
      }
      ReleaseKept(r);
      FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " registers module "
                   << Display(module) << " again: it was not initialised ("
                   << (r.uninitialized_why.empty() ? "init not ended" : r.uninitialized_why) << ")";
    } else {
      return absl::AlreadyExistsError(absl::StrCat(
          "group ", g.id, ": module ", Display(module), " is already registered",
          plan.ok() && plan->fingerprint != r.plan.fingerprint ? " (with a different model)"
                                                               : " by this session"));
    }
  }
  for (const auto& [other, r] : g.registered) {
    if (other != module && Nested(other, module)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group ", g.id, ": module ", Display(module), " already has flatshard applied: ",
          "it overlaps the registered module ", Display(other)));
    }
  }
  if (g.registering.contains({module, caller.rank})) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", g.id, " rank ", caller.rank, " is already registering module ", Display(module)));
  }
  g.registering.insert({module, caller.rank});
  return absl::OkStatus();
}

void Modules::FinishRegister(std::shared_ptr<RegisterExchange> x, absl::Status status) {
  if (const absl::Duration pause = internal::TestingRegisterInstallPause(x->caller.rank);
      pause > absl::ZeroDuration() && status.ok()) {
    // Testing only: on a thread of its own, so whichever thread runs the other local ranks'
    // installs is not held.
    FS_LOG(WARNING) << "testing: rank " << x->caller.rank << "'s registration install paused for "
                    << absl::FormatDuration(pause);
    std::thread([this, x = std::move(x), pause]() mutable {
      absl::SleepFor(pause);
      InstallRegistration(std::move(x), absl::OkStatus());
    }).detach();
    return;
  }
  InstallRegistration(std::move(x), std::move(status));
}

void Modules::InstallRegistration(std::shared_ptr<RegisterExchange> x, absl::Status status) {
  const Caller& caller = x->caller;
  AfterUnlock persist;  // the group's record, after mu_
  absl::StatusOr<RegisterResult> result =
      status.ok() ? absl::StatusOr<RegisterResult>(absl::InternalError("unset")) : status;
  {
    // Re-taken to commit after the plan, the allocation and the agreement ran without mu_.
    // Invariant: (module, rank) stayed in `g.registering` throughout, so the group was not
    // removed meanwhile (Idle() and Unused() are false while anyone registers) and this rank
    // did not start a second registration of the module; the group's communicator may have
    // re-formed, but the verdict came from the agreement every rank reached, so every rank
    // commits the same way.
    Group& g = *x->group;
    absl::MutexLock lock(&g.mu);
    if (g.removed) {
      result = absl::UnavailableError(absl::StrCat("group ", caller.group, " is gone"));
    } else {
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
          reg.plan = **x->plan;
          reg.manifest = x->manifest;
          reg.summoned.assign(g.world_size, std::vector<bool>(reg.plan.units.size(), false));
          reg.summon_count.assign(g.world_size, 0);
          reg.attached_session.assign(g.world_size, 0);
          reg.shards_by_rank.resize(g.world_size);
          reg.committed.resize(g.world_size);
          reg.generation.assign(g.world_size, 0);
          reg.stale.assign(g.world_size, false);
          FS_LOG(INFO) << "group=" << g.id << " module=" << Display(x->module)
                       << " registered: " << reg.plan.units.size() << " units, fingerprint "
                       << reg.plan.fingerprint.substr(0, 16);
        }
        reg.shards_by_rank[caller.rank] = x->buffers.shards;
        reg.committed[caller.rank] = x->buffers.committed;
        DeviceHostCopies::ReplacedLocked(reg, caller.rank);
        reg.generation[caller.rank] = 0;
        reg.stale[caller.rank] = false;
        reg.attached_session[caller.rank] = caller.session;
        // Zeros are the model when asked for; initial values are, once the init summon's End
        // agreed on every rank (EndSummon).
        reg.initialized = x->init == InitMode::kZeros;
        if (!reg.initialized) reg.uninitialized_why.clear();
        reg.init_undone = false;
        reg.pending_commit.reset();
        // Restarts: a model of zeros is initialised now (the FROM_* modes record theirs
        // when their init commits); a re-registration replaces the recorded buffers.
        records_.PersistModuleLater(g, x->module, &persist);
        if (reg.initialized) records_.NoteCopiesDoneLocked(g, x->module, reg);  // GPU: zeros
        RegisterResult r{reg.plan, x->buffers.shards, std::nullopt, 0};
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
            const std::shared_ptr<Buffer>& view = x->buffers.init_buffers[u.index];
            open.views.push_back(SummonedUnit{u.index, view, nullptr});
            if (rank0_only && caller.rank == 0) slot->rank0_params[u.index] = view;
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
  // A refused registration's buffers go after the lock (munmap, unlink).
  x->buffers = RegistrationBuffers{};
  if (persist.empty()) {
    x->done(std::move(result));
    return;
  }
  // The record (fsync) before the answer, on the durable worker.
  records_.RunDurable(x->caller.group,
                      [x, persist = std::move(persist), result = std::move(result)]() mutable {
                        internal::TestingPauseInit("register_before_record");
                        persist.Run();
                        x->done(std::move(result));
                      });
}

}  // namespace flatshard::server
