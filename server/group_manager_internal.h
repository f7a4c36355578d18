#pragma once
// Internals of GroupManager shared by its source files (group_manager.cc: groups, joins,
// peers; group_manager_register.cc: registration; group_manager_summon.cc: summons, kept
// buffers, gradients; group_manager_admin.cc: views for operators). Not for other users.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/limits.h"
#include "common/logging.h"
#include "server/group_manager.h"

namespace flatshard::server {
namespace internal {


// The session of each rank of a group (0: not joined), stored only for ranks that ever
// joined or were asked about: per-rank state must not scale with a world_size nobody joins
// (a JoinGroup with world_size 2^20 costs nothing per absent rank).
class RankSessions {
 public:
  // The rank's session, created as 0 (not joined) on first use.
  uint64_t& operator[](int32_t rank) { return by_rank_[rank]; }
  uint64_t operator[](int32_t rank) const {
    auto it = by_rank_.find(rank);
    return it == by_rank_.end() ? 0 : it->second;
  }
  // Ranks with a session, ascending.
  std::vector<int32_t> Joined() const {
    std::vector<int32_t> out;
    for (const auto& [rank, session] : by_rank_) {
      if (session != 0) out.push_back(rank);
    }
    return out;
  }
  int32_t joined_count() const {
    int32_t n = 0;
    for (const auto& [rank, session] : by_rank_) n += session != 0;
    return n;
  }
  // The rank whose session is `session`, or -1.
  int32_t RankOf(uint64_t session) const {
    for (const auto& [rank, s] : by_rank_) {
      if (s == session && session != 0) return rank;
    }
    return -1;
  }

 private:
  absl::btree_map<int32_t, uint64_t> by_rank_;
};

// The registered modules of a group as daemons report them at rendezvous: "path\x1fplan
// fingerprint" (peer_service.proto RendezvousRequest.registered_modules).
// `lost` (optional): the modules this daemon dropped as lost and still reports to its ranks.
// They are reported as held under the fingerprint "lost", which no plan has, so a daemon that
// restarted without them (it holds nothing) learns of the loss from the next table too, even
// when this daemon dropped them before its rank's rendezvous (a survivor re-joining after the
// re-form), and tells its own ranks.
//
// Restarts: each held module also carries its committed generation, "path\x1ffingerprint
// \x1fgeneration" (HeldKey), so that daemons whose ranks hold different generations of a module
// (one was killed between the daemons' copies of one commit) find out at the re-form: every
// daemon drops it as lost, naming which daemon held which generation (ReconcileModules). The
// generation a daemon reports is the highest its local ranks hold or are committing to (a
// commit whose copies are still under way completes whatever the trainers do).
template <typename R>
uint64_t HeldGeneration(const R& reg) {
  uint64_t g = 0;
  for (uint64_t x : reg.generation) g = std::max(g, x);
  if (reg.pending_commit.has_value()) g = std::max(g, reg.pending_commit->generation);
  return g;
}
// The generations of the ranks of `reg` held here (those with shards) when they differ and
// no commit's copies are under way: "rank 0: generation 2, rank 1: generation 1"; empty when
// they agree. Such a module is a mix (a commit reached some local ranks only) and is never
// handed out: it is dropped as lost at the next re-form (ReconcileModules, HeldKey).
template <typename R>
std::string MixedGenerations(const R& reg) {
  if (!reg.initialized) return "";
  std::vector<std::string> parts;
  bool mixed = false;
  uint64_t first = 0;
  bool any = false;
  for (size_t r = 0; r < reg.generation.size() && r < reg.shards_by_rank.size(); ++r) {
    if (reg.shards_by_rank[r].empty()) continue;
    // A rank whose shards hold a commit under way (ready) counts at that generation: its
    // copy completes whatever happens (a restart finishes it from the shards).
    uint64_t gen = reg.generation[r];
    bool committing = false;
    if (reg.pending_commit.has_value()) {
      const auto& ready = reg.pending_commit->ready_ranks;
      if (std::find(ready.begin(), ready.end(), static_cast<int32_t>(r)) != ready.end() &&
          reg.pending_commit->generation > gen) {
        gen = reg.pending_commit->generation;
        committing = true;
      }
    }
    if (any && gen != first) mixed = true;
    if (!any) first = gen;
    any = true;
    parts.push_back(absl::StrCat("rank ", r, ": generation ", gen, committing ? " (committing)" : ""));
  }
  return mixed ? absl::StrJoin(parts, ", ") : std::string();
}
// A module whose local ranks hold different generations is reported under the generation
// "mixed (rank 0: generation 2, ...)", which no other daemon holds, so every daemon of the
// group drops it as lost and names each rank's generation (ReconcileModules).
template <typename R>
std::string HeldKey(const std::string& module, const R& reg) {
  const std::string mixed = MixedGenerations(reg);
  if (!mixed.empty()) {
    return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1fmixed (", mixed, ")");
  }
  return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1f", HeldGeneration(reg));
}
template <typename M>
std::vector<std::string> HeldModules(const M& registered,
                                     const std::map<std::string, std::string>* lost = nullptr) {
  std::vector<std::string> out;
  for (const auto& [module, reg] : registered) out.push_back(HeldKey(module, reg));
  if (lost != nullptr) {
    for (const auto& [module, why] : *lost) {
      if (!registered.contains(module)) out.push_back(absl::StrCat(module, "\x1flost"));
    }
  }
  return out;
}

// "ranks 1, 2, 5" or "ranks 1, 2, ... (1048575 ranks)": at most `limit` of them named, so a
// message about a huge group stays small.
inline std::string RankListText(const std::vector<int32_t>& ranks, size_t limit = 16) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < limit; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > limit) absl::StrAppend(&out, ", ... (", ranks.size(), " ranks)");
  return out;
}

