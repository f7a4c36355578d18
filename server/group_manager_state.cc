// GroupManager's part in restarts (README "Restarts", server/state/state_dir.h): the records
// of the groups' durable state, the commit intents that keep a torn committed copy from ever
// being adopted, and the adoption of a previous daemon's groups at start.
//
// A torn commit is never adopted. Commit (and an agreed writeback End, and an init summon's
// End) copies each rank's shards into its committed copy outside the lock; a daemon killed
// mid-copy leaves that copy torn. We chose a commit intent over A/B committed slots (which
// would cost a second committed copy per rank, i.e. one more shard's worth of memory): before
// a rank's copy starts, the group's record is rewritten with the module's `pending` commit
// (generation G, kind, and this rank in `ready_ranks`: its shards hold G completely), and
// after the copy with the rank in `done_ranks` and generation G (the pending commit is dropped
// once every local rank is done). Both writes are durable (fsync) before the copy starts and
// before the trainer is answered. On restart (AdoptGroups), for a module with a pending
// commit to G:
//   - a rank in done_ranks: its committed copy holds G;
//   - a rank in ready_ranks, or any rank when the kind is "commit": its shards hold G
//     completely (the agreement passed on every rank, so every trainer was waiting for its
//     Commit's answer and wrote nothing since; an End wrote the rank's range into its shards
//     before it became ready), so the copy is finished from the shards;
//   - any other rank (an End whose writeback into the shards may be torn): its committed copy
//     still holds G-1. If every rank is such, the group stays at G-1; if ranks end up at
//     different generations, the module is dropped as lost with a message naming each rank's
//     generation (never a silent mix). An initialisation that did not finish is dropped (it
//     was never initialised: registering again runs it).
// On host daemons an End's copies wait until every local rank has written back into its
// shards (EndArrive): one record marks them all ready, so a kill during the copies comes back
// with every rank at G. (GPU daemons copy per rank; their device shards are kept only across
// a SIGTERM, KeepDeviceShards.) Ranks at different generations then come only from a record
// written by hand, or from daemons of a multi-daemon group, which compare at rendezvous.
// Then every rank's shards are restored from its committed copy (a writeback End or a
// trainer's optimizer step may have torn them). Cost per commit: one record write before the
// first local rank's copy (a "commit" intent covers every rank) and one after each rank's
// copy (each a write, an fsync, a rename and a directory fsync; --state_fsync=false drops the
// fsyncs); records of one group are written in sequence order and a write already overtaken
// by a newer snapshot is skipped.
//
// Optimizer state (RegisterState) is recorded with the shards: the module's state specs and,
// per rank that registered state, a "state:<name>" and a "committed_state:<name>" buffer per
// state and unit (RecordedBuffers). Every copy above (finishing a commit from the live
// buffers, restoring the live buffers from the committed ones) walks
// internal::DurableBuffers, so the state commits, finishes and rolls back with the shards.
// Adoption checks each state buffer's size against its spec and refuses a record in which a
// rank has some but not all of its state buffers (CheckStateComplete): a module is never
// adopted without its state. GPU daemons keep host copies of the committed device state at
// SIGTERM ("host_committed_state:<name>", KeepDeviceShards); a rank whose device state has
// no host copy is not recorded at all.
//
// Checkpoint loads (group_manager_checkpoint.cc) are committed steps too: once every loaded
// rank's shards hold the loaded values, and before any committed copy changes, the record
// says so with a pending commit of kind "load" to the loaded generation (NoteLoadCopying); a
// restart finishes such a copy from the shards like a "commit". At the hold's release the
// intent goes and the record with the loaded generation is written before the load is
// answered (LoadRecordedLocked).

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "server/group_manager.h"
#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::Display;

std::vector<std::pair<std::string, std::shared_ptr<Buffer>>> GroupManager::RecordedBuffers(
    const Registered& reg, int32_t rank, int32_t unit) {
  std::vector<std::pair<std::string, std::shared_ptr<Buffer>>> out;
  if (rank < 0 || rank >= static_cast<int32_t>(reg.shards_by_rank.size())) return out;
  const std::vector<UnitShard>& shards = reg.shards_by_rank[rank];
  if (unit < 0 || unit >= static_cast<int32_t>(shards.size())) return out;
  out.emplace_back(state::kRoleShard, shards[unit].shard);
  if (shards[unit].grad) out.emplace_back(state::kRoleGrad, shards[unit].grad);
  if (rank < static_cast<int32_t>(reg.committed.size()) &&
      unit < static_cast<int32_t>(reg.committed[rank].size())) {
    out.emplace_back(state::kRoleCommitted, reg.committed[rank][unit]);
  }
  if (rank < static_cast<int32_t>(reg.host_committed.size()) &&
      unit < static_cast<int32_t>(reg.host_committed[rank].size()) &&
      reg.host_committed[rank][unit] != nullptr) {
    out.emplace_back(state::kRoleHostCommitted, reg.host_committed[rank][unit]);
  }
  // Optimizer state, in spec order: the live buffers, their committed copies, and (GPU
  // daemons at SIGTERM) the host copies of those.
  auto name = [&](size_t i) {
    return i < reg.state_specs.size() ? reg.state_specs[i].name : std::to_string(i);
  };
  const std::vector<std::shared_ptr<Buffer>>& live = shards[unit].state;
  for (size_t i = 0; i < live.size(); ++i) {
    out.emplace_back(absl::StrCat(state::kRoleStatePrefix, name(i)), live[i]);
  }
  if (rank < static_cast<int32_t>(reg.committed_state.size()) &&
      unit < static_cast<int32_t>(reg.committed_state[rank].size())) {
    const std::vector<std::shared_ptr<Buffer>>& kept = reg.committed_state[rank][unit];
    for (size_t i = 0; i < kept.size(); ++i) {
      out.emplace_back(absl::StrCat(state::kRoleCommittedStatePrefix, name(i)), kept[i]);
    }
  }
  if (rank < static_cast<int32_t>(reg.host_committed_state.size()) &&
      unit < static_cast<int32_t>(reg.host_committed_state[rank].size())) {
    const std::vector<std::shared_ptr<Buffer>>& host = reg.host_committed_state[rank][unit];
    for (size_t i = 0; i < host.size(); ++i) {
      if (host[i] == nullptr) continue;
      out.emplace_back(absl::StrCat(state::kRoleHostCommittedStatePrefix, name(i)), host[i]);
    }
  }
  return out;
}

