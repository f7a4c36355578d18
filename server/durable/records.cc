// Records: each group's record in the state directory, written after the group's lock.

#include "server/durable/records.h"

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
#include "common/plan_json_writer.h"
#include "server/messages.h"

namespace flatshard::server {

// Records written (and copies made) at once: fsyncs of different groups overlap.
constexpr int kDurableThreads = 4;

using internal::Display;

namespace {

// Sizes `v` (per rank, unit, state) so that v[rank][unit][i] exists.
void SizeStateSlot(std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>>& v, size_t ranks,
                   int32_t rank, size_t units, int32_t unit, size_t states) {
  if (v.size() < ranks) v.resize(ranks);
  if (v[rank].size() < units) v[rank].resize(units);
  if (v[rank][unit].size() < states) v[rank][unit].resize(states);
}
}  // namespace

Records::Records(RecordsOptions options)
    : state_dir_(options.state_dir),
      store_(options.store),
      devices_(*options.devices),
      clock_(options.clock),
      gpus_(std::move(options.gpus)),
      table_(*options.table),
      testing_commit_copy_pause_(options.testing_commit_copy_pause) {
  if (state_dir_ != nullptr) {
    state_sequence_ = state_dir_->max_loaded_sequence();
    workers_ = std::make_unique<BlockingWorkers>(kDurableThreads);
    if (!gpus_.empty()) {
      host_copies_ =
          std::make_unique<DeviceHostCopies>(DeviceHostCopies::Options{.records = this,
                                                                       .store = store_,
                                                                       .devices = &devices_,
                                                                       .table = &table_,
                                                                       .enabled = true});
    }
  }
}

void Records::RunDurable(const std::string& group, absl::AnyInvocable<void()> job) {
  if (workers_ == nullptr) {
    job();
    return;
  }
  workers_->Post(group, std::move(job));
}

std::vector<std::pair<std::string, std::shared_ptr<Buffer>>> Records::RecordedBuffers(
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

bool Records::InstallDurable(Registered& reg, int32_t rank, int32_t unit, const std::string& role,
                             std::shared_ptr<Buffer> buffer) {
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
  } else if (int i = StateIndex(role, state::kRoleCommittedStatePrefix, reg.state_specs); i >= 0) {
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

int Records::StateIndex(const std::string& role, absl::string_view prefix,
                        const std::vector<StateSpec>& specs) {
  if (!absl::StartsWith(role, prefix)) return -1;
  const absl::string_view name = absl::string_view(role).substr(prefix.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

BufferKind Records::KindOfRole(const std::string& role) {
  return role == state::kRoleGrad ? BufferKind::kGradShard : BufferKind::kShard;
}

state::GroupRecord Records::SnapshotLocked(Group& g) {
  state::GroupRecord rec = FieldsLocked(g);
  for (auto& [name, reg] : g.registered) {
    if (std::optional<state::ModuleRecord> m = ModuleSnapshot(name, reg)) {
      rec.modules.push_back(*std::move(m));
    }
  }
  return rec;
}

state::GroupRecord Records::FieldsLocked(Group& g) {
  state::GroupRecord rec;
  rec.id = g.id;
  rec.world_size = g.world_size;
  rec.token = g.token;
  rec.owner_uid = g.owner_uid;
  rec.coordinator = g.coordinator;
  rec.local_ranks = g.local_ranks;
  rec.epoch = g.epoch;
  rec.sequence = ++state_sequence_;
  return rec;
}

state::GroupRecord Records::SnapshotModuleLocked(Group& g, const std::string& module) {
  state::GroupRecord rec = FieldsLocked(g);
  auto it = g.registered.find(module);
  if (it == g.registered.end()) return rec;
  if (std::optional<state::ModuleRecord> m = ModuleSnapshot(module, it->second)) {
    rec.modules.push_back(*std::move(m));
  }
  return rec;
}

std::optional<state::ModuleRecord> Records::ModuleSnapshot(const std::string& name,
                                                           Registered& reg) {
  if (!reg.initialized && !reg.pending_commit.has_value()) return std::nullopt;
  state::ModuleRecord m;
  m.name = name;
  m.initialized = reg.initialized;
  m.pending = reg.pending_commit;
  m.voted = reg.voted_commit;
  // Device memory dies with the process (README "Restarts": what a GPU daemon keeps): a
  // rank with device buffers is recorded only with its host copies (KeepDeviceShards,
  // DeviceHostCopies), at their generation; what is under way on the device is not recorded.
  bool unkept = false, device_ranks = false;
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
      if (device && host_copy && r < static_cast<int32_t>(reg.host_generation.size())) {
        rr.generation = reg.host_generation[r];
      }
      device_ranks = device_ranks || device;
      rr.units.push_back(std::move(ur));
    }
    m.ranks.push_back(std::move(rr));
  }
  if (unkept || m.ranks.empty()) return std::nullopt;
  std::vector<std::pair<KeptKey, std::shared_ptr<Buffer>>> kept = reg.adopted_kept;
  if (reg.kept) {
    std::vector<std::pair<KeptKey, std::shared_ptr<Buffer>>> more = reg.kept->HostBuffers();
    kept.insert(kept.end(), more.begin(), more.end());
  }
  for (const auto& [key, b] : kept) {
    m.kept.push_back({static_cast<int32_t>(key.owner), key.rank, key.unit,
                      static_cast<int32_t>(key.use), static_cast<int32_t>(b->kind()),
                      b->segment_name(), b->bytes()});
  }
  m.deferred = reg.pending_committed.Recorded();
  if (device_ranks) {
    m.pending.reset();  // a commit of the device copies: the host copies hold the older one
    m.voted = 0;
  }
  if (reg.plan_json.empty()) reg.plan_json = PlanToJsonText(reg.plan);
  if (reg.manifest_json.empty()) reg.manifest_json = ManifestToJson(reg.manifest).dump();
  m.plan_json = reg.plan_json;
  m.manifest_json = reg.manifest_json;
  m.state_specs = reg.state_specs;
  return m;
}

bool Records::StateForgotten() const {
  absl::MutexLock lock(&mu_);
  return state_forgotten_;
}

void Records::PersistLater(Group& g, AfterUnlock* run) {
  if (state_dir_ == nullptr || StateForgotten()) return;
  run->Call([this, rec = SnapshotLocked(g)] { WriteRecord(rec); });
}

void Records::PersistModuleLater(Group& g, const std::string& module, AfterUnlock* run) {
  if (state_dir_ == nullptr || StateForgotten()) return;
  run->Call([this, module, rec = SnapshotModuleLocked(g, module)] { WriteModule(rec, module); });
}

bool Records::WriteModule(const state::GroupRecord& record, const std::string& module, bool sync) {
  if (state_dir_ == nullptr || StateForgotten()) return false;
  absl::Status s = state_dir_->WriteModules(record, {module}, sync);
  if (s.ok()) return true;
  // As WriteRecord: without a record the group is not kept across a restart, never adopted
  // wrong.
  FS_LOG(ERROR) << "group=" << record.id << " module=" << Display(module)
                << ": cannot write its state record (" << s
                << "); the record is removed: a restart will not keep this group";
  absl::Status r = state_dir_->Remove(record.id, record.sequence);
  if (!r.ok()) FS_LOG(ERROR) << "group=" << record.id << ": " << r;
  return false;
}

bool Records::WriteRecord(const state::GroupRecord& record) {
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

void Records::NoteRemoved(const std::string& id) {
  if (state_dir_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  removed_records_.emplace_back(id, ++state_sequence_);
}

void Records::FlushRemoved() {
  std::vector<std::pair<std::string, uint64_t>> removed;
  {
    absl::MutexLock lock(&mu_);
    removed.swap(removed_records_);
  }
  if (state_dir_ == nullptr) return;
  for (const auto& [id, sequence] : removed) {
    absl::Status s = state_dir_->Remove(id, sequence);
    if (!s.ok()) FS_LOG(ERROR) << "group=" << id << ": " << s;
  }
}

void Records::NoteLoadCopying(const std::string& group, const std::string& module,
                              std::vector<int32_t> ranks, uint64_t generation) {
  EditAndRecord(group, module, [&](Registered& reg) {
    if (reg.pending_commit.has_value()) {
      // Not while the hold keeps every copy out; never overwrite another intent.
      FS_LOG(WARNING) << "group=" << group << " module=" << Display(module) << ": a "
                      << reg.pending_commit->kind << " of generation "
                      << reg.pending_commit->generation
                      << " is recorded under way: the load's copies run without an intent";
      return false;
    }
    // Every loaded rank's shards hold `generation` completely ("ready").
    std::sort(ranks.begin(), ranks.end());
    reg.pending_commit = state::PendingCommit{generation, "load", std::move(ranks), {}};
    return true;
  });
}

void Records::NoteLoadStaged(const std::string& group, const std::string& module,
                             const std::vector<int32_t>& ranks, uint64_t generation) {
  EditAndRecord(group, module, [&](Registered& reg) {
    if (reg.pending_commit.has_value() && reg.pending_commit->kind == "load") {
      reg.pending_commit.reset();
    }
    for (int32_t r : ranks) reg.generation[r] = generation;
    return true;
  });
}

Registered* Records::FindModuleLocked(Group& g, const std::string& module) {
  if (g.removed) return nullptr;
  auto m = g.registered.find(module);
  return m == g.registered.end() ? nullptr : &m->second;
}

bool Records::EditAndRecord(const std::string& group, const std::string& module,
                            absl::FunctionRef<bool(Registered&)> edit, bool sync) {
  state::GroupRecord rec;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    Registered* reg = FindModuleLocked(g, module);
    if (reg == nullptr || !edit(*reg)) return false;
    if (state_dir_ == nullptr || StateForgotten()) return false;
    rec = SnapshotModuleLocked(g, module);  // O(this module): a commit's record
  }
  return WriteModule(rec, module, sync);
}

void Records::LoadRecordedLocked(Group& g, Registered& reg, bool changed, AfterUnlock* run) {
  const bool had_intent = reg.pending_commit.has_value() && reg.pending_commit->kind == "load";
  if (had_intent) reg.pending_commit.reset();
  // First in `run`: before the commits the hold kept waiting write their own records.
  AfterUnlock write;
  if (changed || had_intent) PersistLater(g, &write);
  write.Append(std::move(*run));
  *run = std::move(write);
}

void Records::Forget() {
  if (state_dir_ == nullptr) return;
  if (host_copies_ != nullptr) host_copies_->Stop();  // no record written after this
  std::vector<std::pair<std::string, uint64_t>> removed;
  if (StateForgotten()) return;
  for (const std::shared_ptr<Group>& g : table_.All())
    removed.emplace_back(g->id, ++state_sequence_);
  {
    absl::MutexLock lock(&mu_);
    for (auto& r : removed_records_) removed.push_back(r);
    removed_records_.clear();
  }
  for (const auto& [id, sequence] : removed) {
    absl::Status s = state_dir_->Remove(id, sequence);
    if (!s.ok()) FS_LOG(ERROR) << "group=" << id << ": " << s;
  }
  absl::MutexLock lock(&mu_);
  state_forgotten_ = true;
  FS_LOG(INFO) << "state records of " << removed.size() << " group(s) removed from "
               << state_dir_->path() << " (the shards are not kept)";
}

absl::Status Records::RollBackFromHost(const std::string& group, const std::string& module,
                                       uint64_t target, const std::vector<int32_t>& ranks) {
  if (host_copies_ == nullptr || !host_copies_->enabled()) {
    return absl::FailedPreconditionError("this daemon keeps no host copies");
  }
  return host_copies_->RollBack(group, module, target, ranks);
}

}  // namespace flatshard::server
