#include "server/group_manager.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/planner.h"
#include "common/sha256.h"
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

// Access control (README "Access control"): a group answers only callers of the uid that
// created it; remote (TCP) callers have uid -1 and share the groups created over TCP.
template <typename G>
absl::Status CheckUid(const G& g, int64_t uid) {
  if (uid == g.owner_uid) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "group ", g.id, ": uid ", uid < 0 ? std::string("(remote)") : absl::StrCat(uid),
      " is not admitted (the group belongs to uid ",
      g.owner_uid < 0 ? std::string("(remote)") : absl::StrCat(g.owner_uid), ")"));
}

std::string UnitSummary(const PlanUnit& u) {
  return absl::StrCat("\"", u.module, "\" (", u.module_type, ", ", u.params.size(), " params, ",
                      u.numel, " elements, ", DTypeName(u.dtype), ")");
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

// A coordinator no group has used for this long gets its watch stream closed.
constexpr absl::Duration kUnwatchAfter = absl::Seconds(10);

// A kept buffer idle this long gives its pages back: a training loop that summons every step
// keeps its pages (no page faults per step), an idle job holds only its shards.
constexpr absl::Duration kKeptIdleRelease = absl::Seconds(1);

constexpr char kAlreadyUnsharding[] =
    "Cannot manually unshard parameters when already unsharding parameters";

}  // namespace

struct GroupManager::PendingJoin {
  int32_t rank = 0;
  uint64_t session = 0;
  absl::Time deadline;
  JoinCallback done;
};

// The k-th summon of every rank of a module: the buffers its ranks share.
struct GroupManager::SummonSlot {
  std::map<int32_t, std::shared_ptr<Buffer>> shared_params;  // writeback=false: one per node
  std::map<int32_t, std::shared_ptr<Buffer>> shared_grads;
  // rank0_only: rank 0's buffers where rank 0 is local; elsewhere the node's copy of them,
  // received by the writeback broadcast.
  std::map<int32_t, std::shared_ptr<Buffer>> rank0_params;
  std::map<int32_t, std::shared_ptr<Buffer>> rank0_grads;
  int32_t ended = 0;  // local ranks that ended this summon
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
  // Gradient shards allocated by BeginReduceScatter for a unit that has none yet; installed
  // in shards_by_rank only when the reduce-scatter succeeds (a failed one changes nothing).
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<Buffer>> new_grads;  // (rank, unit)
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
  // Per unit: its last summon, end or reduce-scatter here (`flatshardctl units`).
  std::vector<UnitOp> last_op;

  void NoteOp(const std::vector<int32_t>& units, const char* op, int32_t rank, bool ok) {
    last_op.resize(plan.units.size());
    const absl::Time now = absl::Now();
    for (int32_t u : units) {
      if (u >= 0 && u < static_cast<int32_t>(last_op.size())) last_op[u] = UnitOp{op, rank, now, ok};
    }
  }
};

struct GroupManager::Group {
  std::string id;
  int32_t world_size = 0;
  std::string token;
  int64_t owner_uid = -1;   // the creator's uid (Caller::uid); only it is admitted
  std::string coordinator;  // empty: a local group
  uint64_t epoch = 0;       // of the peer table the communicator runs (multi-daemon)
  uint64_t reported_epoch = 0;  // the last epoch whose failure went to the coordinator
  std::vector<int32_t> local_ranks;  // the ranks this daemon hosts, ascending
  std::vector<uint64_t> session_of_rank;  // 0: not joined
  std::vector<PendingJoin> pending_joins;
  std::map<std::string, Registered> registered;
  std::set<std::pair<std::string, int32_t>> registering;  // (module, rank) mid-registration
  std::map<uint64_t, OpenSummon> open_summons;
  uint64_t next_summon = 1;
  std::shared_ptr<collective::CollectiveGroup> coll;

  bool multi() const { return !coordinator.empty(); }