namespace {

// The index of the state named after `prefix` in `role` within `specs`; -1 when `role` does
// not start with `prefix` or names no state of the spec.
int StateIndex(const std::string& role, absl::string_view prefix,
               const std::vector<StateSpec>& specs) {
  if (!absl::StartsWith(role, prefix)) return -1;
  const absl::string_view name = absl::string_view(role).substr(prefix.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

// Sizes `v` (per rank, unit, state) so that v[rank][unit][i] exists.
void SizeStateSlot(std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>>& v,
                   size_t ranks, int32_t rank, size_t units, int32_t unit, size_t states) {
  if (v.size() < ranks) v.resize(ranks);
  if (v[rank].size() < units) v[rank].resize(units);
  if (v[rank][unit].size() < states) v[rank][unit].resize(states);
}

}  // namespace

bool GroupManager::InstallDurable(Registered& reg, int32_t rank, int32_t unit,
                                  const std::string& role, std::shared_ptr<Buffer> buffer) {
  if (role == state::kRoleShard) {
    reg.shards_by_rank[rank][unit].shard = std::move(buffer);
  } else if (role == state::kRoleGrad) {
    reg.shards_by_rank[rank][unit].grad = std::move(buffer);
  } else if (role == state::kRoleCommitted) {
    reg.committed[rank][unit] = std::move(buffer);
  } else if (role == state::kRoleHostCommitted) {
    reg.host_committed[rank][unit] = std::move(buffer);
  } else if (int i = StateIndex(role, state::kRoleStatePrefix, reg.state_specs); i >= 0) {
    std::vector<std::shared_ptr<Buffer>>& live = reg.shards_by_rank[rank][unit].state;
    if (live.size() < reg.state_specs.size()) live.resize(reg.state_specs.size());
    live[i] = std::move(buffer);
  } else if (int i = StateIndex(role, state::kRoleCommittedStatePrefix, reg.state_specs);
             i >= 0) {
    SizeStateSlot(reg.committed_state, reg.shards_by_rank.size(), rank,
                  reg.shards_by_rank[rank].size(), unit, reg.state_specs.size());
    reg.committed_state[rank][unit][i] = std::move(buffer);
  } else if (int i = StateIndex(role, state::kRoleHostCommittedStatePrefix, reg.state_specs);
             i >= 0) {
    SizeStateSlot(reg.host_committed_state, reg.shards_by_rank.size(), rank,
                  reg.shards_by_rank[rank].size(), unit, reg.state_specs.size());
    reg.host_committed_state[rank][unit][i] = std::move(buffer);
  } else {
    return false;
  }
  return true;
}

BufferKind GroupManager::KindOfRole(const std::string& role) {
  return role == state::kRoleGrad ? BufferKind::kGradShard : BufferKind::kShard;
}

state::GroupRecord GroupManager::SnapshotLocked(Group& g) {
  state::GroupRecord rec;
  rec.id = g.id;
  rec.world_size = g.world_size;
  rec.token = g.token;
  rec.owner_uid = g.owner_uid;
  rec.coordinator = g.coordinator;
  rec.local_ranks = g.local_ranks;
  rec.epoch = g.epoch;
  rec.sequence = ++state_sequence_;
  for (auto& [name, reg] : g.registered) {
    if (!reg.initialized && !reg.pending_commit.has_value()) continue;
    state::ModuleRecord m;
    m.name = name;
    m.initialized = reg.initialized;
    m.pending = reg.pending_commit;
    // Device memory dies with the process (README "Restarts": what a GPU daemon keeps): a
    // rank with device buffers is recorded only with its host copies (KeepDeviceShards).
    bool unkept = false;
    for (int32_t r = 0; r < static_cast<int32_t>(reg.shards_by_rank.size()); ++r) {
      if (reg.shards_by_rank[r].empty()) continue;
      state::RankRecord rr;
      rr.rank = r;
      rr.generation = reg.generation[r];
      for (int32_t u = 0; u < static_cast<int32_t>(reg.shards_by_rank[r].size()); ++u) {
        state::UnitRecord ur;
        ur.unit = u;
        bool device = false, host_copy = false, device_state = false;
        size_t host_states = 0;
        for (const auto& [role, b] : RecordedBuffers(reg, r, u)) {
          if (b == nullptr) continue;
          if (b->on_device()) {
            // Optimizer state on the device needs its own host copies: a module is never
            // recorded (so never adopted) without its state.
            if (absl::StartsWith(role, state::kRoleStatePrefix) ||
                absl::StartsWith(role, state::kRoleCommittedStatePrefix)) {
              device_state = true;
            } else {
              device = true;
            }
            continue;
          }
          host_copy = host_copy || role == state::kRoleHostCommitted;
          if (absl::StartsWith(role, state::kRoleHostCommittedStatePrefix)) ++host_states;
          ur.buffers.push_back({role, b->segment_name(), b->bytes()});
        }
        if (device && !host_copy) unkept = true;
        if (device_state && host_states < reg.shards_by_rank[r][u].state.size()) unkept = true;
        rr.units.push_back(std::move(ur));
      }
      m.ranks.push_back(std::move(rr));
    }
    if (unkept || m.ranks.empty()) continue;
    if (reg.plan_json.empty()) reg.plan_json = PlanToJson(reg.plan).dump();
    if (reg.manifest_json.empty()) reg.manifest_json = ManifestToJson(reg.manifest).dump();
    m.plan_json = reg.plan_json;
    m.manifest_json = reg.manifest_json;
    m.state_specs = reg.state_specs;
    rec.modules.push_back(std::move(m));
  }
  return rec;
}

bool GroupManager::StateForgotten() const {
  absl::MutexLock lock(&records_mu_);
  return state_forgotten_;
}

void GroupManager::PersistLater(Group& g, AfterUnlock* run) {
  if (state_dir_ == nullptr || StateForgotten()) return;
  run->Call([this, rec = SnapshotLocked(g)] { WriteRecord(rec); });
}

bool GroupManager::WriteRecord(const state::GroupRecord& record) {
  if (state_dir_ == nullptr || StateForgotten()) return false;
  if (record.modules.empty()) {
    absl::Status s = state_dir_->Remove(record.id, record.sequence);
    if (!s.ok()) FS_LOG(ERROR) << "group=" << record.id << ": " << s;
    return s.ok();
  }
  absl::Status s = state_dir_->Write(record);
  if (s.ok()) return true;
  // The old record may no longer describe the segments (a commit is about to overwrite a
  // committed copy): without a record the group is not kept across a restart, never adopted
  // wrong.
  FS_LOG(ERROR) << "group=" << record.id << ": cannot write its state record (" << s
                << "); the record is removed: a restart will not keep this group";
  absl::Status r = state_dir_->Remove(record.id, record.sequence);
  if (!r.ok()) FS_LOG(ERROR) << "group=" << record.id << ": " << r;
  return false;
}

void GroupManager::FlushRemovedRecords() {
  std::vector<std::pair<std::string, uint64_t>> removed;
  {
    absl::MutexLock lock(&records_mu_);
    removed.swap(removed_records_);
  }
  if (state_dir_ == nullptr) return;
  for (const auto& [id, sequence] : removed) {
    absl::Status s = state_dir_->Remove(id, sequence);
    if (!s.ok()) FS_LOG(ERROR) << "group=" << id << ": " << s;
  }
}

void GroupManager::NoteLoadCopying(const std::string& group, const std::string& module,
                                   std::vector<int32_t> ranks, uint64_t generation) {
  EditAndRecord(group, module, [&](Registered& reg) {
    if (reg.pending_commit.has_value()) {
      // Not while the hold keeps every copy out; never overwrite another intent.
      FS_LOG(WARNING) << "group=" << group << " module=" << Display(module)
                      << ": a " << reg.pending_commit->kind << " of generation "
                      << reg.pending_commit->generation
                      << " is recorded under way: the load's copies run without an intent";
      return false;
    }
    // Every loaded rank's shards hold the loaded values completely ("ready").
    std::sort(ranks.begin(), ranks.end());
    reg.pending_commit = state::PendingCommit{generation, "load", std::move(ranks), {}};
    return true;
  });
}

GroupManager::Registered* GroupManager::FindModuleLocked(Group& g, const std::string& module) {
  if (g.removed) return nullptr;
  auto m = g.registered.find(module);
  return m == g.registered.end() ? nullptr : &m->second;
}

bool GroupManager::EditAndRecord(const std::string& group, const std::string& module,
                                 absl::FunctionRef<bool(Registered&)> edit) {
  state::GroupRecord rec;
  {
    std::shared_ptr<Group> held = GroupOrGone(group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    Registered* reg = FindModuleLocked(g, module);
    if (reg == nullptr || !edit(*reg)) return false;
    if (state_dir_ == nullptr || StateForgotten()) return false;
    rec = SnapshotLocked(g);
  }
  return WriteRecord(rec);
}

void GroupManager::LoadRecordedLocked(Group& g, Registered& reg, bool changed,
                                      AfterUnlock* run) {
  const bool had_intent = reg.pending_commit.has_value() && reg.pending_commit->kind == "load";
  if (had_intent) reg.pending_commit.reset();
  // First in `run`: before the commits the hold kept waiting write their own records.
  AfterUnlock write;
  if (changed || had_intent) PersistLater(g, &write);
  write.Append(std::move(*run));
  *run = std::move(write);
}

void GroupManager::NoteCommitAgreed(Registered& reg, uint64_t generation, const char* kind) {
  if (!reg.pending_commit.has_value() || reg.pending_commit->generation != generation ||
      reg.pending_commit->kind != kind) {
    reg.pending_commit = state::PendingCommit{generation, kind, {}, {}};
  }
}

void GroupManager::CommitReady(const Caller& caller, const std::string& module,
                               uint64_t generation, const char* kind) {
  const bool commit = std::string(kind) == "commit";
  const bool written = EditAndRecord(caller.group, module, [&](Registered& reg) {
    NoteCommitAgreed(reg, generation, kind);
    std::vector<int32_t>& ready = reg.pending_commit->ready_ranks;
    if (std::find(ready.begin(), ready.end(), caller.rank) == ready.end()) {
      ready.push_back(caller.rank);
      std::sort(ready.begin(), ready.end());
    }
    // A "commit" intent on disk covers every local rank: the others skip its write.
    return !(commit && reg.durable_commit_intent == generation);
  });
  if (written && commit) {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (Registered* reg = FindModuleLocked(g, module)) {
      reg->durable_commit_intent = std::max(reg->durable_commit_intent, generation);
    }
  }
}

void GroupManager::CommitDone(const Caller& caller, const std::string& module,
                              uint64_t generation) {
  EditAndRecord(caller.group, module, [&](Registered& reg) {
    MarkCommitDoneLocked(reg, caller.rank, generation);
    return true;
  });
}

void GroupManager::MarkCommitDoneLocked(Registered& reg, int32_t rank, uint64_t generation) {
  reg.generation[rank] = generation;
  if (!reg.pending_commit.has_value() || reg.pending_commit->generation != generation) return;
  std::vector<int32_t>& done = reg.pending_commit->done_ranks;
  if (std::find(done.begin(), done.end(), rank) == done.end()) {
    done.push_back(rank);
    std::sort(done.begin(), done.end());
  }
  for (int32_t r = 0; r < static_cast<int32_t>(reg.shards_by_rank.size()); ++r) {
    if (!reg.shards_by_rank[r].empty() && std::find(done.begin(), done.end(), r) == done.end()) {
      return;
    }
  }
  if (reg.pending_commit->kind == "init") {
    reg.initialized = true;
    reg.uninitialized_why.clear();
  }
  reg.pending_commit.reset();
}

void GroupManager::EndArrive(const Caller& caller, const std::string& module, uint64_t k,
                             uint64_t target, const char* kind, absl::Status status,
                             std::vector<internal::DurablePair> durable,
                             absl::AnyInvocable<void(absl::Status)> finish) {
  std::vector<EndArrival> batch;
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (Registered* found = FindModuleLocked(g, module)) {
      Registered& reg = *found;
      std::vector<EndArrival>& arrived = reg.end_batches[k];
      arrived.push_back(EndArrival{caller.rank, true, std::move(status), std::move(durable),
                                   std::move(finish)});
      size_t local = 0;
      for (const std::vector<UnitShard>& s : reg.shards_by_rank) local += s.empty() ? 0 : 1;
      if (arrived.size() < local) return;  // the last local rank copies for every rank
      batch = std::move(arrived);
      reg.end_batches.erase(k);
      // Ends whose other ranks never came (their agreement failed there) are long over.
      while (!reg.end_batches.empty() && reg.end_batches.begin()->first + 64 < k) {
        reg.end_batches.erase(reg.end_batches.begin());
      }
    } else {
      batch.push_back(EndArrival{caller.rank, true, std::move(status), std::move(durable),
                                 std::move(finish)});
    }
  }
  ProcessEndBatch(caller.group, module, target, kind, std::move(batch));
}

void GroupManager::EndNotApplied(const Caller& caller, const std::string& module, uint64_t k) {
  std::vector<EndArrival> batch;
  uint64_t target = 0;
  std::string kind;
  {
    std::shared_ptr<Group> held = GroupOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    Registered* found = FindModuleLocked(g, module);
    if (found == nullptr) return;
    Registered& reg = *found;
    std::vector<EndArrival>& arrived = reg.end_batches[k];
    EndArrival a;
    a.rank = caller.rank;
    arrived.push_back(std::move(a));
    size_t local = 0;
    for (const std::vector<UnitShard>& s : reg.shards_by_rank) local += s.empty() ? 0 : 1;
    if (arrived.size() < local) return;
    batch = std::move(arrived);
    reg.end_batches.erase(k);
    if (reg.pending_commit.has_value()) {
      target = reg.pending_commit->generation;
      kind = reg.pending_commit->kind;
    }
  }
  ProcessEndBatch(caller.group, module, target, kind.empty() ? "end" : kind == "init" ? "init" : "end",
                  std::move(batch));
}

void GroupManager::ProcessEndBatch(const std::string& group, const std::string& module,
                                   uint64_t target, const char* kind,
                                   std::vector<EndArrival> batch) {
  std::vector<EndArrival*> applying;
  for (EndArrival& a : batch) {
    if (a.applying && a.status.ok()) applying.push_back(&a);
  }
  auto record = [&](bool ready) {
    EditAndRecord(group, module, [&](Registered& reg) {
      if (ready) {
        NoteCommitAgreed(reg, target, kind);
        std::vector<int32_t>& r = reg.pending_commit->ready_ranks;
        for (EndArrival* a : applying) {
          if (std::find(r.begin(), r.end(), a->rank) == r.end()) r.push_back(a->rank);
        }
        std::sort(r.begin(), r.end());
      } else {
        for (EndArrival* a : applying) {
          if (a->status.ok()) MarkCommitDoneLocked(reg, a->rank, target);
        }
      }
      return true;
    });
  };
  if (!applying.empty()) {
    // Every local rank's shards hold the new generation: one record says so before any
    // committed copy is overwritten, one after all of them are.
    record(/*ready=*/true);
    TestingPauseMidCopy(applying.front()->rank, applying.front()->durable);
    for (EndArrival* a : applying) {
      a->status = CopyCommitted(a->rank, a->durable, /*to_committed=*/true);
    }
    record(/*ready=*/false);
  }
  for (EndArrival& a : batch) {
    if (a.applying && !a.status.ok()) {
      FS_LOG(ERROR) << "group=" << group << " rank=" << a.rank
                    << ": writeback failed after every rank agreed: " << a.status;
    }
    if (a.finish) a.finish(std::move(a.status));
  }
}

void GroupManager::TestingPauseMidCopy(
    int32_t rank, const std::vector<internal::DurablePair>& durable) const {
  if (testing_commit_copy_pause_ <= absl::ZeroDuration() || durable.empty()) return;
  // Tears the committed copy on purpose: the first buffer is copied, the others not yet.
  devices_.CopyEach(rank, {durable[0].live.get()}, {durable[0].committed.get()}).IgnoreError();
  FS_LOG(WARNING) << "testing: commit copy of rank " << rank << " paused for "
                  << absl::FormatDuration(testing_commit_copy_pause_)
                  << " with its committed copy torn";
  absl::SleepFor(testing_commit_copy_pause_);
}

namespace {
void CopyHostBytes(const Buffer& from, const Buffer& to) {
  if (from.bytes() > 0) std::memcpy(to.data(), from.data(), static_cast<size_t>(from.bytes()));
}
}  // namespace

void GroupManager::KeepDeviceShards() {
  if (state_dir_ == nullptr || gpus_.empty()) return;
  struct Job {
    std::string group, module;
    int32_t rank = 0;
    int64_t owner_uid = -1;
    std::vector<std::shared_ptr<Buffer>> committed;
    // Per unit, the committed optimizer state buffers (state_specs order), if any.
    std::vector<std::vector<std::shared_ptr<Buffer>>> committed_state;
    std::vector<std::string> state_names;
  };
  std::vector<Job> jobs;
  for (const std::shared_ptr<Group>& held : AllGroups()) {
    Group& g = *held;
    const std::string& id = g.id;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    {
      for (auto& [module, reg] : g.registered) {
        if (!reg.initialized || reg.busy > 0 || reg.pending_commit.has_value()) {
          if (reg.initialized) {
            FS_LOG(WARNING) << "group=" << id << " module=" << Display(module)
                            << ": a commit or rollback is under way at shutdown: its device "
                               "shards are not kept";
          }
          continue;
        }
        for (int32_t r = 0; r < static_cast<int32_t>(reg.committed.size()); ++r) {
          if (reg.committed[r].empty() || reg.committed[r][0] == nullptr ||
              !reg.committed[r][0]->on_device()) {
            continue;
          }
          Job job{id, module, r, g.owner_uid, reg.committed[r], {}, {}};
          if (r < static_cast<int32_t>(reg.committed_state.size())) {
            job.committed_state = reg.committed_state[r];
          }
          for (const StateSpec& spec : reg.state_specs) job.state_names.push_back(spec.name);
          jobs.push_back(std::move(job));
        }
      }
    }
  }
  // The copies run without mu_ (device to host, as large as the shards).
  std::set<std::string> touched;
  int64_t bytes = 0;
  int kept = 0;
  for (Job& job : jobs) {
    std::vector<std::shared_ptr<Buffer>> hosts;
    absl::Status s;
    for (size_t u = 0; u < job.committed.size() && s.ok(); ++u) {
      absl::StatusOr<std::shared_ptr<Buffer>> host = store_->Allocate(
          BufferKind::kShard, job.committed[u]->bytes(),
          absl::StrCat("group=", job.group, " module=", job.module, " unit=", u, " rank=",
                       job.rank, " host copy"),
          job.owner_uid, Placement::Host());
      s = host.status();
      if (s.ok()) s = devices_.CopyEach(job.rank, {job.committed[u].get()}, {host->get()});
      if (s.ok()) {
        bytes += (*host)->bytes();
        hosts.push_back(*std::move(host));
      }
    }
    // Its optimizer state too: a module is never adopted without it (SnapshotLocked records
    // a rank with device state only with a host copy of every state buffer).
    std::vector<std::vector<std::shared_ptr<Buffer>>> host_state(job.committed_state.size());
    for (size_t u = 0; u < job.committed_state.size() && s.ok(); ++u) {
      for (size_t i = 0; i < job.committed_state[u].size() && s.ok(); ++i) {
        const Buffer& from = *job.committed_state[u][i];
        absl::StatusOr<std::shared_ptr<Buffer>> host = store_->Allocate(
            BufferKind::kShard, from.bytes(),
            absl::StrCat("group=", job.group, " module=", job.module, " unit=", u, " rank=",
                         job.rank, " state=",
                         i < job.state_names.size() ? job.state_names[i] : std::to_string(i),
                         " host copy"),
            job.owner_uid, Placement::Host());
        s = host.status();
        if (s.ok() && from.on_device()) s = devices_.CopyEach(job.rank, {&from}, {host->get()});
        if (s.ok() && !from.on_device()) CopyHostBytes(from, **host);
        if (s.ok()) {
          bytes += (*host)->bytes();
          host_state[u].push_back(*std::move(host));
        }
      }
    }
    if (!s.ok()) {
      FS_LOG(ERROR) << "group=" << job.group << " module=" << Display(job.module) << " rank="
                    << job.rank << ": cannot keep a host copy of its device shards and "
                    << "optimizer state (the module is not kept): " << s;
      continue;
    }
    std::shared_ptr<Group> held = GroupOrGone(job.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    auto it = g.registered.find(job.module);
    if (it == g.registered.end()) continue;
    Registered& reg = it->second;
    reg.host_committed.resize(reg.committed.size());
    reg.host_committed[job.rank] = std::move(hosts);
    if (!host_state.empty()) {
      reg.host_committed_state.resize(reg.committed.size());
      reg.host_committed_state[job.rank] = std::move(host_state);
    }
    touched.insert(job.group);
    ++kept;
  }
  for (const std::string& id : touched) {
    state::GroupRecord rec;
    {
      std::shared_ptr<Group> held = GroupOrGone(id);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (g.removed) continue;
      rec = SnapshotLocked(g);
    }
    WriteRecord(rec);
  }
  if (!jobs.empty()) {
    FS_LOG(INFO) << "kept host copies of the committed device shards of " << kept
                 << " rank(s) of " << touched.size() << " group(s), " << bytes
                 << " bytes, for the next daemon";
  }
}

void GroupManager::ForgetState() {
  if (state_dir_ == nullptr) return;
  std::vector<std::pair<std::string, uint64_t>> removed;
  if (StateForgotten()) return;
  for (const std::shared_ptr<Group>& g : AllGroups()) removed.emplace_back(g->id, ++state_sequence_);
  {
    absl::MutexLock lock(&records_mu_);
    for (auto& r : removed_records_) removed.push_back(r);
    removed_records_.clear();
  }
  for (const auto& [id, sequence] : removed) {
    absl::Status s = state_dir_->Remove(id, sequence);
    if (!s.ok()) FS_LOG(ERROR) << "group=" << id << ": " << s;
  }
  absl::MutexLock lock(&records_mu_);
  state_forgotten_ = true;
  FS_LOG(INFO) << "state records of " << removed.size() << " group(s) removed from "
               << state_dir_->path() << " (the shards are not kept)";
}

namespace {

void CopyHost(const Buffer& from, const Buffer& to) {
  if (from.bytes() > 0) std::memcpy(to.data(), from.data(), static_cast<size_t>(from.bytes()));
}

bool Contains(const std::vector<int32_t>& v, int32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

absl::Status GroupManager::CheckStateComplete(Registered& reg, int32_t rank,
                                              const std::string& where) {
  const std::vector<UnitShard>& shards = reg.shards_by_rank[rank];
  auto at = [](const auto& v, size_t i) -> std::shared_ptr<Buffer> {
    return i < v.size() ? v[i] : nullptr;
  };
  auto slot = [&](const auto& v, size_t u, size_t i) -> std::shared_ptr<Buffer> {
    if (static_cast<size_t>(rank) >= v.size() || u >= v[rank].size()) return nullptr;
    return at(v[rank][u], i);
  };
  // A rank that registered state has every state of the spec, on every unit: live and
  // committed (host daemons), or a host copy of the committed one (GPU daemons at SIGTERM).
  std::vector<std::string> present, missing;
  for (size_t u = 0; u < shards.size(); ++u) {
    for (size_t i = 0; i < reg.state_specs.size(); ++i) {
      const std::string& name = reg.state_specs[i].name;
      const bool host = slot(reg.host_committed_state, u, i) != nullptr;
      const std::pair<const char*, bool> roles[] = {
          {state::kRoleStatePrefix, host || at(shards[u].state, i) != nullptr},
          {state::kRoleCommittedStatePrefix, host || slot(reg.committed_state, u, i) != nullptr}};
      for (const auto& [prefix, ok] : roles) {
        (ok ? present : missing).push_back(absl::StrCat("unit ", u, " ", prefix, name));
      }
    }
  }
  if (present.empty() || missing.empty()) {
    if (present.empty()) {
      // No state on this rank: none of it may linger half-sized.
      for (UnitShard& s : reg.shards_by_rank[rank]) s.state.clear();
      if (static_cast<size_t>(rank) < reg.committed_state.size()) {
        reg.committed_state[rank].clear();
      }
    }
    return absl::OkStatus();
  }
  constexpr size_t kNamed = 8;
  const size_t n = missing.size();
  if (n > kNamed) missing.resize(kNamed);
  return absl::InvalidArgumentError(absl::StrCat(
      where, ": some but not all of its optimizer state buffers are recorded: ", n,
      " missing (", absl::StrJoin(missing, ", "), n > kNamed ? ", ..." : "",
      "); never adopted without its whole state"));
}

absl::Status GroupManager::StateFromHost(Registered& reg, const state::GroupRecord& rec,
                                         const std::string& module, int32_t rank) {
  if (static_cast<size_t>(rank) >= reg.host_committed_state.size() ||
      reg.host_committed_state[rank].empty()) {
    return absl::OkStatus();
  }
  std::vector<UnitShard>& shards = reg.shards_by_rank[rank];
  if (reg.committed_state.size() < reg.shards_by_rank.size()) {
    reg.committed_state.resize(reg.shards_by_rank.size());
  }
  reg.committed_state[rank].assign(shards.size(), {});
  for (size_t u = 0; u < shards.size(); ++u) {
    shards[u].state.clear();
    for (size_t i = 0; i < reg.state_specs.size(); ++i) {
      const Buffer& host = *reg.host_committed_state[rank][u][i];
      for (bool committed : {false, true}) {
        absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
            BufferKind::kShard, host.bytes(),
            absl::StrCat("group=", rec.id, " module=", module, " unit=", u, " rank=", rank,
                         " state=", reg.state_specs[i].name, committed ? " committed" : ""),
            rec.owner_uid, devices_.PlacementOf(rank));
        absl::Status s = b.status();
        if (s.ok()) s = devices_.CopyEach(rank, {&host}, {b->get()});
        if (!s.ok()) {
          return absl::Status(s.code(), absl::StrCat("module ", Display(module), " rank ", rank,
                                                     " unit ", u, " state \"",
                                                     reg.state_specs[i].name,
                                                     "\": back to the device: ", s.message()));
        }
        (committed ? reg.committed_state[rank][u] : shards[u].state).push_back(*std::move(b));
      }
    }
  }
  reg.host_committed_state[rank].clear();
  return absl::OkStatus();
}

GroupManager::AdoptSummary GroupManager::AdoptGroups(
    const std::vector<state::GroupRecord>& records) {
  AdoptSummary summary;
  const std::string dir = state_dir_ != nullptr ? state_dir_->path() : std::string("(none)");
  for (const state::GroupRecord& rec : records) {
    const std::string file = absl::StrCat(dir, "/", state::RecordFileName(rec.id));
    std::shared_ptr<Group> held = std::make_shared<Group>();
    Group* g = held.get();
    // Nobody else sees the group before it is in the table; locked for the analysis' sake.
    absl::ReleasableMutexLock lock(&g->mu);
    g->id = rec.id;
    g->world_size = rec.world_size;
    g->token = rec.token;
    g->owner_uid = rec.owner_uid;
    g->coordinator = rec.coordinator;
    g->epoch = rec.epoch;
    g->local_ranks = rec.local_ranks;
    g->idle_since = clock_->Now();
    std::vector<std::shared_ptr<Buffer>> adopted;  // every buffer taken over, for a refusal
    absl::Status refused;
    int64_t bytes = 0;
    std::vector<std::string> lines;
    for (const state::ModuleRecord& m : rec.modules) {
      const std::string where = absl::StrCat("module ", Display(m.name));
      absl::StatusOr<Plan> plan = PlanFromJson(m.plan_json);
      if (!plan.ok()) {
        refused = absl::InvalidArgumentError(absl::StrCat(where, ": plan: ", plan.status().message()));
        break;
      }
      absl::StatusOr<Manifest> manifest = ManifestFromJson(m.manifest_json);
      if (!manifest.ok()) {
        refused = absl::InvalidArgumentError(
            absl::StrCat(where, ": manifest: ", manifest.status().message()));
        break;
      }
      if (plan->world_size != rec.world_size) {
        refused = absl::InvalidArgumentError(absl::StrCat(where, ": the plan is for world size ",
                                                          plan->world_size, ", the group has ",
                                                          rec.world_size));
        break;
      }
      Registered reg;
      reg.plan = *std::move(plan);
      reg.manifest = *std::move(manifest);
      reg.plan_json = m.plan_json;
      reg.manifest_json = m.manifest_json;
      const int32_t units = static_cast<int32_t>(reg.plan.units.size());
      reg.summoned.assign(rec.world_size, std::vector<bool>(units, false));
      reg.summon_count.assign(rec.world_size, 0);
      reg.attached_session.assign(rec.world_size, 0);
      reg.shards_by_rank.resize(rec.world_size);
      reg.committed.resize(rec.world_size);
      reg.host_committed.resize(rec.world_size);
      reg.generation.assign(rec.world_size, 0);
      reg.stale.assign(rec.world_size, false);
      reg.initialized = m.initialized;
      reg.state_specs = m.state_specs;
      for (const state::RankRecord& rr : m.ranks) {
        const std::string rw = absl::StrCat(where, " rank ", rr.rank);
        if (static_cast<int32_t>(rr.units.size()) != units) {
          refused = absl::InvalidArgumentError(absl::StrCat(rw, ": ", rr.units.size(),
                                                            " units recorded, the plan has ", units));
          break;
        }
        reg.shards_by_rank[rr.rank].resize(units);
        reg.committed[rr.rank].resize(units);
        reg.host_committed[rr.rank].resize(units);
        reg.generation[rr.rank] = rr.generation;
        for (const state::UnitRecord& ur : rr.units) {
          if (ur.unit < 0 || ur.unit >= units) {
            refused = absl::InvalidArgumentError(absl::StrCat(rw, ": unit ", ur.unit, " is not in the plan"));
            break;
          }
          const PlanUnit& pu = reg.plan.units[ur.unit];
          const int64_t want = pu.shard_numel * ItemSize(pu.dtype);
          reg.shards_by_rank[rr.rank][ur.unit].unit = ur.unit;
          for (const state::BufferRecord& b : ur.buffers) {
            const std::string bw = absl::StrCat(rw, " unit ", ur.unit, " ", b.role, " ", b.segment);
            int state = -1;
            for (const char* prefix : {state::kRoleStatePrefix, state::kRoleCommittedStatePrefix,
                                       state::kRoleHostCommittedStatePrefix}) {
              if (absl::StartsWith(b.role, prefix)) {
                state = StateIndex(b.role, prefix, reg.state_specs);
                if (state < 0) {
                  refused = absl::InvalidArgumentError(absl::StrCat(
                      bw, ": the module's recorded optimizer state spec has no state \"",
                      b.role.substr(std::strlen(prefix)), "\""));
                }
                break;
              }
            }
            if (!refused.ok()) break;
            if (state >= 0) {
              const StateSpec& spec = reg.state_specs[state];
              const int64_t state_want = spec.Numel(pu.shard_numel) * ItemSize(spec.dtype);
              if (b.bytes != state_want) {
                refused = absl::InvalidArgumentError(absl::StrCat(
                    bw, ": ", b.bytes, " bytes recorded, optimizer state \"", spec.name, "\" (",
                    DTypeName(spec.dtype), ", ", StateShapeName(spec.shape), ") has ",
                    state_want));
                break;
              }
            } else if (b.bytes != want) {
              refused = absl::InvalidArgumentError(absl::StrCat(
                  bw, ": ", b.bytes, " bytes recorded, the plan's shard has ", want));
              break;
            }
            absl::StatusOr<std::shared_ptr<Buffer>> buffer = store_->Adopt(
                KindOfRole(b.role), b.segment, b.bytes,
                absl::StrCat("group=", rec.id, " module=", m.name, " unit=", ur.unit,
                             " rank=", rr.rank, " ", b.role),
                rec.owner_uid);
            if (!buffer.ok()) {
              refused = absl::Status(buffer.status().code(),
                                     absl::StrCat(bw, ": ", buffer.status().message()));
              break;
            }
            adopted.push_back(*buffer);
            if (!InstallDurable(reg, rr.rank, ur.unit, b.role, *std::move(buffer))) {
              refused = absl::InvalidArgumentError(
                  absl::StrCat(bw, ": role ", b.role, " is unknown to this daemon"));
              break;
            }
            bytes += b.bytes;
          }
          if (!refused.ok()) break;
          const bool host_copy = reg.host_committed[rr.rank][ur.unit] != nullptr;
          if (!host_copy && (reg.shards_by_rank[rr.rank][ur.unit].shard == nullptr ||
                             reg.committed[rr.rank][ur.unit] == nullptr)) {
            refused = absl::InvalidArgumentError(
                absl::StrCat(rw, " unit ", ur.unit, ": no shard or no committed copy recorded"));
            break;
          }
          if (host_copy && !devices_.PlacementOf(rr.rank).on_device()) {
            refused = absl::InvalidArgumentError(absl::StrCat(
                rw, " unit ", ur.unit, ": a GPU daemon's host copy, but this daemon keeps rank ",
                rr.rank, " in host memory (start it with the same --gpus)"));
            break;
          }
        }
        if (!refused.ok()) break;
        refused = CheckStateComplete(reg, rr.rank, rw);
        if (!refused.ok()) break;
      }
      if (!refused.ok()) break;

      // GPU daemons: fresh device shards and committed copies from the host copies a SIGTERM
      // made (KeepDeviceShards); the host copies go once this module is in place.
      std::set<int32_t> from_host;
      for (const state::RankRecord& rr : m.ranks) {
        if (reg.host_committed[rr.rank].empty() || reg.host_committed[rr.rank][0] == nullptr) {
          continue;
        }
        for (int32_t u = 0; u < units && refused.ok(); ++u) {
          const Buffer& host = *reg.host_committed[rr.rank][u];
          for (std::shared_ptr<Buffer>* slot :
               {&reg.shards_by_rank[rr.rank][u].shard, &reg.committed[rr.rank][u]}) {
            absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
                BufferKind::kShard, host.bytes(),
                absl::StrCat("group=", rec.id, " module=", m.name, " unit=", u, " rank=", rr.rank,
                             slot == &reg.committed[rr.rank][u] ? " committed" : ""),
                rec.owner_uid, devices_.PlacementOf(rr.rank));
            absl::Status s = b.status();
            if (s.ok()) s = devices_.CopyEach(rr.rank, {&host}, {b->get()});
            if (!s.ok()) {
              refused = absl::Status(s.code(), absl::StrCat(where, " rank ", rr.rank, " unit ", u,
                                                            ": back to the device: ", s.message()));
              break;
            }
            *slot = *std::move(b);
          }
        }
        if (refused.ok()) refused = StateFromHost(reg, rec, m.name, rr.rank);
        if (!refused.ok()) break;
        from_host.insert(rr.rank);
        reg.host_committed[rr.rank].clear();
      }
      if (!refused.ok()) break;

      // Commits under way at the kill (see the top of this file).
      std::vector<int32_t> ranks;
      for (const state::RankRecord& rr : m.ranks) ranks.push_back(rr.rank);
      std::vector<int32_t> torn;
      if (m.pending.has_value()) {
        const state::PendingCommit& p = *m.pending;
        for (int32_t r : ranks) {
          if (Contains(p.done_ranks, r)) {
            reg.generation[r] = p.generation;
          } else if (Contains(p.ready_ranks, r) || p.kind == "commit" || p.kind == "load") {
            // The shards and the optimizer state alike (internal::DurableBuffers).
            for (const internal::DurablePair& d : internal::DurableBuffers(reg, r)) {
              CopyHost(*d.live, *d.committed);
            }
            reg.generation[r] = p.generation;
            FS_LOG(INFO) << "group=" << rec.id << " module=" << Display(m.name) << " rank=" << r
                         << ": finished the " << p.kind << " of generation " << p.generation
                         << " from its shards (the daemon died during its copy)";
          } else {
            torn.push_back(r);
          }
        }
        if (p.kind == "init") {
          if (torn.empty()) {
            reg.initialized = true;
          } else {
            FS_LOG(WARNING) << "group=" << rec.id << " module=" << Display(m.name)
                            << ": its initialisation did not finish on "
                            << internal::RankListText(torn)
                            << " before the daemon died: not adopted (registering it again "
                               "runs the initialisation)";
            continue;  // its buffers go: it was never initialised
          }
        }
      }
      if (!reg.initialized) continue;
      std::map<uint64_t, std::vector<int32_t>> by_generation;
      for (int32_t r : ranks) by_generation[reg.generation[r]].push_back(r);
      if (by_generation.size() > 1) {
        std::vector<std::string> parts;
        for (const auto& [gen, rs] : by_generation) {
          parts.push_back(absl::StrCat(internal::RankListText(rs), ": generation ", gen));
        }
        std::string why = absl::StrCat(
            "group ", rec.id, ": module ", Display(m.name), " lost: after the daemon restarted its ranks hold different committed generations (",
            absl::StrJoin(parts, "; "),
            "): it died between their copies of one commit; register it afresh on every rank");
        FS_LOG(WARNING) << why;
        g->lost[m.name] = std::move(why);
        ++summary.lost_modules;
        continue;
      }
      // Shards as of the last commit: a writeback or an optimizer step may have torn them.
      for (int32_t r : ranks) {
        if (from_host.contains(r)) continue;  // fresh copies of the committed copy already
        for (const internal::DurablePair& d : internal::DurableBuffers(reg, r)) {
          CopyHost(*d.committed, *d.live);
        }
      }
      const uint64_t generation = ranks.empty() ? 0 : reg.generation[ranks.front()];
      lines.push_back(absl::StrCat(Display(m.name), " (", units, " units, ranks ",
                                   absl::StrJoin(ranks, ","), ", generation ", generation, ")"));
      // A trainer that has not noticed the kill may still write into these shards: the
      // group owes a rollback at its first formation and every adopted rank is stale until
      // it reads its views after it (mixfix).
      for (int32_t r : ranks) reg.stale[r] = true;
      g->rollback_due = true;
      g->registered.emplace(m.name, std::move(reg));
    }
    if (!refused.ok()) {
      // Left alone: a refused record's segments are not ours to remove.
      for (const std::shared_ptr<Buffer>& b : adopted) b->Disown();
      FS_LOG(ERROR) << "state record " << file << " of group " << rec.id
                    << " refused, group not adopted (its segments are left alone): "
                    << refused.message();
      ++summary.refused_groups;
      continue;
    }
    if (g->registered.empty() && g->lost.empty()) {
      FS_LOG(INFO) << "group=" << rec.id << ": nothing to adopt from " << file;
      if (state_dir_ != nullptr) state_dir_->Remove(rec.id, rec.sequence).IgnoreError();
      continue;
    }
    int64_t live = 0, count = 0;
    for (const auto& [name, reg] : g->registered) {
      for (int32_t r = 0; r < static_cast<int32_t>(reg.shards_by_rank.size()); ++r) {
        for (int32_t u = 0; u < static_cast<int32_t>(reg.shards_by_rank[r].size()); ++u) {
          for (const auto& [role, b] : RecordedBuffers(reg, r, u)) {
            if (b != nullptr) {
              live += b->bytes();
              ++count;
            }
          }
        }
      }
    }
    FS_LOG(INFO) << "group=" << rec.id << " adopted from " << file << ": "
                 << g->registered.size() << " module(s) " << absl::StrJoin(lines, ", ") << ", "
                 << count << " buffers, " << live << " bytes"
                 << (g->lost.empty() ? "" : absl::StrCat(", ", g->lost.size(), " lost"));
    ++summary.groups;
    summary.modules += static_cast<int32_t>(g->registered.size());
    summary.bytes += live;
    summary.buffers += count;
    AfterUnlock run;
    {
      absl::MutexLock table(&table_mu_);
      groups_[rec.id] = held;
    }
    PersistLater(*g, &run);  // the restored state, with no commit under way
    lock.Release();
    run.Run();
  }
  FS_LOG(INFO) << "restart: adopted " << summary.groups << " group(s), " << summary.modules
               << " module(s), " << summary.buffers << " buffers, " << summary.bytes
               << " bytes; refused " << summary.refused_groups << " record(s); "
               << summary.lost_modules << " module(s) lost";
  return summary;
}

}  // namespace flatshard::server