// Token comparison that takes the same time wherever the first difference is.
inline bool TokensEqual(const std::string& a, const std::string& b) {
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
inline absl::Status CheckUid(const G& g, int64_t uid) {
  if (uid == g.owner_uid) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "group ", g.id, ": uid ", uid < 0 ? std::string("(remote)") : absl::StrCat(uid),
      " is not admitted (the group belongs to uid ",
      g.owner_uid < 0 ? std::string("(remote)") : absl::StrCat(g.owner_uid), ")"));
}

inline std::string UnitSummary(const PlanUnit& u) {
  return absl::StrCat("\"", u.module, "\" (", u.module_type, ", ", u.params.size(), " params, ",
                      u.numel, " elements, ", DTypeName(u.dtype), ")");
}

// True when registering `b` would nest FSDP units inside those of `a` or the other way round.
inline bool Nested(const std::string& a, const std::string& b) {
  auto inside = [](const std::string& outer, const std::string& inner) {
    return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                             inner[outer.size()] == '.');
  };
  return inside(a, b) || inside(b, a);
}

// A module path as error texts quote it: at most kMaxQuotedBytes of it (README "Limits").
inline std::string Display(const std::string& module) {
  return module.empty() ? std::string("\"\" (the root)")
                        : absl::StrCat("\"", Truncated(module), "\"");
}



