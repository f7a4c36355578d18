#include "server/group_manager.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/planner.h"
#include "common/status_macros.h"
#include "server/collective/inproc/inproc_backend.h"
#include "server/collective/reduce.h"

namespace flatshard::server {
namespace {

// Token comparison that takes the same time wherever the first difference is.
bool TokensEqual(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

std::string UnitSummary(const PlanUnit& u) {
  return absl::StrCat("\"", u.module, "\" (", u.module_type, ", ", u.params.size(), " params, ",
                      u.numel, " elements, ", DTypeName(u.dtype), ")");
}

// Describes the first difference between two plans, or "" when they are equal.
std::string FirstDifference(const Plan& a, int rank_a, const Plan& b, int rank_b) {
  if (a.fingerprint == b.fingerprint) return "";
  const size_t n = std::min(a.units.size(), b.units.size());
  for (size_t i = 0; i < n; ++i) {
    if (a.units[i] == b.units[i]) continue;
    return absl::StrCat("first difference at unit ", i, ": rank ", rank_a, " has ",
                        UnitSummary(a.units[i]), ", rank ", rank_b, " has ",
                        UnitSummary(b.units[i]));
  }
  if (a.units.size() != b.units.size()) {
    return absl::StrCat("rank ", rank_a, " has ", a.units.size(), " units, rank ", rank_b,
                        " has ", b.units.size(), " (first difference at unit ", n, ")");
  }
  return absl::StrCat("the plans differ outside the units (ignored parameters or options)");
}

// True when registering `b` would nest FSDP units inside those of `a` or the other way round.
bool Nested(const std::string& a, const std::string& b) {
  auto inside = [](const std::string& outer, const std::string& inner) {
    return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                             inner[outer.size()] == '.');
  };
  return inside(a, b) || inside(b, a);
}

std::string Display(const std::string& module) {
  return module.empty() ? std::string("\"\" (the root)") : absl::StrCat("\"", module, "\"");
}

}  // namespace

struct GroupManager::PendingJoin {
  int32_t rank = 0;
  uint64_t session = 0;
  absl::Time deadline;
  JoinCallback done;
};

struct GroupManager::PendingRegister {
  struct Arrival {
    absl::StatusOr<Plan> plan;
    Manifest manifest;
    InitMode init = InitMode::kZeros;
    absl::Time deadline;
    RegisterCallback done;
  };
  std::map<int32_t, Arrival> arrivals;
};

// The k-th summon of every rank of a module: the buffers its ranks share.
struct GroupManager::SummonSlot {
  std::map<int32_t, std::shared_ptr<Buffer>> shared_params;  // writeback=false: one per node
  std::map<int32_t, std::shared_ptr<Buffer>> shared_grads;
  std::map<int32_t, std::shared_ptr<Buffer>> rank0_params;  // rank0_only: rank 0's buffers
  std::map<int32_t, std::shared_ptr<Buffer>> rank0_grads;
  int32_t ended = 0;
};

struct GroupManager::OpenSummon {
  uint64_t id = 0;
  int32_t rank = 0;
  uint64_t k = 0;
  std::string module;
  SummonOptions options;
  std::vector<int32_t> units;
  std::vector<SummonedUnit> views;  // this rank's buffers, one per unit (null entries allowed)
  std::shared_ptr<SummonSlot> slot;
  bool ready = false;   // the unshard completed
  bool ending = false;  // EndSummon under way
};

struct GroupManager::Registered {
  Plan plan;
  Manifest manifest;
  std::vector<std::vector<UnitShard>> shards_by_rank;
  std::vector<std::vector<bool>> summoned;  // [rank][unit]
  std::vector<uint64_t> summon_count;       // per rank: k of its last summon
  std::map<uint64_t, std::shared_ptr<SummonSlot>> slots;
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<Buffer>> grad_staging;  // (rank, unit)
  // Unsharded and staging buffers kept across summons, decommitted while unused, so a
  // trainer maps each segment once (steady state: no mmap per summon). Key: (owner, unit,
  // what) with owner = rank, or -1 for the node's shared read-only copy.
  struct Kept {
    std::shared_ptr<Buffer> buffer;
    absl::Time idle_since = absl::InfiniteFuture();  // in use until ReleaseKept says otherwise
  };
  std::map<std::tuple<int32_t, int32_t, int>, Kept> kept;
  // The session each rank registered or re-attached in; a rank whose session changed (a
  // restarted trainer) may register the same model again to re-attach.
  std::vector<uint64_t> attached_session;
};

struct GroupManager::Group {
  std::string id;
  int32_t world_size = 0;
  std::string token;
  std::vector<uint64_t> session_of_rank;  // 0: not joined
  std::vector<PendingJoin> pending_joins;
  std::map<std::string, Registered> registered;
  std::map<std::string, PendingRegister> pending_registers;
  std::map<uint64_t, OpenSummon> open_summons;
  uint64_t next_summon = 1;
  std::shared_ptr<collective::CollectiveGroup> coll;