  std::vector<int32_t> MissingRanks() const {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < world_size; ++r) {
      if (session_of_rank[r] == 0) missing.push_back(r);
    }
    return missing;
  }
  bool Idle() const {
    return registered.empty() && registering.empty() && pending_joins.empty() &&
           open_summons.empty() &&
           std::all_of(session_of_rank.begin(), session_of_rank.end(),
                       [](uint64_t s) { return s == 0; });
  }
};

GroupManager::GroupManager(ShardStore* store, GroupManagerOptions options)
    : store_(store), self_(std::move(options.self)), remote_(std::move(options.remote_backend)) {
  auto backend = collective::CreateInprocBackend();
  FS_CHECK(backend.ok()) << backend.status();
  inproc_ = *std::move(backend);
  if (!self_.peer_address.empty() && remote_ != nullptr) {
    self_.backend_address = remote_->LocalAddress();
    peer_ = std::make_unique<peer::PeerClient>(self_, std::move(options.peer), this);
  }
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

GroupManager::~GroupManager() {
  Shutdown();
  deadline_thread_.join();
  peer_.reset();  // its pending rendezvous fail now, while the manager is whole
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
      // Pending collectives (registrations, summons) fail on the engine's thread.
      if (g->coll) g->coll->Abort(down);
    }
  }
  for (auto& f : run) f();
}

void GroupManager::Join(const JoinArgs& args, absl::Time deadline, JoinCallback done) {
  std::vector<absl::AnyInvocable<void()>> run;
  absl::Status error;
  uint64_t session = 0;
  uint64_t failed_epoch = 0;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (shutdown_) {
      error = absl::UnavailableError("flatshardd is shutting down");
    } else if (draining_) {
      error = absl::UnavailableError("flatshardd is draining");
    } else if (args.group.empty()) {
      error = absl::InvalidArgumentError("group id must not be empty");
    } else if (args.world_size < 1 || args.world_size > kMaxWorldSize) {
      error = absl::InvalidArgumentError(absl::StrCat("group ", args.group,
                                                      ": world_size must be in [1, ", kMaxWorldSize,
                                                      "], got ", args.world_size));
    } else if (args.rank < 0 || args.rank >= args.world_size) {
      error = absl::InvalidArgumentError(absl::StrCat("group ", args.group, ": rank ", args.rank,
                                                      " is out of range [0, ", args.world_size, ")"));
    } else if (!args.coordinator.empty() && peer_ == nullptr) {
      error = absl::FailedPreconditionError(absl::StrCat(
          "group ", args.group, ": rank ", args.rank, " names coordinator ", args.coordinator,
          ", but this daemon serves no multi-daemon groups (start flatshardd with --peer_address",
          remote_ == nullptr ? " and a UCX build" : "", ")"));
    }
    if (error.ok()) {
      auto& slot = groups_[args.group];
      if (!slot) {
        slot = std::make_unique<Group>();
        slot->id = args.group;
        slot->world_size = args.world_size;
        slot->token = args.token;
        slot->owner_uid = args.uid;
        slot->coordinator = args.coordinator;
        slot->session_of_rank.assign(args.world_size, 0);
        if (!slot->multi()) {
          for (int32_t r = 0; r < args.world_size; ++r) slot->local_ranks.push_back(r);
          if (absl::Status s = ConnectCollectives(*slot); !s.ok()) {
            groups_.erase(args.group);
            lock.Release();
            done(s);
            return;
          }
        }
        FS_LOG(INFO) << "group=" << args.group << " created, world_size=" << args.world_size
                     << (slot->multi() ? absl::StrCat(", coordinator=", args.coordinator) : "");
      }
      Group& g = *slot;
      if (absl::Status s = CheckUid(g, args.uid); !s.ok()) {
        error = std::move(s);
      } else if (!TokensEqual(g.token, args.token)) {
        error = absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
      } else if (g.world_size != args.world_size) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "group ", g.id, " has world_size ", g.world_size, ", rank ", args.rank,
            " joined with world_size ", args.world_size));
      } else if (g.coordinator != args.coordinator) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "group ", g.id, " has coordinator \"", g.coordinator, "\", rank ", args.rank,
            " joined with coordinator \"", args.coordinator, "\""));
      } else if (g.session_of_rank[args.rank] != 0) {
        error = absl::AlreadyExistsError(absl::StrCat("group ", g.id, ": rank ", args.rank,
                                                      " is already joined (session ",
                                                      g.session_of_rank[args.rank], ")"));
      } else {
        session = next_session_++;
        g.session_of_rank[args.rank] = session;
        g.pending_joins.push_back(PendingJoin{args.rank, session, deadline, std::move(done)});
        FS_LOG(INFO) << "group=" << g.id << " rank=" << args.rank << " joined, session=" << session;
        if (!g.multi()) MaybeCompleteJoins(g, &run);
        if (g.multi() && g.coll && !g.coll->status().ok()) failed_epoch = g.epoch;
      }
      if (!error.ok()) MaybeRemoveGroup(args.group);
    }
  }
  if (!error.ok()) {
    for (auto& f : run) f();
    done(error);
    return;
  }
  for (auto& f : run) f();
  if (!args.coordinator.empty()) {
    // The daemons meet at the coordinator; the join completes when every rank arrived there.
    peer_->Rendezvous(args.coordinator, args.group, args.token, args.world_size, args.rank,
                      deadline,
                      [this, group = args.group, rank = args.rank,
                       session](absl::StatusOr<peer::PeerTable> table) {
                        OnRendezvous(group, rank, session, std::move(table));
                      },
                      failed_epoch);
  }
}

