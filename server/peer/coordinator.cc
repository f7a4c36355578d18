#include "server/peer/coordinator.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/planner.h"
#include "server/collective/ucx/ucx_tag.h"

namespace flatshard::server::peer {
namespace {

// Constant-time in the contents: a token guess learns nothing from how long it took to fail.
bool TokensEqual(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

// "rank 2" / "ranks 1, 3".
// "rank 2", "ranks 1, 3" or, for a huge group, "ranks 0, 1, ... (1048575 ranks)": a message
// never grows with the world size.
std::string RankList(const std::vector<int>& ranks) {
  constexpr size_t kListed = 16;
  if (ranks.size() <= kListed) {
    return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
  }
  return absl::StrCat("ranks ", absl::StrJoin(ranks.begin(), ranks.begin() + kListed, ", "),
                      ", ... (", ranks.size(), " ranks)");
}

absl::Status WrongToken(const std::string& group) {
  return absl::PermissionDeniedError(absl::StrCat("group ", group, ": wrong token"));
}

}  // namespace

void Coordinator::Effects::Run(Coordinator* c) {
  for (auto& call : calls) call();
  for (const auto& m : mailboxes) c->Flush(m);
}

Coordinator::Coordinator(CoordinatorOptions options)
    : peer_timeout_(options.peer_timeout),
      clock_(options.clock ? std::move(options.clock) : [] { return absl::Now(); }),
      last_epoch_(options.epoch_base) {}

Coordinator::~Coordinator() { Shutdown(); }

void Coordinator::Enqueue(Watcher& w, Outgoing out, Effects& fx) {
  w.mailbox->queue.push_back(std::move(out));
  fx.mailboxes.push_back(w.mailbox);
}

// One deliverer per mailbox at a time: whoever finds it idle drains it, the others leave
// their messages in the queue. Keeps a stream's messages in order without calling sinks
// under the lock.
void Coordinator::Flush(const std::shared_ptr<Mailbox>& m) {
  while (true) {
    std::deque<Outgoing> batch;
    {
      absl::MutexLock lock(&mu_);
      if (m->delivering || m->queue.empty()) return;
      m->delivering = true;
      batch.swap(m->queue);
    }
    for (const Outgoing& out : batch) {
      switch (out.kind) {
        case Outgoing::Kind::kTable:
          m->sink->PushTable(out.table);
          break;
        case Outgoing::Kind::kFailure:
          m->sink->PushFailure(out.group, out.epoch, out.status);
          break;
        case Outgoing::Kind::kClose:
          m->sink->Close(out.status);
          break;
      }
    }
    absl::MutexLock lock(&mu_);
    m->delivering = false;
  }
}

Coordinator::Watcher* Coordinator::FindWatcher(const std::string& daemon_id) {
  auto it = watchers_.find(daemon_id);
  return it == watchers_.end() ? nullptr : &it->second;
}

namespace {
// Bounds on what one rendezvous may make the coordinator store and hand to every daemon.
constexpr size_t kMaxNameBytes = 1024;
constexpr size_t kMaxBackendAddressBytes = 64 << 10;  // UCX worker addresses are ~100s of bytes
constexpr size_t kMaxModules = 1024;                  // registered module paths of one group
constexpr size_t kMaxModuleBytes = 4096 + 128;        // one "path\x1ffingerprint\x1fgeneration"
}  // namespace

void Coordinator::Rendezvous(const RendezvousArgs& args, absl::Time deadline,
                             RendezvousCallback done) {
  absl::Status invalid;
  if (args.group.empty()) {
    invalid = absl::InvalidArgumentError("rendezvous: empty group name");
  } else if (args.world_size < 1 || args.world_size > kMaxWorldSize) {
    invalid = absl::InvalidArgumentError(absl::StrCat("group ", args.group, ": world_size ",
                                                      args.world_size, " is not in [1, ",
                                                      kMaxWorldSize, "]"));
  } else if (args.rank < 0 || args.rank >= args.world_size) {
    invalid = absl::InvalidArgumentError(absl::StrCat("group ", args.group, ": rank ", args.rank,
                                                      " out of range [0, ", args.world_size, ")"));
  } else if (args.daemon.backend_address.size() > kMaxBackendAddressBytes ||
             args.daemon.node.size() > kMaxNameBytes ||
             args.daemon.daemon_id.size() > kMaxNameBytes ||
             args.daemon.peer_address.size() > kMaxNameBytes || args.group.size() > kMaxNameBytes) {
    // Every daemon of the group gets these in its table (and hands the address to UCX).
    invalid = absl::InvalidArgumentError(
        absl::StrCat("group ", args.group.substr(0, 64), " rank ", args.rank,
                     ": oversized daemon identity (names over ", kMaxNameBytes,
                     " bytes or a backend address "
                     "over ",
                     kMaxBackendAddressBytes, " bytes)"));
  } else if (args.registered_modules.size() > kMaxModules ||
             std::any_of(args.registered_modules.begin(), args.registered_modules.end(),
                         [](const std::string& m) { return m.size() > kMaxModuleBytes; })) {
    invalid = absl::InvalidArgumentError(
        absl::StrCat("group ", args.group.substr(0, 64), " rank ", args.rank, ": over ",
                     kMaxModules, " registered modules or one over ", kMaxModuleBytes, " bytes"));
  } else if (args.daemon.daemon_id.empty()) {
    invalid = absl::InvalidArgumentError(
        absl::StrCat("group ", args.group, " rank ", args.rank, ": empty daemon_id"));
  }
  if (!invalid.ok()) {
    done(invalid);
    return;
  }

  Effects fx;
  {
    absl::MutexLock lock(&mu_);
    absl::Status refused;
    auto it = groups_.find(args.group);
    if (shut_down_) {
      refused = absl::UnavailableError("coordinator shutting down");
    } else if (it == groups_.end()) {
      Group g;
      g.name = args.group;
      g.token = args.token;
      g.world_size = args.world_size;
      it = groups_.emplace(args.group, std::move(g)).first;
    } else if (!TokensEqual(it->second.token, args.token)) {
      refused = WrongToken(args.group);
    } else if (it->second.world_size != args.world_size) {
      // Worded as GroupManager words it, so a trainer sees one message on one daemon or many.
      refused = absl::InvalidArgumentError(
          absl::StrCat("group ", args.group, " has world_size ", it->second.world_size, ", rank ",
                       args.rank, " joined with world_size ", args.world_size));
    }
    if (!refused.ok()) {
      fx.calls.push_back([done = std::move(done), refused]() mutable { done(refused); });
    } else {
      Group& g = it->second;
      // A rank has at most one pending call: a retry (or a restarted daemon) supersedes it.
      for (auto p = g.pending.begin(); p != g.pending.end();) {
        if (p->rank != args.rank) {
          ++p;
          continue;
        }
        absl::Status s = absl::AbortedError(
            absl::StrCat("group ", g.name, " rank ", args.rank,
                         ": superseded by a newer rendezvous from daemon ", args.daemon.node));
        fx.calls.push_back([done = std::move(p->done), s]() mutable { done(s); });
        p = g.pending.erase(p);
      }
      if (args.failed_epoch != 0 && args.failed_epoch == g.epoch) g.dirty = true;
      auto slot = g.members.find(args.rank);
      if (slot != g.members.end() && slot->second.daemon_id != args.daemon.daemon_id) {
        FS_LOG(INFO) << "group=" << g.name << " rank=" << args.rank << " moved from daemon "
                     << slot->second.daemon_id << " to " << args.daemon.daemon_id;
        g.dirty = true;
      } else if (slot == g.members.end() && !g.last_table.empty() &&
                 g.last_table[args.rank].daemon_id != args.daemon.daemon_id) {
        g.dirty = true;
      }
      g.members[args.rank] = args.daemon;
      g.devices[args.rank] = args.device_uuid;
      if (args.rank == 0) g.nccl_unique_id = args.nccl_unique_id;
      g.modules[args.rank] = args.registered_modules;
      g.gave_up.erase(args.rank);
      g.pending.push_back(
          Pending{next_id_++, args.rank, args.daemon.daemon_id, deadline, std::move(done)});
      const bool complete = static_cast<int>(g.members.size()) == g.world_size;
      if (complete) {
        CompleteLocked(g, fx);
      } else {
        ExpireLocked(Now(), fx);  // the deadline may have passed already
      }
    }
  }
  fx.Run(this);
}

void Coordinator::CompleteLocked(Group& g, Effects& fx) {
  if (g.dirty || g.epoch == 0) {
    // One counter for every group (CoordinatorOptions::epoch_base). A daemon may still run the
    // group's previous incarnation while the new one connects, and UCX tags carry only a 16-bit
    // hash of (group, epoch) (ucx_tag.h): skip epochs whose hash equals the previous one's, so
    // a re-form never fails on that collision ("collides with live group").
    uint64_t previous = g.epoch;
    if (auto forgotten = forgotten_epochs_.find(g.name); forgotten != forgotten_epochs_.end()) {
      if (previous == 0) previous = forgotten->second;
      forgotten_epochs_.erase(forgotten);
    }
    g.epoch = ++last_epoch_;
    while (previous != 0 && collective::ucx::GroupTagHash(g.name, g.epoch) ==
                                collective::ucx::GroupTagHash(g.name, previous)) {
      g.epoch = ++last_epoch_;
    }
    g.dirty = false;
    g.failure_forwarded_epoch.reset();
  }
  PeerTable table;
  table.group = g.name;
  table.epoch = g.epoch;
  // Complete: every rank has a member.
  table.rank_daemons.reserve(g.members.size());
  for (const auto& [r, m] : g.members) table.rank_daemons.push_back(m);
  g.last_table = table.rank_daemons;
  table.rank_devices.resize(g.world_size);
  for (const auto& [r, uuid] : g.devices) {
    if (r >= 0 && r < g.world_size) table.rank_devices[r] = uuid;
  }
  // Device memory moves over NCCL only when it can: every rank on a GPU of its own (NCCL
  // cannot put two ranks on one GPU, e.g. two daemons sharing it), every daemon able to run
  // NCCL, and an id rank 0 made for this very round (an id serves one communicator).
  const bool any_gpu = std::any_of(table.rank_devices.begin(), table.rank_devices.end(),
                                   [](const std::string& d) { return !d.empty(); });
  if (any_gpu) {
    std::set<std::string> distinct;
    bool nccl =
        !g.nccl_unique_id.empty() && std::any_of(g.pending.begin(), g.pending.end(),
                                                 [](const Pending& p) { return p.rank == 0; });
    for (int r = 0; r < g.world_size && nccl; ++r) {
      nccl = !table.rank_devices[r].empty() && table.rank_daemons[r].nccl &&
             distinct.insert(table.rank_devices[r]).second;
    }
    table.device_transport = nccl ? "nccl" : "host";
    if (nccl) table.nccl_unique_id = g.nccl_unique_id;
    g.nccl_unique_id.clear();  // used once
  }
  // Only this round's reports: a rank that did not rendezvous again may hold more by now.
  bool any_modules = false;
  for (const Pending& p : g.pending) any_modules = any_modules || g.modules.contains(p.rank);
  if (any_modules) {
    table.rank_modules.resize(g.world_size);
    for (const Pending& p : g.pending) {
      auto m = g.modules.find(p.rank);
      if (m != g.modules.end()) table.rank_modules[p.rank] = m->second;
    }
  }
  g.modules.clear();
  g.last_full = table;
  g.gave_up.clear();
  FS_LOG(INFO) << "group=" << g.name << " epoch=" << g.epoch << ": peer table complete ("
               << g.world_size << " ranks)";

  std::set<std::string> answered;
  for (Pending& p : g.pending) {
    answered.insert(p.daemon_id);
    fx.calls.push_back([done = std::move(p.done), table]() mutable { done(table); });
  }
  g.pending.clear();

  absl::flat_hash_map<std::string, uint64_t> known;
  for (const DaemonIdentity& d : table.rank_daemons) {
    if (known.contains(d.daemon_id)) continue;
    auto old = g.known_epoch.find(d.daemon_id);
    const uint64_t had = old == g.known_epoch.end() ? 0 : old->second;
    known[d.daemon_id] = had;
    if (answered.contains(d.daemon_id)) {
      known[d.daemon_id] = g.epoch;
      continue;
    }
    Watcher* w = FindWatcher(d.daemon_id);
    if (w != nullptr && had < g.epoch) {
      Outgoing out;
      out.kind = Outgoing::Kind::kTable;
      out.table = table;
      Enqueue(*w, std::move(out), fx);
      known[d.daemon_id] = g.epoch;
    }
  }
  g.known_epoch = std::move(known);  // drops daemons no longer in the group
}

void Coordinator::ExpireLocked(absl::Time now, Effects& fx) {
  std::vector<std::string> touched;
  for (auto& [name, g] : groups_) {
    const bool any = std::any_of(g.pending.begin(), g.pending.end(),
                                 [now](const Pending& p) { return p.deadline <= now; });
    if (!any) continue;
    std::vector<int> missing;
    for (int r = 0; r < g.world_size; ++r) {
      if (g.members.contains(r)) continue;
      auto gave_up = g.gave_up.find(r);
      if (gave_up != g.gave_up.end() && now - gave_up->second <= kGaveUpGrace) continue;
      missing.push_back(r);
    }
    const absl::Status s = absl::DeadlineExceededError(
        absl::StrCat("group ", name, ": ", RankList(missing), " of ", g.world_size,
                     " did not join before the deadline"));
    FS_LOG(INFO) << s.message();
    for (auto p = g.pending.begin(); p != g.pending.end();) {
      if (p->deadline > now) {
        ++p;
        continue;
      }
      // A failed join leaves no trace.
      auto slot = g.members.find(p->rank);
      if (slot != g.members.end() && slot->second.daemon_id == p->daemon_id) g.members.erase(slot);
      g.gave_up[p->rank] = now;
      fx.calls.push_back([done = std::move(p->done), s]() mutable { done(s); });
      p = g.pending.erase(p);
    }
    touched.push_back(name);
  }
  for (const std::string& name : touched) ForgetIfEmptyLocked(name);
}

void Coordinator::ForgetIfEmptyLocked(const std::string& group) {
  auto it = groups_.find(group);
  if (it == groups_.end() || !it->second.pending.empty()) return;
  if (!it->second.members.empty()) return;
  FS_LOG(INFO) << "group=" << group << ": no members left, forgotten";
  if (it->second.epoch != 0) forgotten_epochs_[group] = it->second.epoch;
  groups_.erase(it);
}

absl::Status Coordinator::Depart(const std::string& group, const std::string& token, int rank,
                                 const std::string& daemon_id) {
  Effects fx;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(group);
    if (it == groups_.end()) return absl::OkStatus();  // forgotten already: nothing to clear
    Group& g = it->second;
    if (!TokensEqual(g.token, token)) return WrongToken(group);
    if (rank < 0 || rank >= g.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", group, ": rank ", rank, " out of range [0, ", g.world_size, ")"));
    }
    auto slot = g.members.find(rank);
    // A stale Depart of a replaced daemon must not clear its successor.
    if (slot != g.members.end() && slot->second.daemon_id == daemon_id) {
      g.members.erase(slot);
      FS_LOG(INFO) << "group=" << group << " rank=" << rank << " departed daemon " << daemon_id;
    }
    for (auto p = g.pending.begin(); p != g.pending.end();) {
      if (p->rank != rank || p->daemon_id != daemon_id) {
        ++p;
        continue;
      }
      absl::Status s =
          absl::AbortedError(absl::StrCat("group ", group, " rank ", rank, ": departed"));
      fx.calls.push_back([done = std::move(p->done), s]() mutable { done(s); });
      p = g.pending.erase(p);
    }
    ForgetIfEmptyLocked(group);
  }
  fx.Run(this);
  return absl::OkStatus();
}

absl::Status Coordinator::ReportFailure(const std::string& token, const std::string& daemon_id,
                                        const std::string& group, uint64_t epoch,
                                        const absl::Status& status) {
  if (status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("group ", group, ": reported failure is OK"));
  }
  Effects fx;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(group);
    if (it == groups_.end()) {
      return absl::NotFoundError(absl::StrCat("group ", group, ": not coordinated here"));
    }
    Group& g = it->second;
    if (!TokensEqual(g.token, token)) return WrongToken(group);
    if (epoch != g.epoch) {
      FS_VLOG(1) << "group=" << group << ": ignoring failure at stale epoch " << epoch << " (now "
                 << g.epoch << ") from daemon " << daemon_id;
      return absl::OkStatus();
    }
    g.dirty = true;
    if (g.failure_forwarded_epoch == epoch) return absl::OkStatus();
    g.failure_forwarded_epoch = epoch;
    FS_LOG(INFO) << "group=" << group << " epoch=" << epoch << ": daemon " << daemon_id
                 << " reported failure: " << status;
    std::set<std::string> seen{daemon_id};
    for (const auto& [r, m] : g.members) {
      if (!seen.insert(m.daemon_id).second) continue;
      if (Watcher* w = FindWatcher(m.daemon_id)) {
        Outgoing out;
        out.kind = Outgoing::Kind::kFailure;
        out.group = group;
        out.epoch = epoch;
        out.status = status;
        Enqueue(*w, std::move(out), fx);
      }
    }
  }
  fx.Run(this);
  return absl::OkStatus();
}