  std::vector<int32_t> MissingRanks() const {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < world_size; ++r) {
      if (session_of_rank[r] == 0) missing.push_back(r);
    }
    return missing;
  }
  bool Idle() const {
    return registered.empty() && pending_registers.empty() && pending_joins.empty() &&
           open_summons.empty() &&
           std::all_of(session_of_rank.begin(), session_of_rank.end(),
                       [](uint64_t s) { return s == 0; });
  }
};

GroupManager::GroupManager(ShardStore* store) : store_(store) {
  auto backend = collective::CreateInprocBackend();
  FS_CHECK(backend.ok()) << backend.status();
  inproc_ = *std::move(backend);
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

GroupManager::~GroupManager() {
  Shutdown();
  deadline_thread_.join();
}

void GroupManager::Shutdown() {
  std::vector<absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    const absl::Status down = absl::UnavailableError("flatshardd is shutting down");
    for (auto& [id, g] : groups_) {
      for (PendingJoin& j : g->pending_joins) {
        run.push_back([done = std::move(j.done), down]() mutable { done(down); });
      }
      g->pending_joins.clear();
      for (auto& [module, pending] : g->pending_registers) {
        for (auto& [rank, a] : pending.arrivals) {
          run.push_back([done = std::move(a.done), down]() mutable { done(down); });
        }
      }
      g->pending_registers.clear();
    }
  }
  for (auto& f : run) f();
}

void GroupManager::Join(const JoinArgs& args, absl::Time deadline, JoinCallback done) {
  std::vector<absl::AnyInvocable<void()>> run;
  absl::Status error;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (shutdown_) {
      error = absl::UnavailableError("flatshardd is shutting down");
    } else if (args.group.empty()) {
      error = absl::InvalidArgumentError("group id must not be empty");
    } else if (args.world_size < 1) {
      error = absl::InvalidArgumentError(
          absl::StrCat("group ", args.group, ": world_size must be at least 1, got ", args.world_size));
    } else if (args.rank < 0 || args.rank >= args.world_size) {
      error = absl::InvalidArgumentError(absl::StrCat("group ", args.group, ": rank ", args.rank,
                                                      " is out of range [0, ", args.world_size, ")"));
    }
    if (error.ok()) {
      auto& slot = groups_[args.group];
      if (!slot) {
        slot = std::make_unique<Group>();
        slot->id = args.group;
        slot->world_size = args.world_size;
        slot->token = args.token;
        slot->session_of_rank.assign(args.world_size, 0);
        if (absl::Status s = ConnectCollectives(*slot); !s.ok()) {
          groups_.erase(args.group);
          lock.Release();
          done(s);
          return;
        }
        FS_LOG(INFO) << "group=" << args.group << " created, world_size=" << args.world_size;
      }
      Group& g = *slot;
      if (!TokensEqual(g.token, args.token)) {
        error = absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
      } else if (g.world_size != args.world_size) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "group ", g.id, " has world_size ", g.world_size, ", rank ", args.rank,
            " joined with world_size ", args.world_size));
      } else if (g.session_of_rank[args.rank] != 0) {
        error = absl::AlreadyExistsError(absl::StrCat("group ", g.id, ": rank ", args.rank,
                                                      " is already joined (session ",
                                                      g.session_of_rank[args.rank], ")"));
      } else {
        const uint64_t session = next_session_++;
        g.session_of_rank[args.rank] = session;
        g.pending_joins.push_back(PendingJoin{args.rank, session, deadline, std::move(done)});
        FS_LOG(INFO) << "group=" << g.id << " rank=" << args.rank << " joined, session=" << session;
        MaybeCompleteJoins(g, &run);
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  for (auto& f : run) f();
}

