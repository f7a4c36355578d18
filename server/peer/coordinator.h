#pragma once
// Coordinator: the state of the groups this daemon coordinates (DESIGN.md "Lifecycles",
// "Collective order and failure"), without gRPC. PeerServiceImpl adapts it to PeerService;
// tests drive it directly with a fake clock.
//
// Per group it keeps world_size, the token (set by the first arrival), the daemon of every
// rank, the epoch, a "dirty" flag (the next complete table gets a new epoch) and the pending
// rendezvous calls with their deadlines. Watching daemons (one Watch stream each) hear of new
// tables and failures through a WatchSink.
//
// Thread safety: thread-safe. Rendezvous callbacks and WatchSink methods run on the calling
// thread after the coordinator's lock is released, so they may call back into it. Events for
// one sink are delivered in the order the coordinator produced them, never concurrently.
// Nothing here has a thread of its own: the owner calls ExpireDeadlines() at or after
// NextDeadline().

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/peer/peer_client.h"

namespace flatshard::server::peer {

// The coordinator's end of one daemon's Watch stream. Methods must not block for long: they
// queue a message on the stream.
class WatchSink {
 public:
  virtual ~WatchSink() = default;
  // `table.group`, which the daemon hosts ranks of, was re-formed at a newer epoch.
  virtual void PushTable(const PeerTable& table) = 0;
  // `group` failed at `epoch` (reported by another daemon, or a daemon died).
  virtual void PushFailure(const std::string& group, uint64_t epoch,
                           const absl::Status& status) = 0;
  // The coordinator is done with this stream (the daemon was declared dead, a newer stream of
  // the same daemon replaced it, or the coordinator shuts down): end it with `status`. The
  // last call the sink gets.
  virtual void Close(const absl::Status& status) = 0;
};

// One rank's arrival (RendezvousRequest).
struct RendezvousArgs {
  std::string group;
  std::string token;
  int world_size = 0;
  int rank = -1;
  DaemonIdentity daemon;
  uint64_t failed_epoch = 0;     // the caller's copy of the group failed at this epoch (0: none)
  std::string device_uuid{};     // GPU daemons: the rank's GPU
  std::string nccl_unique_id{};  // rank 0's NCCL-capable daemon: fresh for this rendezvous
  // The modules the rank's daemon holds for the group (PeerTable::rank_modules).
  std::vector<std::string> registered_modules{};
};

struct CoordinatorOptions {
  // A watching daemon silent (no Heartbeat) for this long is declared dead.
  absl::Duration peer_timeout = absl::Seconds(3);
  // Time source; null: absl::Now. Tests pass a fake clock.
  std::function<absl::Time()> clock;
  // Epochs handed out are above this and never repeat (one counter for all groups), so a
  // group forgotten and formed again never reuses an epoch a daemon may still run. The
  // service passes its start time in microseconds, which also keeps a restarted
  // coordinator's epochs above its predecessor's.
  uint64_t epoch_base = 0;
};

struct GroupSnapshot {
  std::string group;
  int world_size = 0;
  uint64_t epoch = 0;                                  // 0: no complete table yet
  bool dirty = false;                                  // the next complete table gets epoch + 1
  std::vector<std::optional<DaemonIdentity>> members;  // index: rank
  std::vector<int> pending_ranks;                      // ranks with a rendezvous call waiting
};

struct CoordinatorSnapshot {
  std::vector<GroupSnapshot> groups;     // sorted by group name
  std::vector<DaemonIdentity> watching;  // sorted by daemon_id
};

class Coordinator {
 public:
  using WatcherId = uint64_t;
  using RendezvousCallback = absl::AnyInvocable<void(absl::StatusOr<PeerTable>)>;
  static constexpr absl::Duration kGaveUpGrace = absl::Seconds(1);

  explicit Coordinator(CoordinatorOptions options = {});
  // Shutdown() if not done yet.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Records rank `args.rank` as hosted by `args.daemon` and calls `done` exactly once: with
  // the table when every rank is present (at once if they already are), or with
  //   INVALID_ARGUMENT   empty group or daemon_id, world_size < 1, rank out of range, or a
  //                      world_size that differs from the group's;
  //   PERMISSION_DENIED  "group g: wrong token";
  //   DEADLINE_EXCEEDED  at `deadline`: "group g: ranks 1, 3 of 4 did not join before the
  //                      deadline" (the arrival is then forgotten; a rank whose own call
  //                      expired less than kGaveUpGrace ago is not named, so ranks waiting
  //                      with about the same deadline all name the same missing ranks);
  //   ABORTED            a newer call for the same rank superseded it, or the rank departed;
  //   UNAVAILABLE        the daemon was declared dead, or the coordinator shut down.
  // A rank held by a different daemon_id (a restarted daemon), or an arrival into an empty
  // slot from another daemon than the last table's, gives the next table a new epoch.
  void Rendezvous(const RendezvousArgs& args, absl::Time deadline, RendezvousCallback done);

  // Rank `rank` of `group` left `daemon_id`: its slot is cleared if that daemon holds it (the
  // epoch stays: a trainer restarted on the same daemon continues at the same epoch) and a
  // pending call of it fails with ABORTED. OK for an unknown group. PERMISSION_DENIED for a
  // wrong token, INVALID_ARGUMENT for a rank out of range.
  absl::Status Depart(const std::string& group, const std::string& token, int rank,
                      const std::string& daemon_id);