absl::StatusOr<Coordinator::WatcherId> Coordinator::Watch(const DaemonIdentity& daemon,
                                                          std::shared_ptr<WatchSink> sink) {
  if (daemon.daemon_id.empty()) {
    return absl::InvalidArgumentError("watch: empty daemon_id");
  }
  Effects fx;
  WatcherId id;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("coordinator shutting down");
    if (Watcher* old = FindWatcher(daemon.daemon_id)) {
      // A reconnect, not a death: the daemon keeps its ranks.
      Outgoing out;
      out.kind = Outgoing::Kind::kClose;
      out.status = absl::AbortedError("replaced by a newer watch stream of the same daemon");
      Enqueue(*old, std::move(out), fx);
      watcher_daemon_.erase(old->id);
      watchers_.erase(daemon.daemon_id);
    }
    id = next_id_++;
    Watcher& w = watchers_[daemon.daemon_id];
    w.id = id;
    w.daemon = daemon;
    w.last_heard = Now();
    w.mailbox = std::make_shared<Mailbox>();
    w.mailbox->sink = std::move(sink);
    watcher_daemon_[id] = daemon.daemon_id;
    FS_LOG(INFO) << "daemon " << daemon.node << " (" << daemon.peer_address << ", "
                 << daemon.daemon_id << ") watching";
    // Catch up a daemon whose stream broke while a table was pushed.
    for (auto& [name, g] : groups_) {
      if (g.epoch == 0 || g.last_table.empty()) continue;
      bool hosts = false, complete = true;
      complete = static_cast<int>(g.members.size()) == g.world_size;
      for (const auto& [r, m] : g.members) hosts = hosts || m.daemon_id == daemon.daemon_id;
      if (!hosts || !complete) continue;
      uint64_t& known = g.known_epoch[daemon.daemon_id];
      if (known >= g.epoch) continue;
      Outgoing out;
      out.kind = Outgoing::Kind::kTable;
      out.table = g.last_full;
      Enqueue(w, std::move(out), fx);
      known = g.epoch;
    }
  }
  fx.Run(this);
  return id;
}