absl::Status GroupManager::ConnectCollectives(Group& g) {
  if (g.coll) engine_.RemoveGroup(g.id, absl::AbortedError("communicator re-formed")).IgnoreError();
  const collective::GroupSpec spec = collective::GroupSpec::AllLocal(g.id, g.world_size);
  FS_ASSIGN_OR_RETURN(std::unique_ptr<collective::Communicator> comm, inproc_->Connect(spec));
  FS_ASSIGN_OR_RETURN(g.coll, engine_.AddGroup(spec, std::move(comm)));
  return absl::OkStatus();
}

void GroupManager::MaybeCompleteJoins(Group& g, std::vector<absl::AnyInvocable<void()>>* run) {
  if (!g.MissingRanks().empty()) return;
  if (!g.coll->status().ok()) {
    // Every rank is back after a failure: start the op sequence afresh.
    FS_LOG(INFO) << "group=" << g.id << " re-forms its communicator after: " << g.coll->status();
    if (absl::Status s = ConnectCollectives(g); !s.ok()) {
      for (PendingJoin& j : g.pending_joins) {
        g.session_of_rank[j.rank] = 0;
        run->push_back([done = std::move(j.done), s]() mutable { done(s); });
      }
      g.pending_joins.clear();
      return;
    }
  }
  std::vector<std::string> modules;
  for (const auto& [module, r] : g.registered) modules.push_back(module);
  for (PendingJoin& j : g.pending_joins) {
    JoinResult result{j.session, modules};
    run->push_back([done = std::move(j.done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  }
  g.pending_joins.clear();
}

absl::Status GroupManager::CheckCaller(const Caller& caller) const {
  absl::ReaderMutexLock lock(&mu_);
  return CheckCallerLocked(caller);
}

absl::Status GroupManager::CheckCallerLocked(const Caller& caller) const {
  auto it = groups_.find(caller.group);
  if (it == groups_.end()) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  const Group& g = *it->second;
  if (!TokensEqual(g.token, caller.token)) {
    return absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
  }
  if (caller.rank < 0 || caller.rank >= g.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("group ", g.id, ": rank ", caller.rank,
                                                   " is out of range [0, ", g.world_size, ")"));
  }
  if (caller.session == 0 || g.session_of_rank[caller.rank] != caller.session) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", g.id, " rank ", caller.rank, ": session ", caller.session,
        " is not the rank's current session (join first)"));
  }
  return absl::OkStatus();
}

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

  std::vector<absl::AnyInvocable<void()>> run;
  absl::Status error;
  {
    absl::MutexLock lock(&mu_);
    error = shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                      : CheckCallerLocked(caller);
    if (error.ok()) {
      Group& g = *groups_.at(caller.group);
      if (auto reg = g.registered.find(module); reg != g.registered.end()) {
        Registered& r = reg->second;
        if (r.attached_session[caller.rank] != caller.session && plan.ok() &&
            plan->fingerprint == r.plan.fingerprint) {
          // A restarted trainer re-attaches: same model, new session; no collective.
          r.attached_session[caller.rank] = caller.session;
          FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " re-attached to module "
                       << Display(module);
          RegisterResult result{r.plan, r.shards_by_rank[caller.rank], std::nullopt};
          run.push_back([done = std::move(done), result = std::move(result)]() mutable {
            done(std::move(result));
          });
        } else {
          error = absl::AlreadyExistsError(absl::StrCat(
              "group ", g.id, ": module ", Display(module), " is already registered",
              plan.ok() && plan->fingerprint != r.plan.fingerprint
                  ? " (with a different model)"
                  : " by this session"));
        }
      }
      const bool reattached = !run.empty();
      for (const auto& [other, r] : g.registered) {
        if (error.ok() && !reattached && Nested(other, module)) {
          error = absl::InvalidArgumentError(absl::StrCat(
              "group ", g.id, ": module ", Display(module), " already has flatshard applied: ",
              "it overlaps the registered module ", Display(other)));
        }
      }
      if (!reattached) {
        PendingRegister& pending = g.pending_registers[module];
        if (error.ok() && pending.arrivals.contains(caller.rank)) {
          error = absl::FailedPreconditionError(absl::StrCat(
              "group ", g.id, " rank ", caller.rank, " is already registering module ",
              Display(module)));
        }
        if (error.ok()) {
          pending.arrivals[caller.rank] =
              PendingRegister::Arrival{std::move(plan), manifest.ok() ? *manifest : Manifest{},
                                       init, deadline, std::move(done)};
          MaybeCompleteRegister(g, module, &run);
        } else if (pending.arrivals.empty()) {
          g.pending_registers.erase(module);
        }
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  for (auto& f : run) f();
}

void GroupManager::MaybeCompleteRegister(Group& g, const std::string& module,
                                         std::vector<absl::AnyInvocable<void()>>* run) {
  PendingRegister& pending = g.pending_registers.at(module);
  if (static_cast<int32_t>(pending.arrivals.size()) < g.world_size) return;

  // Every rank is here: refuse together, or allocate together.
  absl::Status shared_error;
  for (auto& [rank, a] : pending.arrivals) {
    if (!a.plan.ok()) {
      shared_error = absl::InvalidArgumentError(absl::StrCat(
          "group ", g.id, ": rank ", rank, "'s registration of module ", Display(module),
          " was refused: ", a.plan.status().message()));
      break;
    }
  }
  const Plan* first = nullptr;
  int32_t first_rank = 0;
  for (auto& [rank, a] : pending.arrivals) {
    if (!shared_error.ok()) break;
    if (first == nullptr) {
      first = &*a.plan;
      first_rank = rank;
      continue;
    }
    std::string diff = FirstDifference(*first, first_rank, *a.plan, rank);
    if (diff.empty() && a.init != pending.arrivals.begin()->second.init) {
      diff = absl::StrCat("rank ", first_rank, " and rank ", rank, " asked for different init modes");
    }
    if (!diff.empty()) {
      shared_error = absl::InvalidArgumentError(absl::StrCat(
          "group ", g.id, ": ranks registered different models for module ", Display(module),
          ": ", diff));
    }
  }
  Registered registered;
  if (shared_error.ok()) {
    registered.plan = *first;
    registered.manifest = pending.arrivals.begin()->second.manifest;
    registered.summoned.assign(g.world_size, std::vector<bool>(registered.plan.units.size(), false));
    registered.summon_count.assign(g.world_size, 0);
    registered.attached_session.assign(g.world_size, 0);
    for (const auto& [rank, a] : pending.arrivals) {
      registered.attached_session[rank] = g.session_of_rank[rank];
    }
    registered.shards_by_rank.resize(g.world_size);
    for (int32_t rank = 0; rank < g.world_size && shared_error.ok(); ++rank) {
      for (const PlanUnit& u : registered.plan.units) {
        absl::StatusOr<std::shared_ptr<Buffer>> shard = store_->Allocate(
            BufferKind::kShard, u.shard_numel * ItemSize(u.dtype),
            absl::StrCat("group=", g.id, " module=", module, " unit=", u.index, " rank=", rank));
        if (!shard.ok()) {
          shared_error = shard.status();
          break;
        }
        registered.shards_by_rank[rank].push_back(UnitShard{u.index, *std::move(shard), nullptr});
      }
    }
  }
  // Initial values come through a summon that is already open: each rank (or rank 0) fills
  // its private full buffers and ends it with writeback. The shards are zeros, so there is
  // nothing to all-gather first.
  const InitMode init = pending.arrivals.begin()->second.init;
  std::vector<std::optional<SummonResult>> init_summons(g.world_size);
  std::vector<OpenSummon> opened;
  if (shared_error.ok() && init != InitMode::kZeros) {
    auto slot = std::make_shared<SummonSlot>();
    const bool rank0_only = init == InitMode::kFromRank0;
    for (int32_t rank = 0; rank < g.world_size && shared_error.ok(); ++rank) {
      OpenSummon open;
      open.id = g.next_summon++;
      open.rank = rank;
      open.k = 1;
      open.module = module;
      open.options = SummonOptions{true, true, rank0_only, false, false};
      open.slot = slot;
      open.ready = true;
      for (const PlanUnit& u : registered.plan.units) {
        open.units.push_back(u.index);
        SummonedUnit view{u.index, nullptr, nullptr};
        if (!rank0_only || rank == 0) {
          absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
              BufferKind::kUnsharded, u.padded_numel * ItemSize(u.dtype),
              absl::StrCat("group=", g.id, " unit=", u.index, " rank=", rank, " init"));
          if (!b.ok()) {
            shared_error = b.status();
            break;
          }
          view.params = *b;
          if (rank0_only) slot->rank0_params[u.index] = *b;
        }
        open.views.push_back(std::move(view));
      }
      SummonResult r{open.id, open.units, {}, ""};
      if (!rank0_only || rank == 0) r.views = open.views;
      init_summons[rank] = std::move(r);
      opened.push_back(std::move(open));
    }
  }
  if (shared_error.ok()) {
    for (OpenSummon& open : opened) {
      for (int32_t u : open.units) registered.summoned[open.rank][u] = true;
      registered.summon_count[open.rank] = 1;
      registered.slots[1] = open.slot;
      g.open_summons.emplace(open.id, std::move(open));
    }
  }
  for (auto& [rank, a] : pending.arrivals) {
    absl::StatusOr<RegisterResult> result =
        !a.plan.ok() ? absl::StatusOr<RegisterResult>(a.plan.status())
        : !shared_error.ok()
            ? absl::StatusOr<RegisterResult>(shared_error)
            : RegisterResult{registered.plan, registered.shards_by_rank[rank],
                             init_summons[rank]};
    run->push_back([done = std::move(a.done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  }
  g.pending_registers.erase(module);
  if (shared_error.ok()) {
    FS_LOG(INFO) << "group=" << g.id << " module=" << Display(module) << " registered: "
                 << registered.plan.units.size() << " units, fingerprint "
                 << registered.plan.fingerprint.substr(0, 16);
    g.registered.emplace(module, std::move(registered));
  } else {
    FS_LOG(WARNING) << "group=" << g.id << " registration failed: " << shared_error;
  }
}

absl::StatusOr<RegisterResult> GroupManager::GetShards(const Caller& caller,
                                                       const std::string& module) const {
  absl::ReaderMutexLock lock(&mu_);
  FS_RETURN_IF_ERROR(CheckCallerLocked(caller));
  const Group& g = *groups_.at(caller.group);
  auto it = g.registered.find(module);
  if (it == g.registered.end()) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(module), " is not registered"));
  }
  return RegisterResult{it->second.plan, it->second.shards_by_rank[caller.rank], std::nullopt};
}

absl::Status GroupManager::Leave(const Caller& caller) {
  absl::MutexLock lock(&mu_);
  FS_RETURN_IF_ERROR(CheckCallerLocked(caller));
  Group& g = *groups_.at(caller.group);
  DropSummons(g, caller.rank);
  g.session_of_rank[caller.rank] = 0;
  FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " left";
  if (g.Idle()) {
    engine_.RemoveGroup(g.id, absl::AbortedError("group removed")).IgnoreError();
    groups_.erase(caller.group);
  }
  return absl::OkStatus();
}

void GroupManager::EndSession(const std::string& group, uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end()) return;
  Group& g = *it->second;
  for (int32_t r = 0; r < g.world_size; ++r) {
    if (g.session_of_rank[r] == session) {
      // Its summons end without writeback; collectives waiting for it fail now rather than
      // at their deadline (the communicator re-forms once every rank joined again).
      DropSummons(g, r);
      if (!g.coll->PendingOps().empty()) {
        g.coll->Abort(absl::UnavailableError(absl::StrCat(
            "group ", g.id, ": rank ", r, "'s session ended (client gone) during a collective")));
      }
      g.session_of_rank[r] = 0;
      FS_LOG(INFO) << "group=" << g.id << " rank=" << r << " lease ended (session=" << session
                   << ")";
    }
  }
  if (g.Idle()) {
    engine_.RemoveGroup(g.id, absl::AbortedError("group removed")).IgnoreError();
    groups_.erase(it);
  }
}

