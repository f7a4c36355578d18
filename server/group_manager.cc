#include "server/group_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/planner.h"
#include "common/status_macros.h"

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
    absl::Time deadline;
    RegisterCallback done;
  };
  std::map<int32_t, Arrival> arrivals;
};

struct GroupManager::Registered {
  Plan plan;
  std::vector<std::vector<UnitShard>> shards_by_rank;
};

struct GroupManager::Group {
  std::string id;
  int32_t world_size = 0;
  std::string token;
  std::vector<uint64_t> session_of_rank;  // 0: not joined
  std::vector<PendingJoin> pending_joins;
  std::map<std::string, Registered> registered;
  std::map<std::string, PendingRegister> pending_registers;

  std::vector<int32_t> MissingRanks() const {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < world_size; ++r) {
      if (session_of_rank[r] == 0) missing.push_back(r);
    }
    return missing;
  }
  bool Idle() const {
    return registered.empty() && pending_registers.empty() && pending_joins.empty() &&
           std::all_of(session_of_rank.begin(), session_of_rank.end(),
                       [](uint64_t s) { return s == 0; });
  }
};

GroupManager::GroupManager(ShardStore* store) : store_(store) {
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
    absl::MutexLock lock(&mu_);
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

void GroupManager::MaybeCompleteJoins(Group& g, std::vector<absl::AnyInvocable<void()>>* run) {
  if (!g.MissingRanks().empty()) return;
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
  if (init != InitMode::kZeros) {
    done(absl::InvalidArgumentError(
        "init modes FROM_EVERY_RANK and FROM_RANK0 write values through a summon, which this "
        "daemon does not serve yet; register with INIT_MODE_ZEROS"));
    return;
  }
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
      if (g.registered.contains(module)) {
        error = absl::AlreadyExistsError(absl::StrCat(
            "group ", g.id, ": module ", Display(module), " is already registered"));
      }
      for (const auto& [other, r] : g.registered) {
        if (error.ok() && Nested(other, module)) {
          error = absl::InvalidArgumentError(absl::StrCat(
              "group ", g.id, ": module ", Display(module), " already has flatshard applied: ",
              "it overlaps the registered module ", Display(other)));
        }
      }
      PendingRegister& pending = g.pending_registers[module];
      if (error.ok() && pending.arrivals.contains(caller.rank)) {
        error = absl::FailedPreconditionError(absl::StrCat(
            "group ", g.id, " rank ", caller.rank, " is already registering module ",
            Display(module)));
      }
      if (error.ok()) {
        pending.arrivals[caller.rank] =
            PendingRegister::Arrival{std::move(plan), deadline, std::move(done)};
        MaybeCompleteRegister(g, module, &run);
      } else if (pending.arrivals.empty()) {
        g.pending_registers.erase(module);
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
    if (!diff.empty()) {
      shared_error = absl::InvalidArgumentError(absl::StrCat(
          "group ", g.id, ": ranks registered different models for module ", Display(module),
          ": ", diff));
    }
  }
  Registered registered;
  if (shared_error.ok()) {
    registered.plan = *first;
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
  for (auto& [rank, a] : pending.arrivals) {
    absl::StatusOr<RegisterResult> result =
        !a.plan.ok() ? absl::StatusOr<RegisterResult>(a.plan.status())
        : !shared_error.ok()
            ? absl::StatusOr<RegisterResult>(shared_error)
            : RegisterResult{registered.plan, registered.shards_by_rank[rank]};
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
  return RegisterResult{it->second.plan, it->second.shards_by_rank[caller.rank]};
}

absl::Status GroupManager::Leave(const Caller& caller) {
  absl::MutexLock lock(&mu_);
  FS_RETURN_IF_ERROR(CheckCallerLocked(caller));
  Group& g = *groups_.at(caller.group);
  g.session_of_rank[caller.rank] = 0;
  FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " left";
  if (g.Idle()) groups_.erase(caller.group);
  return absl::OkStatus();
}

void GroupManager::EndSession(const std::string& group, uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end()) return;
  Group& g = *it->second;
  for (int32_t r = 0; r < g.world_size; ++r) {
    if (g.session_of_rank[r] == session) {
      g.session_of_rank[r] = 0;
      FS_LOG(INFO) << "group=" << g.id << " rank=" << r << " lease ended (session=" << session
                   << ")";
    }
  }
  if (g.Idle()) groups_.erase(it);
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
        it = g.Idle() ? groups_.erase(it) : std::next(it);
      }
    }
    for (auto& f : run) f();
  }
}

}  // namespace flatshard::server