void Coordinator::Heartbeat(WatcherId id) {
  absl::MutexLock lock(&mu_);
  auto it = watcher_daemon_.find(id);
  if (it == watcher_daemon_.end()) return;
  watchers_[it->second].last_heard = Now();
}

bool Coordinator::HeartbeatOf(const std::string& daemon_id) {
  absl::MutexLock lock(&mu_);
  Watcher* w = FindWatcher(daemon_id);
  if (w == nullptr) return false;
  w->last_heard = Now();
  return true;
}

void Coordinator::Unwatch(WatcherId id, absl::string_view why) {
  Effects fx;
  {
    absl::MutexLock lock(&mu_);
    auto it = watcher_daemon_.find(id);
    if (it == watcher_daemon_.end()) return;
    const Watcher dead = watchers_[it->second];
    DeclareDeadLocked(dead, why, fx);
  }
  fx.Run(this);
}

void Coordinator::DeclareDeadLocked(const Watcher& dead, absl::string_view why, Effects& fx) {
  const DaemonIdentity& d = dead.daemon;
  FS_LOG(INFO) << "daemon " << d.node << " (" << d.peer_address << ", " << d.daemon_id
               << ") is gone: " << why;
  {
    Watcher& w = watchers_[d.daemon_id];
    Outgoing out;
    out.kind = Outgoing::Kind::kClose;
    out.status = absl::UnavailableError(absl::StrCat("daemon ", d.node, " declared dead: ", why));
    Enqueue(w, std::move(out), fx);
  }
  watcher_daemon_.erase(dead.id);
  watchers_.erase(d.daemon_id);

  std::vector<std::string> touched;
  for (auto& [name, g] : groups_) {
    std::vector<int> ranks;
    for (auto m = g.members.begin(); m != g.members.end();) {
      if (m->second.daemon_id == d.daemon_id) {
        ranks.push_back(m->first);
        m = g.members.erase(m);
      } else {
        ++m;
      }
    }
    const bool had_pending = std::any_of(g.pending.begin(), g.pending.end(), [&](const Pending& p) {
      return p.daemon_id == d.daemon_id;
    });
    if (ranks.empty() && !had_pending) continue;
    touched.push_back(name);
    g.known_epoch.erase(d.daemon_id);
    const absl::Status s = absl::UnavailableError(absl::StrCat("group ", name, ": daemon ", d.node,
                                                               " (", d.peer_address, ") hosting ",
                                                               RankList(ranks), " is gone: ", why));
    for (auto p = g.pending.begin(); p != g.pending.end();) {
      if (p->daemon_id != d.daemon_id) {
        ++p;
        continue;
      }
      fx.calls.push_back([done = std::move(p->done), s]() mutable { done(s); });
      p = g.pending.erase(p);
    }
    if (ranks.empty()) continue;
    g.dirty = true;
    // The other daemons learn it now; a later report of the same failure adds nothing.
    g.failure_forwarded_epoch = g.epoch;
    std::set<std::string> seen;
    for (const auto& [r, m] : g.members) {
      if (!seen.insert(m.daemon_id).second) continue;
      if (Watcher* w = FindWatcher(m.daemon_id)) {
        Outgoing out;
        out.kind = Outgoing::Kind::kFailure;
        out.group = name;
        out.epoch = g.epoch;
        out.status = s;
        Enqueue(*w, std::move(out), fx);
      }
    }
  }
  for (const std::string& name : touched) ForgetIfEmptyLocked(name);
}