void GroupManager::OnRendezvous(const std::string& group, int32_t rank, uint64_t session,
                                absl::StatusOr<peer::PeerTable> table) {
  std::vector<absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(group);
    if (it == groups_.end()) return;
    Group& g = *it->second;
    auto j = std::find_if(g.pending_joins.begin(), g.pending_joins.end(),
                          [&](const PendingJoin& p) { return p.session == session; });
    if (j == g.pending_joins.end()) return;  // failed already (deadline, shutdown)
    absl::Status s = table.status();
    if (s.ok() && (static_cast<int32_t>(table->rank_daemons.size()) != g.world_size ||
                   table->rank_daemons[rank].daemon_id != self_.daemon_id)) {
      s = absl::InternalError(absl::StrCat("group ", g.id, ": the coordinator's peer table does not "
                                           "place rank ", rank, " on this daemon"));
    }
    if (s.ok()) s = ApplyTable(g, *table);
    if (s.ok()) {
      std::vector<std::string> modules;
      for (const auto& [module, r] : g.registered) modules.push_back(module);
      run.push_back([done = std::move(j->done), result = JoinResult{session, modules}]() mutable {
        done(std::move(result));
      });
    } else {
      g.session_of_rank[rank] = 0;  // a failed join leaves no trace
      run.push_back([done = std::move(j->done), s]() mutable { done(s); });
    }
    g.pending_joins.erase(j);
    if (!s.ok()) MaybeRemoveGroup(group);
  }
  for (auto& f : run) f();
}

absl::Status GroupManager::ApplyTable(Group& g, const peer::PeerTable& table) {
  if (g.coll && g.epoch >= table.epoch && g.coll->status().ok()) return absl::OkStatus();
  if (g.coll && g.epoch > table.epoch) return absl::OkStatus();  // a stale table
  collective::GroupSpec spec;
  spec.group_id = g.id;
  spec.world_size = g.world_size;
  spec.epoch = table.epoch;
  for (int32_t r = 0; r < g.world_size; ++r) {
    const peer::DaemonIdentity& d = table.rank_daemons[r];
    if (d.daemon_id == self_.daemon_id) spec.local_ranks.push_back(r);
    spec.rank_addresses.push_back(d.backend_address);
  }
  FS_ASSIGN_OR_RETURN(std::unique_ptr<collective::Communicator> comm, remote_->Connect(spec));
  if (g.coll) {
    engine_.RemoveGroup(g.id, absl::AbortedError(absl::StrCat(
                                  "group ", g.id, " re-formed at epoch ", table.epoch)))
        .IgnoreError();
  }
  FS_ASSIGN_OR_RETURN(g.coll, engine_.AddGroup(spec, std::move(comm)));
  g.epoch = table.epoch;
  g.local_ranks.assign(spec.local_ranks.begin(), spec.local_ranks.end());
  FS_LOG(INFO) << "group=" << g.id << " epoch=" << g.epoch << " formed over " << g.world_size
               << " ranks, local ranks " << absl::StrJoin(g.local_ranks, ",");
  return absl::OkStatus();
}