// Units of `plan` whose module is `path` (recurse=false) or in its subtree (recurse=true).
inline std::vector<int32_t> SelectUnits(const Plan& plan, const std::string& path, bool recurse) {
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

inline collective::ConstBuffer ConstOf(const Buffer& b, DType dtype) {
  return b.view(dtype).AsConst();
}
inline collective::MutableBuffer MutableOf(const Buffer* b, DType dtype) {
  if (b == nullptr) return collective::MutableBuffer{nullptr, 0, dtype};
  return b->view(dtype);
}

// A coordinator no group has used for this long gets its watch stream closed.
inline constexpr absl::Duration kUnwatchAfter = absl::Seconds(10);

// A kept buffer idle this long gives its pages back (KeptBufferPool::kIdleRelease).
inline constexpr absl::Duration kKeptIdleRelease = KeptBufferPool::kIdleRelease;

inline void CopyText(absl::string_view text, char* out, size_t size) {
  std::memset(out, 0, size);
  std::memcpy(out, text.data(), std::min(text.size(), size - 1));
}
inline std::string TextOf(const char* text, size_t size) {
  return std::string(text, strnlen(text, size));
}

// The "unit" of the agreement all-gathers (in the collective's fingerprint, so a rank that
// ends a summon while another commits fails with a mismatch instead of agreeing).
inline constexpr int64_t kEndAgreeUnit = -2;
inline constexpr int64_t kCommitAgreeUnit = -3;

// In the status of a failure caused by a rank's session ending ("rank 2's session ended
// ..."): daemons that learn of it from the coordinator let their running ops complete first.
inline constexpr char kSessionEndedMarker[] = "'s session ";

// How long a departure's failure waits for the ops the departed rank had joined to complete
// (FailDeferred). They normally take milliseconds; one that takes longer is stuck, and the
// group fails then rather than at the op's deadline.
inline constexpr absl::Duration kDeferFailureAtMost = absl::Seconds(2);

// Failed writeback Ends remembered per group for repeated Ends.
inline constexpr size_t kFailedEndsKept = 256;

// What each rank contributes to a writeback End's or a Commit's agreement (an all-gather):
// every rank reaches the same verdict from the same records, so all apply or none.
struct AgreeRecord {
  uint8_t ok;     // 1: this rank can apply
  uint8_t stale;  // 1: refused because the rank's views predate a rollback
  uint8_t reserved[6];
  uint64_t generation;  // the rank's committed generation
  char text[240];       // why not; NUL-padded, truncated
};
static_assert(sizeof(AgreeRecord) == 256);

inline constexpr char kAlreadyUnsharding[] =
    "Cannot manually unshard parameters when already unsharding parameters";


// One durable buffer of a rank (semantics.md §3a): the live buffer trainers write in place and
// its committed copy, which Commit (and an agreed writeback End) fills and a rollback copies
// back. shared_ptrs: a snapshot taken under mu_ keeps both alive while the copy runs without it.
struct DurablePair {
  int32_t unit = 0;
  std::string what;  // "shard", or "state exp_avg": for messages
  std::shared_ptr<Buffer> live;
  std::shared_ptr<Buffer> committed;
};

// Every durable (live, committed) buffer pair of `rank` in registration `reg`
// (GroupManager::Registered), unit by unit: the shard, then its optimizer state buffers in
// spec order (only where the rank registered state). Gradient shards are not durable (the next
// reduce-scatter overwrites them). The one list that commits, rollbacks and anything that
// persists a committed step (restart records, checkpoints) walk. Empty for a rank without
// shards. REQUIRES: the caller holds the manager's lock (it reads `reg`).
template <typename R>
std::vector<DurablePair> DurableBuffers(const R& reg, int32_t rank) {
  std::vector<DurablePair> out;
  if (rank < 0 || rank >= static_cast<int32_t>(reg.shards_by_rank.size())) return out;
  const auto& shards = reg.shards_by_rank[rank];
  const auto* committed =
      rank < static_cast<int32_t>(reg.committed.size()) ? &reg.committed[rank] : nullptr;
  const auto* committed_state = rank < static_cast<int32_t>(reg.committed_state.size())
                                    ? &reg.committed_state[rank]
                                    : nullptr;
  for (size_t u = 0; u < shards.size(); ++u) {
    if (committed != nullptr && u < committed->size()) {
      out.push_back(DurablePair{shards[u].unit, "shard", shards[u].shard, (*committed)[u]});
    }
    if (committed_state == nullptr || u >= committed_state->size()) continue;
    const auto& kept = (*committed_state)[u];
    for (size_t i = 0; i < shards[u].state.size() && i < kept.size(); ++i) {
      out.push_back(DurablePair{shards[u].unit,
                                absl::StrCat("state ", i < reg.state_specs.size()
                                                           ? reg.state_specs[i].name
                                                           : std::to_string(i)),
                                shards[u].state[i], kept[i]});
    }
  }
  return out;
}

}  // namespace internal