void Coordinator::ExpireDeadlines() {
  Effects fx;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = Now();
    ExpireLocked(now, fx);
    std::vector<Watcher> silent;
    for (const auto& [id, w] : watchers_) {
      if (w.last_heard + peer_timeout_ <= now) silent.push_back(w);
    }
    for (const Watcher& w : silent) {
      DeclareDeadLocked(w, absl::StrCat("no heartbeat for ", absl::FormatDuration(peer_timeout_)),
                        fx);
    }
  }
  fx.Run(this);
}

absl::Time Coordinator::NextDeadline() const {
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [name, g] : groups_) {
    for (const Pending& p : g.pending) next = std::min(next, p.deadline);
  }
  for (const auto& [id, w] : watchers_) next = std::min(next, w.last_heard + peer_timeout_);
  return next;
}

void Coordinator::Shutdown() {
  Effects fx;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    const absl::Status s = absl::UnavailableError("coordinator shutting down");
    for (auto& [name, g] : groups_) {
      for (Pending& p : g.pending) {
        fx.calls.push_back([done = std::move(p.done), s]() mutable { done(s); });
      }
      g.pending.clear();
    }
    for (auto& [id, w] : watchers_) {
      Outgoing out;
      out.kind = Outgoing::Kind::kClose;
      out.status = s;
      Enqueue(w, std::move(out), fx);
    }
    watchers_.clear();
    watcher_daemon_.clear();
  }
  fx.Run(this);
}

CoordinatorSnapshot Coordinator::Snapshot() const {
  absl::MutexLock lock(&mu_);
  CoordinatorSnapshot snap;
  for (const auto& [name, g] : groups_) {
    GroupSnapshot gs;
    gs.group = name;
    gs.world_size = g.world_size;
    gs.epoch = g.epoch;
    gs.dirty = g.dirty;
    gs.members.resize(g.world_size);
    for (const auto& [r, m] : g.members) gs.members[r] = m;
    for (const Pending& p : g.pending) gs.pending_ranks.push_back(p.rank);
    std::sort(gs.pending_ranks.begin(), gs.pending_ranks.end());
    snap.groups.push_back(std::move(gs));
  }
  for (const auto& [id, w] : watchers_) snap.watching.push_back(w.daemon);
  return snap;
}

}  // namespace flatshard::server::peer