namespace {

// Units of `plan` whose module is `path` (recurse=false) or in its subtree (recurse=true).
std::vector<int32_t> SelectUnits(const Plan& plan, const std::string& path, bool recurse) {
  std::vector<int32_t> units;
  for (const PlanUnit& u : plan.units) {
    const bool exact = u.module == path;
    const bool below = path.empty() || (u.module.size() > path.size() &&
                                        u.module.compare(0, path.size(), path) == 0 &&
                                        u.module[path.size()] == '.');
    if (exact || (recurse && below)) units.push_back(u.index);
  }
  return units;
}

collective::ConstBuffer ConstOf(const Buffer& b, DType dtype) {
  return collective::ConstBuffer{b.data(), static_cast<size_t>(b.bytes()), dtype};
}
collective::MutableBuffer MutableOf(const Buffer* b, DType dtype) {
  if (b == nullptr) return collective::MutableBuffer{nullptr, 0, dtype};
  return collective::MutableBuffer{b->data(), static_cast<size_t>(b->bytes()), dtype};
}

// Copies shard rank `r`'s unpadded range of the full buffer into its shard.
void CopyOwnRange(const Plan& plan, const PlanUnit& unit, int32_t r, const Buffer& full,
                  Buffer& shard) {
  absl::StatusOr<FlatLayout> layout = UnitLayout(plan, unit);
  FS_CHECK(layout.ok()) << layout.status();  // the plan was validated when it was made
  const ElementRange range = layout->UnpaddedShardRange(r);
  if (range.empty()) return;
  const int64_t item = ItemSize(unit.dtype);
  std::memcpy(static_cast<char*>(shard.data()) + (range.begin - layout->ShardRange(r).begin) * item,
              static_cast<const char*>(full.data()) + range.begin * item, range.size() * item);
}

// Counts one request's collectives; the last completion reports the first error.
struct OpJoin {
  absl::Mutex mu;
  int remaining ABSL_GUARDED_BY(mu) = 0;
  absl::Status first ABSL_GUARDED_BY(mu);
  absl::AnyInvocable<void(absl::Status)> done;
};

collective::DoneCallback Arrive(const std::shared_ptr<OpJoin>& join) {
  return [join](absl::Status s) {
    bool last = false;
    absl::Status first;
    {
      absl::MutexLock lock(&join->mu);
      if (!s.ok() && join->first.ok()) join->first = s;
      last = --join->remaining == 0;
      first = join->first;
    }
    if (last) join->done(first);
  };
}

// Runs `ops` on `coll` for `rank` and calls `done` once all completed.
void SubmitAll(const std::shared_ptr<collective::CollectiveGroup>& coll, int32_t rank,
               std::vector<collective::CollectiveOp> ops, absl::Time deadline,
               absl::AnyInvocable<void(absl::Status)> done) {
  if (ops.empty()) {
    done(absl::OkStatus());
    return;
  }
  auto join = std::make_shared<OpJoin>();
  join->done = std::move(done);
  {
    absl::MutexLock lock(&join->mu);
    join->remaining = static_cast<int>(ops.size());
  }
  const absl::Duration timeout = std::max(absl::ZeroDuration(), deadline - absl::Now());
  for (collective::CollectiveOp& op : ops) {
    op.timeout = timeout;
    coll->Submit(rank, std::move(op), Arrive(join));
  }
}

// A kept buffer idle this long gives its pages back: a training loop that summons every step
// keeps its pages (no page faults per step), an idle job holds only its shards.
constexpr absl::Duration kKeptIdleRelease = absl::Seconds(1);

constexpr char kAlreadyUnsharding[] =
    "Cannot manually unshard parameters when already unsharding parameters";

}  // namespace