struct GroupManager::PendingJoin {
  int32_t rank = 0;
  uint64_t session = 0;
  absl::Time deadline;
  JoinCallback done;
  std::function<bool()> caller_gone;  // JoinArgs::caller_gone
  // Multi-daemon joins: the epoch of the peer table its rendezvous answered with, while the
  // communicator for it is being connected (StartConnect); 0: the rendezvous is under way.
  uint64_t ready_epoch = 0;
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
  // Read-only summons: local ranks whose all-gathers into the shared copy completed, the
  // first failure among them, and the answers held until every one did (Summon).
  int32_t assembled = 0;
  absl::Status assembly_error;
  std::vector<absl::AnyInvocable<void(absl::Status)>> waiting;
  // Read-only summons: node copies (unit, use) a local rank is getting without mu_, and the
  // other local ranks' summons waiting for them (run again, after mu_, once they are made or
  // the maker gave up), so that the node allocates each copy once.
  std::set<std::pair<int32_t, KeptUse>> making;
  std::vector<absl::AnyInvocable<void()>> on_made;
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
  // GPU ranks under rank0_only writeback: rank 0's broadcast copy on this rank's device,
  // by (unit, 0 params / 1 grads).
  std::map<std::pair<int32_t, int>, std::shared_ptr<Buffer>> own_rank0;
  // The group's communicator when the summon was opened: a writeback End after the group
  // re-formed cannot agree with the other ranks' summons (they are gone) and fails.
  std::shared_ptr<collective::CollectiveGroup> coll;
  bool ready = false;   // the unshard completed
  bool ending = false;  // EndSummon under way
};

// A local rank's arrival at a writeback End's copies (GroupManager::EndArrive).
struct GroupManager::EndArrival {
  int32_t rank = 0;
  bool applying = false;  // its agreement passed (else it only counts)
  absl::Status status;    // its writeback into its shards
  std::vector<internal::DurablePair> durable;  // what its copies commit
  absl::AnyInvocable<void(absl::Status)> finish;  // answers its End
};

struct GroupManager::Registered {
  Plan plan;
  Manifest manifest;
  std::vector<std::vector<UnitShard>> shards_by_rank;
  std::vector<std::vector<bool>> summoned;  // [rank][unit]
  std::vector<uint64_t> summon_count;       // per rank: k of its last summon
  std::map<uint64_t, std::shared_ptr<SummonSlot>> slots;
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<Buffer>> grad_staging;  // (rank, unit)
  // The last reduce-scatter of (rank, unit) failed with this status: a repeated finish (a
  // client's retry) answers it instead of "begin the reduce-scatter first".
  std::map<std::pair<int32_t, int32_t>, absl::Status> failed_finishes;
  // Gradient shards allocated by BeginReduceScatter for a unit that has none yet; installed
  // in shards_by_rank only when the reduce-scatter succeeds (a failed one changes nothing).
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<Buffer>> new_grads;  // (rank, unit)
  // Unsharded and staging buffers kept across summons, decommitted while unused, so a
  // trainer maps each segment once (steady state: no mmap per summon). Null until the first
  // summon or reduce-scatter (GroupManager::KeptOf). shared_ptr: a call that allocates
  // outside mu_ keeps it alive while the module may be dropped.
  std::shared_ptr<KeptBuffers> kept;
  // The session each rank registered or re-attached in; a rank whose session changed (a
  // restarted trainer) may register the same model again to re-attach.
  std::vector<uint64_t> attached_session;
  // Per unit: its last summon, end or reduce-scatter here (`flatshardctl units`).
  std::vector<UnitOp> last_op;