void GroupManager::MaybeRemoveGroup(const std::string& id) {
  auto it = groups_.find(id);
  if (it == groups_.end() || !it->second->Idle()) return;
  const std::string coordinator = it->second->coordinator;
  engine_.RemoveGroup(id, absl::AbortedError("group removed")).IgnoreError();
  groups_.erase(it);
  // Its coordinator's watch stream is closed by DeadlineLoop once no group has used it for a
  // while: a job that leaves and joins again (or a refused join followed by a good one) keeps
  // the stream instead of racing its close.
  if (!coordinator.empty()) coordinator_idle_since_.try_emplace(coordinator, absl::Now());
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

void GroupManager::OnTable(const std::string& coordinator, const peer::PeerTable& table) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(table.group);
  if (it == groups_.end() || it->second->coordinator != coordinator) return;
  Group& g = *it->second;
  if (g.coll == nullptr || table.epoch <= g.epoch) return;  // joins in flight apply it
  if (static_cast<int32_t>(table.rank_daemons.size()) != g.world_size) return;
  if (absl::Status s = ApplyTable(g, table); !s.ok()) {
    FS_LOG(WARNING) << "group=" << g.id << " could not re-form at epoch " << table.epoch << ": " << s;
    g.coll->Abort(s);
  }
}

void GroupManager::OnGroupFailed(const std::string& coordinator, const std::string& group,
                                 uint64_t epoch, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end() || it->second->coordinator != coordinator) return;
  Group& g = *it->second;
  if (g.coll == nullptr || g.epoch != epoch) return;
  FS_LOG(WARNING) << "group=" << g.id << " epoch=" << epoch << " failed elsewhere: " << status;
  g.reported_epoch = epoch;  // the coordinator knows
  g.coll->Abort(status);
}

void GroupManager::OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, g] : groups_) {
    if (g->coordinator != coordinator || g->coll == nullptr) continue;
    FS_LOG(WARNING) << "group=" << id << " lost its coordinator " << coordinator << ": " << status;
    g->reported_epoch = g->epoch;
    g->coll->Abort(absl::UnavailableError(
        absl::StrCat("group ", id, ": coordinator ", coordinator, " lost: ", status.message())));
  }
}

absl::Status GroupManager::CheckCaller(const Caller& caller) const {
  absl::ReaderMutexLock lock(&mu_);
  return CheckCallerLocked(caller);
}