absl::StatusOr<std::shared_ptr<Buffer>> GroupManager::KeptBuffer(
    Group&, Registered& reg, int32_t owner, int32_t unit, int what, BufferKind kind,
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
  absl::StatusOr<std::shared_ptr<Buffer>> fresh = store_->Allocate(kind, bytes, label);
  if (absl::IsResourceExhausted(fresh.status())) {
    DecommitIdle(absl::InfiniteFuture());
    fresh = store_->Allocate(kind, bytes, label);
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
        const Registered& reg = g.registered.at(copy.module);
        plan = &reg.plan;  // registrations are never removed while the group lives
        shards = reg.shards_by_rank[caller.rank];
        coll = g.coll;
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
  // beyond FSDP: rank 0's edits reach every shard. Every rank waits for rank 0 to end (a
  // zero-byte broadcast from rank 0 is the barrier), then takes its range from rank 0's buffer.
  std::vector<collective::CollectiveOp> barrier;
  barrier.push_back(collective::CollectiveOp::Broadcast(-1, collective::MutableBuffer{}, 0));
  SubmitAll(coll, caller.rank, std::move(barrier), deadline,
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
        if (++open.slot->ended == group.world_size) reg.slots.erase(open.k);
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
    if (++open.slot->ended == g.world_size) reg.slots.erase(open.k);
    FS_LOG(WARNING) << "group=" << g.id << " rank=" << rank << " summon " << open.id
                    << " ended without writeback (session ended)";
    it = g.open_summons.erase(it);
  }
  for (auto& [module, reg] : g.registered) {
    for (auto s = reg.grad_staging.begin(); s != reg.grad_staging.end();) {
      s = s->first.first == rank ? reg.grad_staging.erase(s) : std::next(s);
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
  // Gradient shards appear for every rank at once, so `with_grads` sees the same on all ranks.
  if (!reg.shards_by_rank[caller.rank][unit].grad) {
    std::vector<std::shared_ptr<Buffer>> grads;
    for (int32_t r = 0; r < g.world_size; ++r) {
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b,
                          store_->Allocate(BufferKind::kGradShard, u.shard_numel * item,
                                           absl::StrCat("group=", g.id, " unit=", unit,
                                                        " rank=", r, " grad")));
      grads.push_back(std::move(b));
    }
    for (int32_t r = 0; r < g.world_size; ++r) reg.shards_by_rank[r][unit].grad = grads[r];
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
  DType dtype = DType::kFloat32;
  std::shared_ptr<collective::CollectiveGroup> coll;
  int32_t world = 1;
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
        staging = s->second;
        it->second.grad_staging.erase(s);
        grad = it->second.shards_by_rank[caller.rank][unit].grad;
        dtype = it->second.plan.units[unit].dtype;
        coll = g.coll;
        world = g.world_size;
      }
    }
  }
  if (!error.ok()) {
    done(error);
    return;
  }
  // Accumulating reduces into a scratch shard first, then adds it to the gradient shard.
  auto scratch = accumulate ? std::make_shared<std::vector<char>>(grad->bytes()) : nullptr;
  collective::MutableBuffer out =
      accumulate ? collective::MutableBuffer{scratch->data(), scratch->size(), dtype}
                 : MutableOf(grad.get(), dtype);
  std::vector<collective::CollectiveOp> ops;
  ops.push_back(collective::CollectiveOp::ReduceScatter(
      unit, ConstOf(*staging, dtype), out,
      op == GradReduce::kAvg ? collective::ReduceOp::kAvg : collective::ReduceOp::kSum));
  (void)world;
  SubmitAll(coll, caller.rank, std::move(ops), deadline,
            [this, caller, module, staging, grad, scratch, dtype,
             done = std::move(done)](absl::Status s) mutable {
              if (s.ok() && scratch) {
                const void* srcs[] = {grad->data(), scratch->data()};
                collective::ReduceInto(dtype, srcs, grad->data(),
                                       grad->bytes() / ItemSize(dtype), collective::ReduceOp::kSum,
                                       1);
              }
              staging.reset();  // the staging buffer's pages go back until the next step
              {
                absl::MutexLock lock(&mu_);
                auto g = groups_.find(caller.group);
                if (g != groups_.end()) {
                  auto reg = g->second->registered.find(module);
                  if (reg != g->second->registered.end()) ReleaseKept(reg->second);
                }
              }
              done(s);
            });
}