  // ---- Crash consistency (semantics.md §3a) ----
  // A model only once its initial values committed on every rank: kZeros at registration,
  // the FROM_* modes when the init summon's End agreed on every rank. Until then Summon,
  // GetShards and reduce-scatters are refused and registering again re-runs the init.
  bool initialized = false;
  std::string uninitialized_why;  // the init's failure, for the refusals
  // Per rank: the generation (committed step) its shards hold in `committed`. Commit and
  // every agreed writeback End add one; all ranks of a group move together.
  std::vector<uint64_t> generation;
  // Per rank and unit: the shard as of the last commit; rollbacks copy it back.
  std::vector<std::vector<std::shared_ptr<Buffer>>> committed;
  // Per rank: its shards were rolled back since it last read its views (Register,
  // GetShards); its next Commit or writeback End is refused (and rolls the group back), so
  // in-place writes made on top of a rollback are never committed.
  std::vector<bool> stale;
  // Shard copies (writebacks, commits, rollbacks) running outside the lock. A rollback waits
  // for them (`rollback_pending`), and none starts while one is pending, so a copy never
  // reads or writes a shard another copy is writing.
  int busy = 0;
  bool rollback_pending = false;

  // ---- Optimizer state (RegisterState) ----
  // The spec the first RegisterState fixed on this daemon (the order of UnitShard::state);
  // empty: none yet. Kept while any rank holds state buffers.
  std::vector<StateSpec> state_specs;
  // Per rank and unit: the committed copies of the rank's state buffers (the order of
  // state_specs; empty until the rank registered state). Commit copies the live buffers
  // (shards_by_rank[rank][unit].state) here; rollbacks copy them back (DurableBuffers).
  std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>> committed_state;
  // Ranks whose state buffers are being allocated (outside mu_) by RegisterState.
  std::set<int32_t> state_allocating;
  // ---- Restarts (group_manager_state.cc) ----
  // PlanToJson / ManifestToJson, dumped once for the group's record (empty: not yet).
  std::string plan_json;
  std::string manifest_json;
  // A commit every rank agreed to whose copies into the committed copies are under way here
  // (state::PendingCommit: which ranks' shards hold it, which ranks' copies are done).
  std::optional<state::PendingCommit> pending_commit;
  // The generation of the last "commit" intent known to be on disk: the other local ranks'
  // copies need not write it again (a "commit" intent covers every rank; see
  // group_manager_state.cc). 0: none.
  uint64_t durable_commit_intent = 0;
  // GPU daemons, per rank and unit: host copies of the device committed copies, made at
  // SIGTERM with --keep_shards (KeepDeviceShards) or adopted at start (then copied into
  // fresh device memory and dropped). Empty otherwise.
  std::vector<std::vector<std::shared_ptr<Buffer>>> host_committed;
  // Host daemons with a state directory: the local ranks' arrivals at the k-th writeback End
  // (EndArrive), by k; the copies into the committed copies start once every local rank is in.
  std::map<uint64_t, std::vector<EndArrival>> end_batches;
  // ---- Checkpoints (group_manager_checkpoint.cc) ----
  // Saves and loads holding the committed copies still. While > 0 no copy into them starts
  // (commits, writeback Ends and a refused commit's rollback queue in `after_ckpt` and run
  // again once the last hold ends); a hold starts only when `busy` is 0.
  int ckpt_hold = 0;
  std::vector<absl::AnyInvocable<void()>> after_ckpt;
  // ---- Restarts of optimizer state (group_manager_state.cc) ----
  // GPU daemons, per rank, unit and state (state_specs order): host copies of the device
  // committed state buffers (committed_state), made with host_committed. Empty otherwise.
  std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>> host_committed_state;

