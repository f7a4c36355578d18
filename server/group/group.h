#pragma once
// One group (a training job) on this daemon, the membership owner's data: its identity, its
// ranks' sessions, joins and leases, its communicator and peer table, its registered modules
// (server/module/module.h) and open summons.
//
// Thread safety: each Group has its own lock, Group::mu, guarding everything but the identity
// fields (id, world_size, token, owner_uid, coordinator: set when the group is made, never
// changed). Two groups never share a lock, so they never wait on each other.

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc_types.h"
#include "server/module/module.h"
#include "server/peer/peer_client.h"

namespace flatshard::server {

struct JoinArgs {
  std::string group;
  int32_t world_size = 0;
  int32_t rank = 0;
  std::string token;
  std::string coordinator;  // peer address of the coordinator; empty: a local group
  int64_t uid = -1;         // as Caller::uid; the first joiner's uid owns a new group
  // True once the caller went away (its JoinGroup call was cancelled: the trainer died or gave
  // up); a pending join is then withdrawn, never completed for it. Called under the manager's
  // lock while the join is pending, never after its callback ran. Empty: never gone.
  std::function<bool()> caller_gone;
};

struct JoinResult {
  uint64_t session = 0;
  std::vector<std::string> registered_modules;  // re-attach targets
  // Multi-daemon groups re-formed after a daemon lost its shards (it restarted): one line per
  // module that was dropped on every daemon, naming the ranks and daemons whose shards are
  // gone. Such a module must be registered afresh.
  std::vector<std::string> lost_modules;
};

using JoinCallback = absl::AnyInvocable<void(absl::StatusOr<JoinResult>)>;

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

struct PendingJoin {
  int32_t rank = 0;
  uint64_t session = 0;
  absl::Time deadline;
  JoinCallback done;
  std::function<bool()> caller_gone;  // JoinArgs::caller_gone
  // Multi-daemon joins: the epoch of the peer table its rendezvous answered with, while the
  // communicator for it is being connected (StartConnect); 0: the rendezvous is under way.
  uint64_t ready_epoch = 0;
};

struct Group {
  // This group's lock: everything below but the identity fields (set when the group is made,
  // never changed) is guarded by it. Groups never share a lock (GroupManager, "Locking").
  mutable absl::Mutex mu;
  // Taken out of the table (MaybeRemoveGroup, DeleteGroup, idle reclaim): whoever locks it
  // after that treats it as gone.
  bool removed ABSL_GUARDED_BY(mu) = false;
  std::string id;
  int32_t world_size = 0;
  std::string token;
  int64_t owner_uid = -1;                  // the creator's uid (Caller::uid); only it is admitted
  std::string coordinator;                 // empty: a local group
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;  // of the peer table the communicator runs (multi-daemon)
  uint64_t reported_epoch ABSL_GUARDED_BY(mu) =
      0;  // the last epoch whose failure went to the coordinator
  std::vector<int32_t> local_ranks ABSL_GUARDED_BY(mu);  // the ranks this daemon hosts, ascending
  RankSessions session_of_rank ABSL_GUARDED_BY(mu);      // 0: not joined
  // Local ranks whose session ended and that have not joined since: rank -> how, "left"
  // (Leave) or "lost" (its lease closed or never opened: the trainer went away). Only for
  // `flatshardctl groups`, where an ordinary Leave must not look like a failure; bounded by the
  // ranks that ever joined here.
  std::map<int32_t, std::string> departed ABSL_GUARDED_BY(mu);
  // Since when no rank has had a session nor a join under way (InfiniteFuture: in use); the
  // deadline loop reclaims the group after GroupManagerOptions::group_idle_timeout.
  absl::Time idle_since ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  std::vector<PendingJoin> pending_joins ABSL_GUARDED_BY(mu);
  // Ranks whose join completed and whose session has no lease yet: when it must have one.
  std::map<int32_t, absl::Time> lease_due ABSL_GUARDED_BY(mu);
  // Ranks whose current session has its lease open: rank -> that session.
  std::map<int32_t, uint64_t> leased ABSL_GUARDED_BY(mu);
  std::map<std::string, Registered> registered ABSL_GUARDED_BY(mu);
  // Modules dropped because some daemon of the group lost their shards (ReconcileModules):
  // module -> why, naming the ranks and daemons. Reported by Join and GetShards until the
  // module is registered again.
  std::map<std::string, std::string> lost ABSL_GUARDED_BY(mu);
  std::set<std::pair<std::string, int32_t>> registering
      ABSL_GUARDED_BY(mu);  // (module, rank) mid-registration
  std::map<uint64_t, OpenSummon> open_summons ABSL_GUARDED_BY(mu);
  uint64_t next_summon ABSL_GUARDED_BY(mu) = 1;
  // Writeback summons whose End failed, by id: (rank, status). A repeated End (a client's
  // retry) gets the same cause instead of NOT_FOUND. Bounded (kFailedEndsKept).
  std::map<uint64_t, std::pair<int32_t, absl::Status>> failed_ends ABSL_GUARDED_BY(mu);
  std::shared_ptr<collective::CollectiveGroup> coll ABSL_GUARDED_BY(mu);
  // ApplyTable re-formed the communicator after a failure: its caller starts the rollback.
  bool rollback_due ABSL_GUARDED_BY(mu) = false;
  // A communicator being connected outside mu_ (StartConnect): its ticket, 0 when none. Only
  // the connect whose ticket is still here when it finishes is installed (FinishConnect).
  uint64_t connecting ABSL_GUARDED_BY(mu) = 0;
  uint64_t connecting_epoch ABSL_GUARDED_BY(mu) =
      0;  // multi-daemon: the epoch of `connecting_table`
  peer::PeerTable connecting_table ABSL_GUARDED_BY(mu);
  bool connect_from_table ABSL_GUARDED_BY(mu) =
      false;  // an OnTable asked for it: a failure aborts `coll`
  // A rank's session ended while a collective it had already submitted (its End's or
  // Commit's agreement) was still running: the daemon completes that op on its behalf, so
  // every daemon reaches the same verdict, and the group fails with this status once no such
  // op is left (FailDeferred), at the latest when a rank joins again.
  absl::Status deferred_failure ABSL_GUARDED_BY(mu);
  absl::Time deferred_since ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  // Multi-daemon groups: the peer table the communicator runs (ApplyTable); checkpoints ask
  // the other daemons through it.
  peer::PeerTable table ABSL_GUARDED_BY(mu);