absl::Status GroupManager::CheckCallerLocked(const Caller& caller) const {
  auto it = groups_.find(caller.group);
  if (it == groups_.end()) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  const Group& g = *it->second;
  FS_RETURN_IF_ERROR(CheckUid(g, caller.uid));
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

void CopyText(absl::string_view text, char* out, size_t size) {
  std::memset(out, 0, size);
  std::memcpy(out, text.data(), std::min(text.size(), size - 1));
}
std::string TextOf(const char* text, size_t size) { return std::string(text, strnlen(text, size)); }

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
      if (auto reg = g.registered.find(module); reg != g.registered.end()) {
        Registered& r = reg->second;
        if (r.attached_session[caller.rank] != caller.session && plan.ok() &&
            plan->fingerprint == r.plan.fingerprint && !r.shards_by_rank[caller.rank].empty()) {
          // A restarted trainer re-attaches: same model, new session; no collective.
          r.attached_session[caller.rank] = caller.session;
          FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " re-attached to module "
                       << Display(module);
          RegisterResult result{r.plan, r.shards_by_rank[caller.rank], std::nullopt};
          lock.Release();
          done(std::move(result));
          return;
        }
        error = absl::AlreadyExistsError(absl::StrCat(
            "group ", g.id, ": module ", Display(module), " is already registered",
            plan.ok() && plan->fingerprint != r.plan.fingerprint ? " (with a different model)"
                                                                 : " by this session"));
      }
      for (const auto& [other, r] : g.registered) {
        if (error.ok() && Nested(other, module)) {
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
          caller.uid);
      if (!shard.ok()) {
        alloc = shard.status();
        break;
      }
      x->shards.push_back(UnitShard{u.index, *std::move(shard), nullptr});
      std::shared_ptr<Buffer> view;
      if (init_views) {
        absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
            BufferKind::kUnsharded, u.padded_numel * ItemSize(u.dtype),
            absl::StrCat("group=", caller.group, " unit=", u.index, " rank=", caller.rank,
                         " init"),
            caller.uid);
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
  SubmitAll(coll, rank, std::move(ops), x->deadline, [this, x](absl::Status s) mutable {
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
          FS_LOG(INFO) << "group=" << g.id << " module=" << Display(x->module) << " registered: "
                       << reg.plan.units.size() << " units, fingerprint "
                       << reg.plan.fingerprint.substr(0, 16);
        }
        reg.shards_by_rank[caller.rank] = x->shards;
        reg.attached_session[caller.rank] = caller.session;
        RegisterResult r{reg.plan, x->shards, std::nullopt};
        if (x->init != InitMode::kZeros) {
          // Initial values come through a summon that is already open: each rank (or rank 0)
          // fills its full buffers and ends it with writeback. The shards are zeros, so there
          // is nothing to all-gather first.
          const bool rank0_only = x->init == InitMode::kFromRank0;
          std::shared_ptr<SummonSlot>& slot = reg.slots[1];
          if (!slot) slot = std::make_shared<SummonSlot>();
          OpenSummon open;
          open.id = g.next_summon++;
          open.rank = caller.rank;
          open.k = 1;
          open.module = x->module;
          open.options = SummonOptions{true, true, rank0_only, false, false};
          open.slot = slot;
          open.ready = true;
          for (const PlanUnit& u : reg.plan.units) {
            open.units.push_back(u.index);
            open.views.push_back(SummonedUnit{u.index, x->init_buffers[u.index], nullptr});
            if (rank0_only && caller.rank == 0) slot->rank0_params[u.index] = x->init_buffers[u.index];
            reg.summoned[caller.rank][u.index] = true;
          }
          reg.summon_count[caller.rank] = 1;
          SummonResult init{open.id, open.units, {}, ""};
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
  x->init_buffers.clear();
  x->done(std::move(result));
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
  std::vector<absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    FS_RETURN_IF_ERROR(CheckCallerLocked(caller));
    Group& g = *groups_.at(caller.group);
    DropSummons(g, caller.rank);
    EndRank(g, caller.rank, &run);
    FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " left";
    MaybeRemoveGroup(caller.group);
  }
  for (auto& f : run) f();
  return absl::OkStatus();
}

void GroupManager::EndSession(const std::string& group, uint64_t session) {
  std::vector<absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(group);
    if (it == groups_.end()) return;
    Group& g = *it->second;
    for (int32_t r = 0; r < g.world_size; ++r) {
      if (g.session_of_rank[r] != session) continue;
      // Its summons end without writeback; collectives waiting for it fail now rather than
      // at their deadline (the communicator re-forms once every rank joined again).
      DropSummons(g, r);
      if (g.coll && !g.coll->PendingOps().empty()) {
        g.coll->Abort(absl::UnavailableError(absl::StrCat(
            "group ", g.id, ": rank ", r, "'s session ended (client gone) during a collective")));
      }
      EndRank(g, r, &run);
      FS_LOG(INFO) << "group=" << g.id << " rank=" << r << " lease ended (session=" << session
                   << ")";
    }
    MaybeRemoveGroup(group);
  }
  for (auto& f : run) f();
}

void GroupManager::EndRank(Group& g, int32_t rank, std::vector<absl::AnyInvocable<void()>>* run) {
  g.session_of_rank[rank] = 0;
  if (g.multi()) {
    run->push_back([this, coordinator = g.coordinator, group = g.id, token = g.token, rank] {
      peer_->Depart(coordinator, group, token, rank);
    });
  }
}

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

std::vector<GroupManager::GroupCollectives> GroupManager::ListCollectives(
    const std::string& group) const {
  std::vector<std::pair<GroupCollectives, std::shared_ptr<collective::CollectiveGroup>>> found;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, g] : groups_) {
      if (!group.empty() && id != group) continue;
      GroupCollectives info;
      info.group = id;
      info.world_size = g->world_size;
      info.epoch = g->epoch;
      info.local_ranks = g->local_ranks;
      found.emplace_back(std::move(info), g->coll);
    }
  }
  // Asked outside the manager's lock: the backend takes its own.
  std::vector<GroupCollectives> out;
  for (auto& [info, coll] : found) {
    if (coll) {
      info.status = coll->status();
      info.pending = coll->PendingOps();
    }
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<GroupManager::GroupInfo> GroupManager::ListGroups() const {
  std::vector<std::pair<GroupInfo, std::shared_ptr<collective::CollectiveGroup>>> found;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, g] : groups_) {
      GroupInfo info;
      info.group = id;
      info.world_size = g->world_size;
      info.epoch = g->epoch;
      info.coordinator = g->coordinator;
      info.local_ranks = g->local_ranks;
      for (int32_t r : g->local_ranks) {
        if (r < static_cast<int32_t>(g->session_of_rank.size()) && g->session_of_rank[r] != 0) {
          info.joined_ranks.push_back(r);
        }
      }
      for (const auto& [module, reg] : g->registered) info.registered_modules.push_back(module);
      found.emplace_back(std::move(info), g->coll);
    }
  }
  std::vector<GroupInfo> out;
  for (auto& [info, coll] : found) {
    if (coll) info.status = coll->status();  // outside the manager's lock, as ListCollectives
    out.push_back(std::move(info));
  }
  return out;
}