  void NoteOp(const std::vector<int32_t>& units, const char* op, int32_t rank, bool ok,
              absl::Time now) {
    last_op.resize(plan.units.size());
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
  internal::RankSessions session_of_rank;  // 0: not joined
  // Since when no rank has had a session nor a join under way (InfiniteFuture: in use); the
  // deadline loop reclaims the group after GroupManagerOptions::group_idle_timeout.
  absl::Time idle_since = absl::InfiniteFuture();
  std::vector<PendingJoin> pending_joins;
  // Ranks whose join completed and whose session has no lease yet: when it must have one.
  std::map<int32_t, absl::Time> lease_due;
  // Ranks whose current session has its lease open: rank -> that session.
  std::map<int32_t, uint64_t> leased;
  std::map<std::string, Registered> registered;
  // Modules dropped because some daemon of the group lost their shards (ReconcileModules):
  // module -> why, naming the ranks and daemons. Reported by Join and GetShards until the
  // module is registered again.
  std::map<std::string, std::string> lost;
  std::set<std::pair<std::string, int32_t>> registering;  // (module, rank) mid-registration
  std::map<uint64_t, OpenSummon> open_summons;
  uint64_t next_summon = 1;
  // Writeback summons whose End failed, by id: (rank, status). A repeated End (a client's
  // retry) gets the same cause instead of NOT_FOUND. Bounded (kFailedEndsKept).
  std::map<uint64_t, std::pair<int32_t, absl::Status>> failed_ends;
  std::shared_ptr<collective::CollectiveGroup> coll;
  // ApplyTable re-formed the communicator after a failure: its caller starts the rollback.
  bool rollback_due = false;
  // A communicator being connected outside mu_ (StartConnect): its ticket, 0 when none. Only
  // the connect whose ticket is still here when it finishes is installed (FinishConnect).
  uint64_t connecting = 0;
  uint64_t connecting_epoch = 0;  // multi-daemon: the epoch of `connecting_table`
  peer::PeerTable connecting_table;
  bool connect_from_table = false;  // an OnTable asked for it: a failure aborts `coll`
  // A rank's session ended while a collective it had already submitted (its End's or
  // Commit's agreement) was still running: the daemon completes that op on its behalf, so
  // every daemon reaches the same verdict, and the group fails with this status once no such
  // op is left (FailDeferred), at the latest when a rank joins again.
  absl::Status deferred_failure;
  absl::Time deferred_since = absl::InfiniteFuture();
  // Multi-daemon groups: the peer table the communicator runs (ApplyTable); checkpoints ask
  // the other daemons through it.
  peer::PeerTable table;

  bool multi() const { return !coordinator.empty(); }

  // O(world_size): only for error texts (see AllJoined).
  std::vector<int32_t> MissingRanks() const {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < world_size; ++r) {
      if (session_of_rank[r] == 0) missing.push_back(r);
    }
    return missing;
  }
  bool AllJoined() const { return session_of_rank.joined_count() == world_size; }
  // No rank joined or joining, nothing registered or in flight: removed at once.
  // A group that remembers lost modules stays until its ranks were told (it is reclaimed
  // after group_idle_timeout like any unused group): removing it would drop `lost`, and a rank
  // that joins again would find a fresh group that never heard of the loss.
  bool Idle() const {
    return registered.empty() && registering.empty() && pending_joins.empty() &&
           open_summons.empty() && lost.empty() && session_of_rank.joined_count() == 0;
  }
  // No rank joined or joining (registered modules may stay): reclaimable once idle long enough.
  bool Unused() const {
    return pending_joins.empty() && open_summons.empty() && registering.empty() &&
           session_of_rank.joined_count() == 0;
  }
};

namespace internal {

// Safety net against a silent mix: drops every registered module of `g` whose local ranks hold
// different committed generations (MixedGenerations) as lost, with an error naming each rank's
// generation, instead of rolling it back or handing it out. `when` says where it was found
// ("at the re-form at epoch 3"). Other daemons learn of it from the module's HeldKey ("mixed")
// or, once dropped, from the "lost" entry this daemon reports. Returns how many were dropped.
template <typename G>
int DropMixedModules(G& g, const std::string& when) {
  int dropped = 0;
  for (auto it = g.registered.begin(); it != g.registered.end();) {
    const std::string mixed = MixedGenerations(it->second);
    if (mixed.empty() || it->second.busy > 0) {
      ++it;
      continue;
    }
    std::string why = absl::StrCat(
        "group ", g.id, ": module ", Display(it->first),
        " lost: its ranks on this daemon hold different committed generations (", mixed,
        ") ", when, ": a commit reached some of them only (a daemon died inside it); no "
        "generation is held by every rank, so it was dropped on every daemon instead of "
        "handing out a mix: register it afresh on every rank (or restore it)");
    FS_LOG(WARNING) << why;
    g.lost[it->first] = std::move(why);
    it = g.registered.erase(it);  // its buffers go with it
    ++dropped;
  }
  return dropped;
}

}  // namespace internal

}  // namespace flatshard::server