  // `daemon_id` saw `group` fail at `epoch` with `status`. At the current epoch the group is
  // marked dirty and the first report of the epoch is pushed to every other watching daemon
  // hosting ranks of it; a stale epoch is ignored. NOT_FOUND for an unknown group,
  // PERMISSION_DENIED for a wrong token, INVALID_ARGUMENT for an OK status.
  absl::Status ReportFailure(const std::string& token, const std::string& daemon_id,
                             const std::string& group, uint64_t epoch, const absl::Status& status);

  // A Watch stream of `daemon` opened. A stream of the same daemon_id that was open is
  // replaced (Close, not a death). The daemon gets the current table of every complete group
  // it hosts ranks of whose epoch it has not seen. Returns the stream's id.
  // INVALID_ARGUMENT for an empty daemon_id, UNAVAILABLE after Shutdown.
  absl::StatusOr<WatcherId> Watch(const DaemonIdentity& daemon, std::shared_ptr<WatchSink> sink);
  // A message arrived on stream `id`.
  void Heartbeat(WatcherId id);
  // A Ping of `daemon_id` arrived (PeerService.Ping, outside its stream): as Heartbeat for
  // its current stream. False when the daemon has no stream here (none yet, or declared dead).
  bool HeartbeatOf(const std::string& daemon_id);
  // Stream `id` ended (`why`: broken, closed). If it is still its daemon's current stream the
  // daemon is dead: its ranks are cleared in every group, those groups are marked dirty, the
  // other watching daemons of each get UNAVAILABLE "group g: daemon <node> (<address>)
  // hosting ranks 2, 3 is gone: <why>", and its pending calls fail with that status.
  // No-op for an unknown or replaced id.
  void Unwatch(WatcherId id, absl::string_view why);

  // Fails pending calls whose deadline passed and declares silent watchers dead.
  void ExpireDeadlines();
  // When ExpireDeadlines() next has work; InfiniteFuture when nothing is waiting.
  absl::Time NextDeadline() const;

  // Fails every pending call with UNAVAILABLE, closes every sink, and refuses new calls and
  // streams with UNAVAILABLE. Idempotent.
  void Shutdown();

  CoordinatorSnapshot Snapshot() const;

 private:
  // One pushed message, queued per stream so that its order survives lock release.
  struct Outgoing {
    enum class Kind { kTable, kFailure, kClose } kind = Kind::kTable;
    PeerTable table;      // kTable
    std::string group;    // kFailure
    uint64_t epoch = 0;   // kFailure
    absl::Status status;  // kFailure, kClose
  };
  struct Mailbox {
    std::shared_ptr<WatchSink> sink;
    std::deque<Outgoing> queue;
    bool delivering = false;
  };
  struct Watcher {
    WatcherId id = 0;
    DaemonIdentity daemon;
    absl::Time last_heard;
    std::shared_ptr<Mailbox> mailbox;
  };
  struct Pending {
    uint64_t id = 0;
    int rank = -1;
    std::string daemon_id;
    absl::Time deadline;
    RendezvousCallback done;
  };
  struct Group {
    std::string name;
    std::string token;
    int world_size = 0;
    // rank -> its daemon, only for ranks present: a world_size nobody joins costs nothing.
    absl::btree_map<int, DaemonIdentity> members;
    uint64_t epoch = 0;
    bool dirty = false;
    std::vector<DaemonIdentity> last_table;         // empty until the first table
    absl::flat_hash_map<int, std::string> devices;  // rank -> RendezvousArgs::device_uuid
    std::string nccl_unique_id;                     // rank 0's, from its latest rendezvous
    // rank -> RendezvousArgs::registered_modules of its latest rendezvous (sparse).
    absl::flat_hash_map<int, std::vector<std::string>> modules;
    PeerTable last_full;  // the last table handed out
    std::optional<uint64_t> failure_forwarded_epoch;
    absl::flat_hash_map<std::string, uint64_t> known_epoch;  // daemon_id -> epoch it has
    std::vector<Pending> pending;
    absl::flat_hash_map<int, absl::Time> gave_up;  // rank -> when its call expired
  };
  // Work produced under the lock, done after it is released.
  struct Effects {
    std::vector<absl::AnyInvocable<void()>> calls;
    std::vector<std::shared_ptr<Mailbox>> mailboxes;
    void Run(Coordinator* c);
  };

  absl::Time Now() const { return clock_(); }
  void Enqueue(Watcher& w, Outgoing out, Effects& fx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Flush(const std::shared_ptr<Mailbox>& m) ABSL_LOCKS_EXCLUDED(mu_);
  Watcher* FindWatcher(const std::string& daemon_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(Group& g, Effects& fx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(absl::Time now, Effects& fx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeclareDeadLocked(const Watcher& dead, absl::string_view why, Effects& fx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetIfEmptyLocked(const std::string& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration peer_timeout_;
  const std::function<absl::Time()> clock_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
  // The last epoch handed out by any group (see CompleteLocked).
  uint64_t last_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // The last epoch of each group forgotten with no members (ForgetIfEmptyLocked): its daemons
  // may still run that incarnation when the name forms again, so CompleteLocked avoids its UCX
  // tag hash too. An entry goes when its name forms again.
  std::map<std::string, uint64_t> forgotten_epochs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Watcher> watchers_ ABSL_GUARDED_BY(mu_);  // by daemon_id
  absl::flat_hash_map<WatcherId, std::string> watcher_daemon_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server::peer