void GroupManager::StartDrain() {
  absl::MutexLock lock(&mu_);
  if (!draining_) FS_LOG(INFO) << "draining: new groups and joins are refused from now on";
  draining_ = true;
}

GroupManager::Stats GroupManager::GetStats() const {
  Stats stats;
  std::vector<std::shared_ptr<collective::CollectiveGroup>> colls;
  {
    absl::ReaderMutexLock lock(&mu_);
    stats.draining = draining_;
    stats.shutting_down = shutdown_;
    stats.groups = static_cast<int32_t>(groups_.size());
    for (const auto& [id, g] : groups_) {
      for (uint64_t s : g->session_of_rank) stats.sessions += s != 0;
      stats.open_summons += static_cast<int32_t>(g->open_summons.size());
      stats.pending_joins += static_cast<int32_t>(g->pending_joins.size());
      if (g->coll) colls.push_back(g->coll);
    }
  }
  for (const auto& coll : colls) {
    stats.pending_collectives += static_cast<int32_t>(coll->PendingOps().size());
  }
  return stats;
}

absl::StatusOr<std::vector<GroupManager::ModuleUnits>> GroupManager::ListUnits(
    const std::string& group, const std::optional<std::string>& module) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("this daemon hosts no group ", group));
  }
  const Group& g = *it->second;
  if (module && !g.registered.contains(*module)) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(*module), " is not registered"));
  }
  std::vector<ModuleUnits> out;
  for (const auto& [path, reg] : g.registered) {
    if (module && path != *module) continue;
    ModuleUnits m;
    m.module = path;
    for (const PlanUnit& pu : reg.plan.units) {
      const int32_t u = pu.index;
      UnitInfo info;
      info.unit = u;
      info.module = pu.module;
      if (u < static_cast<int32_t>(reg.last_op.size())) info.last_op = reg.last_op[u];
      for (int32_t r : g.local_ranks) {
        UnitRankInfo ri;
        ri.rank = r;
        if (r < static_cast<int32_t>(reg.summoned.size()) &&
            u < static_cast<int32_t>(reg.summoned[r].size())) {
          ri.summoned = reg.summoned[r][u];
        }
        if (r < static_cast<int32_t>(reg.shards_by_rank.size()) &&
            u < static_cast<int32_t>(reg.shards_by_rank[r].size())) {
          const UnitShard& shard = reg.shards_by_rank[r][u];
          if (shard.shard) ri.shard_bytes = shard.shard->bytes();
          if (shard.grad) ri.grad_bytes = shard.grad->bytes();
        }
        for (const auto& [id, open] : g.open_summons) {
          if (open.rank != r || open.module != path) continue;
          for (size_t i = 0; i < open.units.size() && i < open.views.size(); ++i) {
            if (open.units[i] != u) continue;
            if (open.views[i].params) ri.unsharded_bytes += open.views[i].params->bytes();
            if (open.views[i].grads) ri.unsharded_bytes += open.views[i].grads->bytes();
          }
        }
        info.ranks.push_back(ri);
      }
      m.units.push_back(std::move(info));
    }
    out.push_back(std::move(m));
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
      std::vector<std::string> ids;
      for (const auto& [id, g] : groups_) ids.push_back(id);
      for (const std::string& id : ids) {
        Group& g = *groups_.at(id);
        std::vector<int32_t> missing = g.MissingRanks();
        for (auto j = g.pending_joins.begin(); j != g.pending_joins.end();) {
          // A multi-daemon join ends with the coordinator's answer (which names the missing
          // ranks); this is only the backstop for a coordinator that never answers.
          const absl::Time expiry = g.multi() ? j->deadline + absl::Seconds(2) : j->deadline;
          if (expiry > now) {
            ++j;
            continue;
          }
          absl::Status s = absl::DeadlineExceededError(
              g.multi() ? absl::StrCat("group ", g.id, ": the coordinator ", g.coordinator,
                                       " did not answer rank ", j->rank, "'s rendezvous")
                        : absl::StrCat("group ", g.id, ": ranks ", absl::StrJoin(missing, ", "),
                                       " of ", g.world_size, " did not join before the deadline"));
          g.session_of_rank[j->rank] = 0;  // a failed join leaves no trace
          run.push_back([done = std::move(j->done), s]() mutable { done(s); });
          j = g.pending_joins.erase(j);
        }
        // A multi-daemon group that failed here tells its coordinator, which tells the other
        // daemons (they fail at once instead of at their deadlines) and re-forms the group at
        // the next complete rendezvous.
        if (g.multi() && g.coll && !g.coll->status().ok() && g.reported_epoch != g.epoch) {
          g.reported_epoch = g.epoch;
          run.push_back([this, coordinator = g.coordinator, group = g.id, token = g.token,
                         epoch = g.epoch, status = g.coll->status()] {
            peer_->ReportFailure(coordinator, group, token, epoch, status);
          });
        }
        MaybeRemoveGroup(id);
      }
      for (auto c = coordinator_idle_since_.begin(); c != coordinator_idle_since_.end();) {
        const std::string& coordinator = c->first;
        const bool used = std::any_of(groups_.begin(), groups_.end(), [&](const auto& g) {
          return g.second->coordinator == coordinator;
        });
        if (used) {
          c = coordinator_idle_since_.erase(c);
        } else if (now - c->second >= kUnwatchAfter) {
          run.push_back([this, coordinator] { peer_->Unwatch(coordinator); });
          c = coordinator_idle_since_.erase(c);
        } else {
          ++c;
        }
      }
    }
    for (auto& f : run) f();
  }
}

}  // namespace flatshard::server