std::vector<GroupManager::GroupInfo> GroupManager::ListGroups() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<GroupInfo> out;
  for (const auto& [id, g] : groups_) {
    GroupInfo info{id, g->world_size, {}, {}};
    for (int32_t r = 0; r < g->world_size; ++r) {
      if (g->session_of_rank[r] != 0) info.joined_ranks.push_back(r);
    }
    for (const auto& [module, reg] : g->registered) info.registered_modules.push_back(module);
    out.push_back(std::move(info));
  }
  return out;
}

void GroupManager::DeadlineLoop() {
  for (;;) {
    std::vector<absl::AnyInvocable<void()>> run;
    {
      absl::MutexLock lock(&mu_);
      // Wake at least every 20 ms; deadlines are in seconds, so this costs nothing.
      mu_.AwaitWithTimeout(absl::Condition(&shutdown_), absl::Milliseconds(20));
      if (shutdown_) return;
      const absl::Time now = absl::Now();
      DecommitIdle(now);
      for (auto it = groups_.begin(); it != groups_.end();) {
        Group& g = *it->second;
        std::vector<int32_t> missing = g.MissingRanks();
        for (auto j = g.pending_joins.begin(); j != g.pending_joins.end();) {
          if (j->deadline > now) {
            ++j;
            continue;
          }
          absl::Status s = absl::DeadlineExceededError(absl::StrCat(
              "group ", g.id, ": ranks ", absl::StrJoin(missing, ", "), " of ", g.world_size,
              " did not join before the deadline"));
          g.session_of_rank[j->rank] = 0;  // a failed join leaves no trace
          run.push_back([done = std::move(j->done), s]() mutable { done(s); });
          j = g.pending_joins.erase(j);
        }
        for (auto p = g.pending_registers.begin(); p != g.pending_registers.end();) {
          std::vector<int32_t> not_arrived;
          for (int32_t r = 0; r < g.world_size; ++r) {
            if (!p->second.arrivals.contains(r)) not_arrived.push_back(r);
          }
          for (auto a = p->second.arrivals.begin(); a != p->second.arrivals.end();) {
            if (a->second.deadline > now) {
              ++a;
              continue;
            }
            absl::Status s = absl::DeadlineExceededError(absl::StrCat(
                "group ", g.id, ": registration of module ", Display(p->first), ": ranks ",
                absl::StrJoin(not_arrived, ", "), " did not register before the deadline"));
            run.push_back([done = std::move(a->second.done), s]() mutable { done(s); });
            a = p->second.arrivals.erase(a);
          }
          p = p->second.arrivals.empty() ? g.pending_registers.erase(p) : std::next(p);
        }
        if (g.Idle()) {
          engine_.RemoveGroup(g.id, absl::AbortedError("group removed")).IgnoreError();
          it = groups_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& f : run) f();
  }
}

}  // namespace flatshard::server