  bool multi() const { return !coordinator.empty(); }

  // O(world_size): only for error texts (see AllJoined).
  std::vector<int32_t> MissingRanks() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < world_size; ++r) {
      if (session_of_rank[r] == 0) missing.push_back(r);
    }
    return missing;
  }
  bool AllJoined() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return session_of_rank.joined_count() == world_size;
  }
  // No rank joined or joining, nothing registered or in flight: removed at once.
  // A group that remembers lost modules stays until its ranks were told (it is reclaimed
  // after group_idle_timeout like any unused group): removing it would drop `lost`, and a rank
  // that joins again would find a fresh group that never heard of the loss.
  bool Idle() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return registered.empty() && registering.empty() && pending_joins.empty() &&
           open_summons.empty() && lost.empty() && session_of_rank.joined_count() == 0;
  }
  // No rank joined or joining (registered modules may stay): reclaimable once idle long enough.
  bool Unused() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return pending_joins.empty() && open_summons.empty() && registering.empty() &&
           session_of_rank.joined_count() == 0;
  }
};

// OK when `caller` names a joined rank of `g` with the right token and its current session
// (GroupManager::CheckCaller's errors; NOT_FOUND once `g` was removed).
absl::Status CheckCallerLocked(const Group& g, const Caller& caller)
    ABSL_SHARED_LOCKS_REQUIRED(g.mu);

namespace internal {
using ::flatshard::server::RankSessions;

// A coordinator no group has used for this long gets its watch stream closed.
inline constexpr absl::Duration kUnwatchAfter = absl::Seconds(10);

// In the status of a failure caused by a rank's session ending ("rank 2's session ended
// ..."): daemons that learn of it from the coordinator let their running ops complete first.
inline constexpr char kSessionEndedMarker[] = "'s session ";
// The cause of that failure when the rank called Leave ("rank 2's session left the group"):
// the group is not broken, it waits for the rank to join again (`flatshardctl groups` shows
// LEFT, not UNAVAILABLE).
inline constexpr char kLeftTheGroup[] = "left the group";

// How long a departure's failure waits for the ops the departed rank had joined to complete
// (FailDeferred). They normally take milliseconds; one that takes longer is stuck, and the
// group fails then rather than at the op's deadline.
inline constexpr absl::Duration kDeferFailureAtMost = absl::Seconds(2);

}  // namespace internal

}  // namespace flatshard::server
