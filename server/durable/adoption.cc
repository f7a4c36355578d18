// Records: adoption of a previous daemon's records at start, and what a GPU daemon keeps at
// SIGTERM.

#include "server/durable/records.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/status_macros.h"
#include "server/messages.h"
#include "server/module/generations.h"

namespace flatshard::server {

using internal::Display;

namespace {

void CopyHost(const Buffer& from, const Buffer& to) {
  if (from.bytes() > 0) std::memcpy(to.data(), from.data(), static_cast<size_t>(from.bytes()));
}

bool Contains(const std::vector<int32_t>& v, int32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Faults in an adopted kept buffer's pages (resident in /dev/shm, not yet mapped here) in
// chunks, stopping once the buffer is gone. Holds no reference: a summon takes a kept buffer
// only while nobody else holds it. A chunk racing the buffer's destruction touches an unmapped
// range (ENOMEM) or another mapping's pages, and populating changes no byte either way; on an
// older kernel (EINVAL) the summon faults them in itself.
void PrefaultKept(const std::weak_ptr<Buffer>& weak, char* data, int64_t bytes) {
  constexpr int64_t kChunk = int64_t{64} << 20;
  for (int64_t at = 0; at < bytes && !weak.expired(); at += kChunk) {
    const int64_t n = std::min(kChunk, bytes - at);
    if (::madvise(data + at, static_cast<size_t>(n), MADV_POPULATE_WRITE) != 0) return;
  }
}

}  // namespace

// One rank's committed device buffers of one module, to be copied to host memory at SIGTERM.
struct Records::KeepJob {
  std::string group, module;
  int32_t rank = 0;
  uint64_t generation = 0;
  int64_t owner_uid = -1;
  std::vector<std::shared_ptr<Buffer>> committed;
  // Per unit, the committed optimizer state buffers (state_specs order), if any.
  std::vector<std::vector<std::shared_ptr<Buffer>>> committed_state;
  std::vector<std::string> state_names;
  // Filled by CopyToHost.
  std::vector<std::shared_ptr<Buffer>> hosts;
  std::vector<std::vector<std::shared_ptr<Buffer>>> host_state;
};

void Records::KeepDeviceShards() {
  if (state_dir_ == nullptr) return;
  // Writeback Ends' copies from their summon buffers first: those segments are unlinked at
  // shutdown, so each copy completes (and its record entries go) before (issue 24).
  std::vector<std::shared_ptr<PendingCopy>> pending;
  for (const std::shared_ptr<Group>& held : table_.All()) {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    for (auto& [module, reg] : g.registered) {
      std::vector<std::shared_ptr<PendingCopy>> more = reg.pending_committed.Of(-1);
      pending.insert(pending.end(), more.begin(), more.end());
    }
  }
  for (const std::shared_ptr<PendingCopy>& p : pending) p->Finish();
  if (gpus_.empty()) return;
  // The copies made at each commit end first (the running one completes): a rank whose
  // recorded host copy holds its committed generation is not copied again.
  if (host_copies_ != nullptr) host_copies_->Stop();
  std::vector<KeepJob> jobs = CollectKeepJobs();
  // The copies run without any group's lock (device to host, as large as the shards).
  std::set<std::string> touched;
  int64_t bytes = 0;
  int kept = 0;
  for (KeepJob& job : jobs) {
    absl::Status s = CopyToHost(job, &bytes);
    if (!s.ok()) {
      FS_LOG(ERROR) << "group=" << job.group << " module=" << Display(job.module)
                    << " rank=" << job.rank << ": cannot keep a host copy of its device shards and "
                    << "optimizer state (the module is not kept): " << s;
      continue;
    }
    std::shared_ptr<Group> held = table_.FindOrGone(job.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    auto it = g.registered.find(job.module);
    if (it == g.registered.end()) continue;
    Registered& reg = it->second;
    reg.host_committed.resize(reg.committed.size());
    reg.host_committed[job.rank] = std::move(job.hosts);
    reg.host_generation.resize(reg.committed.size(), 0);
    reg.host_generation[job.rank] = job.generation;
    if (!job.host_state.empty()) {
      reg.host_committed_state.resize(reg.committed.size());
      reg.host_committed_state[job.rank] = std::move(job.host_state);
    }
    touched.insert(job.group);
    ++kept;
  }
  for (const std::string& id : touched) {
    state::GroupRecord rec;
    {
      std::shared_ptr<Group> held = table_.FindOrGone(id);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (g.removed) continue;
      rec = SnapshotLocked(g);
    }
    WriteRecord(rec);
  }
  if (!jobs.empty()) {
    FS_LOG(INFO) << "kept host copies of the committed device shards of " << kept << " rank(s) of "
                 << touched.size() << " group(s), " << bytes << " bytes, for the next daemon";
  }
}

std::vector<Records::KeepJob> Records::CollectKeepJobs() {
  std::vector<KeepJob> jobs;
  for (const std::shared_ptr<Group>& held : table_.All()) {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    for (auto& [module, reg] : g.registered) {
      if (!reg.initialized || reg.busy > 0 || reg.pending_commit.has_value()) {
        if (reg.initialized) {
          FS_LOG(WARNING) << "group=" << g.id << " module=" << Display(module)
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
        if (r < static_cast<int32_t>(reg.host_committed.size()) && !reg.host_committed[r].empty() &&
            r < static_cast<int32_t>(reg.host_generation.size()) &&
            reg.host_generation[r] == reg.generation[r]) {
          continue;  // its host copy (DeviceHostCopies) is current and recorded
        }
        KeepJob job;
        job.group = g.id;
        job.module = module;
        job.rank = r;
        job.generation = reg.generation[r];
        job.owner_uid = g.owner_uid;
        job.committed = reg.committed[r];
        if (r < static_cast<int32_t>(reg.committed_state.size())) {
          job.committed_state = reg.committed_state[r];
        }
        for (const StateSpec& spec : reg.state_specs) job.state_names.push_back(spec.name);
        jobs.push_back(std::move(job));
      }
    }
  }
  return jobs;
}

absl::Status Records::CopyToHost(KeepJob& job, int64_t* bytes) {
  for (size_t u = 0; u < job.committed.size(); ++u) {
    absl::StatusOr<std::shared_ptr<Buffer>> host =
        store_->Allocate(BufferKind::kShard, job.committed[u]->bytes(),
                         absl::StrCat("group=", job.group, " module=", job.module, " unit=", u,
                                      " rank=", job.rank, " host copy"),
                         job.owner_uid, Placement::Host());
    FS_RETURN_IF_ERROR(host.status());
    FS_RETURN_IF_ERROR(devices_.CopyEach(job.rank, {job.committed[u].get()}, {host->get()}));
    *bytes += (*host)->bytes();
    job.hosts.push_back(*std::move(host));
  }
  // Its optimizer state too: a module is never adopted without it (SnapshotLocked records
  // a rank with device state only with a host copy of every state buffer).
  job.host_state.resize(job.committed_state.size());
  for (size_t u = 0; u < job.committed_state.size(); ++u) {
    for (size_t i = 0; i < job.committed_state[u].size(); ++i) {
      const Buffer& from = *job.committed_state[u][i];
      absl::StatusOr<std::shared_ptr<Buffer>> host = store_->Allocate(
          BufferKind::kShard, from.bytes(),
          absl::StrCat(
              "group=", job.group, " module=", job.module, " unit=", u, " rank=", job.rank,
              " state=", i < job.state_names.size() ? job.state_names[i] : std::to_string(i),
              " host copy"),
          job.owner_uid, Placement::Host());
      FS_RETURN_IF_ERROR(host.status());
      if (from.on_device()) {
        FS_RETURN_IF_ERROR(devices_.CopyEach(job.rank, {&from}, {host->get()}));
      } else {
        CopyHost(from, **host);
      }
      *bytes += (*host)->bytes();
      job.host_state[u].push_back(*std::move(host));
    }
  }
  return absl::OkStatus();
}

absl::Status Records::CheckStateComplete(Registered& reg, int32_t rank, const std::string& where) {
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
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": some but not all of its optimizer state buffers are recorded: ", n,
                   " missing (", absl::StrJoin(missing, ", "), n > kNamed ? ", ..." : "",
                   "); never adopted without its whole state"));
}

absl::Status Records::StateFromHost(Registered& reg, const state::GroupRecord& rec,
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
          return absl::Status(
              s.code(),
              absl::StrCat("module ", Display(module), " rank ", rank, " unit ", u, " state \"",
                           reg.state_specs[i].name, "\": back to the device: ", s.message()));
        }
        (committed ? reg.committed_state[rank][u] : shards[u].state).push_back(*std::move(b));
      }
    }
  }
  return absl::OkStatus();
}

AdoptSummary Records::AdoptGroups(const std::vector<state::GroupRecord>& records) {
  AdoptSummary summary;
  recorded_segments_.clear();
  for (const state::GroupRecord& rec : records) {
    for (const state::ModuleRecord& m : rec.modules) {
      for (const state::RankRecord& rr : m.ranks) {
        for (const state::UnitRecord& u : rr.units) {
          for (const state::BufferRecord& b : u.buffers) recorded_segments_.insert(b.segment);
        }
      }
    }
  }
  for (const state::GroupRecord& rec : records) AdoptGroup(rec, &summary);
  recorded_segments_.clear();
  FS_LOG(INFO) << "restart: adopted " << summary.groups << " group(s), " << summary.modules
               << " module(s), " << summary.buffers << " buffers, " << summary.bytes
               << " bytes; refused " << summary.refused_groups << " record(s); "
               << summary.lost_modules << " module(s) lost";
  return summary;
}

void Records::AdoptGroup(const state::GroupRecord& rec, AdoptSummary* summary) {
  const std::string dir = state_dir_ != nullptr ? state_dir_->path() : std::string("(none)");
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
  std::vector<std::string> lines;
  for (const state::ModuleRecord& m : rec.modules) {
    absl::Status refused = AdoptModule(rec, m, *g, &adopted, &lines, summary);
    if (!refused.ok()) {
      // Left alone: a refused record's segments are not ours to remove.
      for (const std::shared_ptr<Buffer>& b : adopted) b->Disown();
      FS_LOG(ERROR) << "state record " << file << " of group " << rec.id
                    << " refused, group not adopted (its segments are left alone): "
                    << refused.message();
      ++summary->refused_groups;
      return;
    }
  }
  if (g->registered.empty() && g->lost.empty()) {
    FS_LOG(INFO) << "group=" << rec.id << ": nothing to adopt from " << file;
    if (state_dir_ != nullptr) state_dir_->Remove(rec.id, rec.sequence).IgnoreError();
    return;
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
  FS_LOG(INFO) << "group=" << rec.id << " adopted from " << file << ": " << g->registered.size()
               << " module(s) " << absl::StrJoin(lines, ", ") << ", " << count << " buffers, "
               << live << " bytes"
               << (g->lost.empty() ? "" : absl::StrCat(", ", g->lost.size(), " lost"));
  ++summary->groups;
  summary->modules += static_cast<int32_t>(g->registered.size());
  summary->bytes += live;
  summary->buffers += count;
  AfterUnlock run;
  table_.Insert(held);
  PersistLater(*g, &run);  // the restored state, with no commit under way
  lock.Release();
  run.Run();
}

absl::Status Records::AdoptModule(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                  Group& g, std::vector<std::shared_ptr<Buffer>>* adopted,
                                  std::vector<std::string>* lines, AdoptSummary* summary) {
  const std::string where = absl::StrCat("module ", Display(m.name));
  absl::StatusOr<Plan> plan = PlanFromJson(m.plan_json);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": plan: ", plan.status().message()));
  }
  absl::StatusOr<Manifest> manifest = ManifestFromJson(m.manifest_json);
  if (!manifest.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": manifest: ", manifest.status().message()));
  }
  if (plan->world_size != rec.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the plan is for world size ",
                                                   plan->world_size, ", the group has ",
                                                   rec.world_size));
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
    FS_RETURN_IF_ERROR(AdoptRankBuffers(rec, m, rr, where, reg, adopted));
  }
  std::set<int32_t> from_host;
  FS_RETURN_IF_ERROR(DeviceCopiesFromHost(rec, m, where, reg, &from_host));
  // Before the kept buffers: a deferred copy's segment is often one of them.
  if (absl::Status s = FinishDeferredCopies(rec, m, reg, adopted); !s.ok()) {
    std::string why = absl::StrCat("group ", rec.id, ": module ", Display(m.name),
                                   " lost: after the daemon restarted ", s.message(),
                                   "; register it afresh on every rank");
    FS_LOG(WARNING) << why;
    g.lost[m.name] = std::move(why);
    ++summary->lost_modules;
    return absl::OkStatus();
  }
  AdoptKeptBuffers(rec, m, reg, adopted);

  std::vector<int32_t> ranks;
  for (const state::RankRecord& rr : m.ranks) ranks.push_back(rr.rank);
  if (!FinishCommitUnderWay(rec, m, ranks, reg)) return absl::OkStatus();
  if (!reg.initialized) return absl::OkStatus();  // its buffers go: it was never initialised
  // A registration of zeros installs (and records) one local rank at a time: a kill between
  // two leaves an initialised record without some local rank, which could then neither
  // re-attach nor register (ALREADY_EXISTS). Nothing was committed on it yet (generation 0,
  // zeros everywhere), so it is not adopted, as when no rank's install was recorded: every
  // rank registers it again (other daemons undo theirs at the re-form, init_undo.cc).
  std::vector<int32_t> missing;
  for (int32_t r : rec.local_ranks) {
    if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) missing.push_back(r);
  }
  if (!missing.empty()) {
    bool untrained = m.voted == 0 && !m.pending.has_value();
    for (int32_t r : ranks) untrained = untrained && reg.generation[r] == 0;
    if (untrained) {
      FS_LOG(WARNING) << "group=" << rec.id << ": module " << Display(m.name)
                      << " not adopted: its registration was recorded for "
                      << internal::RankListText(ranks) << " but not for "
                      << internal::RankListText(missing)
                      << " (the daemon died between their installs); every rank registers it "
                         "again";
      return absl::OkStatus();
    }
    std::string why =
        absl::StrCat("group ", rec.id, ": module ", Display(m.name),
                     " lost: after the daemon restarted its record holds no shards "
                     "of local ",
                     internal::RankListText(missing), "; register it afresh on every rank");
    FS_LOG(WARNING) << why;
    g.lost[m.name] = std::move(why);
    ++summary->lost_modules;
    return absl::OkStatus();
  }
  // Ranks that voted for a Commit the kill left undecided keep their shards: the first
  // formation rolls them forward or back (commit_votes.cc).
  reg.voted.assign(rec.world_size, 0);
  std::set<int32_t> voted;
  if (m.voted != 0) {
    for (int32_t r : ranks) {
      // A GPU rank's shards died with the daemon: its host copy is the committed one.
      if (from_host.contains(r) || reg.generation[r] + 1 != m.voted) continue;
      reg.voted[r] = m.voted;
      voted.insert(r);
    }
    if (!voted.empty()) reg.voted_commit = m.voted;
  }
  std::map<uint64_t, std::vector<int32_t>> by_generation;
  for (int32_t r : ranks) by_generation[reg.generation[r]].push_back(r);
  if (by_generation.size() > 1 && !internal::MixedGenerations(reg).empty()) {
    std::vector<std::string> parts;
    for (const auto& [gen, rs] : by_generation) {
      parts.push_back(absl::StrCat(internal::RankListText(rs), ": generation ", gen));
    }
    std::string why = absl::StrCat(
        "group ", rec.id, ": module ", Display(m.name),
        " lost: after the daemon restarted its ranks hold different committed generations (",
        absl::StrJoin(parts, "; "),
        "): it died between their copies of one commit; register it afresh on every rank");
    FS_LOG(WARNING) << why;
    g.lost[m.name] = std::move(why);
    ++summary->lost_modules;
    return absl::OkStatus();
  }
  // The shards are adopted as they lie, uncopied: a writeback or an optimizer step may have
  // torn them, and a trainer that missed the kill may still write into them, so the group's
  // first formation restores them from the committed copies (rollback_due below; a voted
  // rank is rolled forward or back there) before any rank re-joins. Copying them here too
  // would only double the restart's bytes; a kill before that formation finds the same
  // record, and the next daemon adopts it the same way.
  const uint64_t generation = ranks.empty() ? 0 : reg.generation[ranks.front()];
  lines->push_back(absl::StrCat(Display(m.name), " (", units, " units, ranks ",
                                absl::StrJoin(ranks, ","), ", generation ", generation,
                                voted.empty() ? "" : absl::StrCat(", voted ", m.voted), ")"));
  // A trainer that has not noticed the kill may still write into these shards: the
  // group owes a rollback at its first formation and every adopted rank is stale until
  // it reads its views after it (mixfix).
  for (int32_t r : ranks) reg.stale[r] = true;
  g.rollback_due = true;
  g.registered.emplace(m.name, std::move(reg));
  return absl::OkStatus();
}

absl::Status Records::FinishDeferredCopies(const state::GroupRecord& rec,
                                           const state::ModuleRecord& m, Registered& reg,
                                           std::vector<std::shared_ptr<Buffer>>* adopted) {
  // A writeback End answered before these parts of its committed copies were copied from its
  // summon buffers (state::DeferredRecord); its trainer may have stepped the shard since, so
  // only those segments hold them. Without them the committed copy is torn: a named loss.
  std::map<std::string, std::shared_ptr<Buffer>> segments;
  int64_t bytes = 0;
  for (const state::DeferredRecord& d : m.deferred) {
    const std::string what =
        absl::StrCat("rank ", d.rank, " unit ", d.unit, "'s committed copy of generation ",
                     d.generation, " was still to be copied from summon segment ", d.segment);
    if (d.rank < 0 || d.rank >= static_cast<int32_t>(reg.generation.size()) ||
        reg.generation[d.rank] != d.generation) {
      continue;  // superseded: a later commit's copy of the rank is recorded done
    }
    const std::vector<std::shared_ptr<Buffer>>& committed = reg.committed[d.rank];
    if (d.unit >= static_cast<int32_t>(committed.size()) || committed[d.unit] == nullptr ||
        committed[d.unit]->on_device() || d.dst_offset + d.bytes > committed[d.unit]->bytes()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ", at offset ", d.dst_offset, ", ", d.bytes,
                       " bytes: not inside the rank's recorded committed copy"));
    }
    std::shared_ptr<Buffer>& from = segments[d.segment];
    if (from == nullptr) {
      absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Adopt(
          static_cast<BufferKind>(d.kind), d.segment, d.segment_bytes,
          absl::StrCat("group=", rec.id, " module=", m.name, " deferred copy"), rec.owner_uid);
      if (!b.ok()) {
        return absl::Status(b.status().code(), absl::StrCat(what, ", which cannot be read (",
                                                            b.status().message(), ")"));
      }
      from = *std::move(b);
    }
    std::memcpy(static_cast<char*>(committed[d.unit]->data()) + d.dst_offset,
                static_cast<const char*>(from->data()) + d.src_offset,
                static_cast<size_t>(d.bytes));
    bytes += d.bytes;
  }
  for (auto& [name, b] : segments) {
    // A kept buffer's segment is adopted as such next (AdoptKeptBuffers); another goes once
    // the restored record, without the entries, is written (AdoptGroup drops `adopted` last).
    const bool kept = std::any_of(m.kept.begin(), m.kept.end(),
                                  [&](const state::KeptRecord& k) { return k.segment == name; });
    if (kept) {
      b->Disown();
    } else {
      adopted->push_back(b);
    }
  }
  if (bytes > 0) {
    FS_LOG(INFO) << "group=" << rec.id << " module=" << Display(m.name) << ": finished "
                 << m.deferred.size() << " deferred copy(ies) into committed copies from "
                 << segments.size() << " summon segment(s), " << bytes << " bytes";
  }
  return absl::OkStatus();
}

void Records::AdoptKeptBuffers(const state::GroupRecord& rec, const state::ModuleRecord& m,
                               Registered& reg, std::vector<std::shared_ptr<Buffer>>* adopted) {
  // Not part of the committed state: one that cannot be adopted (gone, resized) is skipped,
  // and the first summon allocates a fresh one as it would have.
  int64_t bytes = 0;
  for (const state::KeptRecord& k : m.kept) {
    if (recorded_segments_.contains(k.segment)) continue;  // stale: another buffer's name now
    // Gone (a SIGTERM unlinks them, --keep_shards or not): nothing to say.
    struct stat st;
    if (::stat(absl::StrCat("/dev/shm", k.segment).c_str(), &st) != 0) continue;
    // Decommitted before the kill (idle): mapping it would allocate its pages here, at the
    // restart, for nothing; it goes, and the first summon allocates one as it would have.
    if (static_cast<int64_t>(st.st_blocks) * 512 < k.bytes) {
      ::shm_unlink(k.segment.c_str());
      continue;
    }
    // Mapped without MAP_POPULATE: the restart's cost stays independent of these bytes; a
    // durable worker faults them in meanwhile (PrefaultKept).
    absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Adopt(
        static_cast<BufferKind>(k.kind), k.segment, k.bytes,
        absl::StrCat("group=", rec.id, " module=", m.name, " kept unit=", k.unit), rec.owner_uid,
        /*populate=*/false);
    if (!b.ok()) {
      FS_LOG(WARNING) << "group=" << rec.id << " module=" << Display(m.name)
                      << ": kept buffer not adopted (the first summon allocates one): "
                      << b.status();
      continue;
    }
    adopted->push_back(*b);
    bytes += k.bytes;
    if (workers_ != nullptr && k.bytes > 0) {
      workers_->Post("(kept prefault)",
                     [weak = std::weak_ptr<Buffer>(*b), data = static_cast<char*>((*b)->data()),
                      n = k.bytes] { PrefaultKept(weak, data, n); });
    }
    reg.adopted_kept.emplace_back(
        KeptKey{static_cast<KeptOwner>(k.owner), k.rank, k.unit, static_cast<KeptUse>(k.use)},
        *std::move(b));
  }
  if (!reg.adopted_kept.empty()) {
    FS_LOG(INFO) << "group=" << rec.id << " module=" << Display(m.name) << ": adopted "
                 << reg.adopted_kept.size() << " kept summon buffer(s), " << bytes << " bytes";
  }
}

absl::Status Records::AdoptRankBuffers(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                       const state::RankRecord& rr, const std::string& where,
                                       Registered& reg,
                                       std::vector<std::shared_ptr<Buffer>>* adopted) {
  const int32_t units = static_cast<int32_t>(reg.plan.units.size());
  const std::string rw = absl::StrCat(where, " rank ", rr.rank);
  if (static_cast<int32_t>(rr.units.size()) != units) {
    return absl::InvalidArgumentError(
        absl::StrCat(rw, ": ", rr.units.size(), " units recorded, the plan has ", units));
  }
  reg.shards_by_rank[rr.rank].resize(units);
  reg.committed[rr.rank].resize(units);
  reg.host_committed[rr.rank].resize(units);
  reg.generation[rr.rank] = rr.generation;
  for (const state::UnitRecord& ur : rr.units) {
    if (ur.unit < 0 || ur.unit >= units) {
      return absl::InvalidArgumentError(
          absl::StrCat(rw, ": unit ", ur.unit, " is not in the plan"));
    }
    reg.shards_by_rank[rr.rank][ur.unit].unit = ur.unit;
    for (const state::BufferRecord& b : ur.buffers) {
      const std::string bw = absl::StrCat(rw, " unit ", ur.unit, " ", b.role, " ", b.segment);
      FS_RETURN_IF_ERROR(CheckRecordedSize(reg, ur.unit, b, bw));
      absl::StatusOr<std::shared_ptr<Buffer>> buffer =
          store_->Adopt(KindOfRole(b.role), b.segment, b.bytes,
                        absl::StrCat("group=", rec.id, " module=", m.name, " unit=", ur.unit,
                                     " rank=", rr.rank, " ", b.role),
                        rec.owner_uid);
      if (!buffer.ok()) {
        return absl::Status(buffer.status().code(),
                            absl::StrCat(bw, ": ", buffer.status().message()));
      }
      adopted->push_back(*buffer);
      if (!InstallDurable(reg, rr.rank, ur.unit, b.role, *std::move(buffer))) {
        return absl::InvalidArgumentError(
            absl::StrCat(bw, ": role ", b.role, " is unknown to this daemon"));
      }
    }
    const bool host_copy = reg.host_committed[rr.rank][ur.unit] != nullptr;
    if (!host_copy && (reg.shards_by_rank[rr.rank][ur.unit].shard == nullptr ||
                       reg.committed[rr.rank][ur.unit] == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(rw, " unit ", ur.unit, ": no shard or no committed copy recorded"));
    }
    if (host_copy && !devices_.PlacementOf(rr.rank).on_device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          rw, " unit ", ur.unit, ": a GPU daemon's host copy, but this daemon keeps rank ", rr.rank,
          " in host memory (start it with the same --gpus)"));
    }
  }
  return CheckStateComplete(reg, rr.rank, rw);
}

absl::Status Records::CheckRecordedSize(const Registered& reg, int32_t unit,
                                        const state::BufferRecord& b, const std::string& bw) {
  const PlanUnit& pu = reg.plan.units[unit];
  for (const char* prefix : {state::kRoleStatePrefix, state::kRoleCommittedStatePrefix,
                             state::kRoleHostCommittedStatePrefix}) {
    if (!absl::StartsWith(b.role, prefix)) continue;
    const int state = StateIndex(b.role, prefix, reg.state_specs);
    if (state < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(bw, ": the module's recorded optimizer state spec has no state \"",
                       b.role.substr(std::strlen(prefix)), "\""));
    }
    const StateSpec& spec = reg.state_specs[state];
    const int64_t state_want = spec.Numel(pu.shard_numel) * ItemSize(spec.dtype);
    if (b.bytes != state_want) {
      return absl::InvalidArgumentError(absl::StrCat(
          bw, ": ", b.bytes, " bytes recorded, optimizer state \"", spec.name, "\" (",
          DTypeName(spec.dtype), ", ", StateShapeName(spec.shape), ") has ", state_want));
    }
    return absl::OkStatus();
  }
  const int64_t want = pu.shard_numel * ItemSize(pu.dtype);
  if (b.bytes != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(bw, ": ", b.bytes, " bytes recorded, the plan's shard has ", want));
  }
  return absl::OkStatus();
}

absl::Status Records::DeviceCopiesFromHost(const state::GroupRecord& rec,
                                           const state::ModuleRecord& m, const std::string& where,
                                           Registered& reg, std::set<int32_t>* from_host) {
  // GPU daemons: fresh device shards and committed copies from the host copies a SIGTERM
  // made (KeepDeviceShards); the host copies go once this module is in place.
  const int32_t units = static_cast<int32_t>(reg.plan.units.size());
  for (const state::RankRecord& rr : m.ranks) {
    if (reg.host_committed[rr.rank].empty() || reg.host_committed[rr.rank][0] == nullptr) {
      continue;
    }
    for (int32_t u = 0; u < units; ++u) {
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
          return absl::Status(s.code(), absl::StrCat(where, " rank ", rr.rank, " unit ", u,
                                                     ": back to the device: ", s.message()));
        }
        *slot = *std::move(b);
      }
    }
    FS_RETURN_IF_ERROR(StateFromHost(reg, rec, m.name, rr.rank));
    from_host->insert(rr.rank);
    if (KeepsHostCopies()) {
      // Still the recorded complete copy: a kill before the next commit's copy finds it.
      reg.host_generation.resize(reg.committed.size(), 0);
      reg.host_generation[rr.rank] = rr.generation;
    } else {
      reg.host_committed[rr.rank].clear();
      if (static_cast<size_t>(rr.rank) < reg.host_committed_state.size()) {
        reg.host_committed_state[rr.rank].clear();
      }
    }
  }
  return absl::OkStatus();
}

bool Records::FinishCommitUnderWay(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                   const std::vector<int32_t>& ranks, Registered& reg) {
  // Commits under way at the kill (see the top of this file).
  if (!m.pending.has_value()) return true;
  const state::PendingCommit& p = *m.pending;
  std::vector<int32_t> torn;
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
  if (p.kind != "init") return true;
  if (torn.empty()) {
    reg.initialized = true;
    return true;
  }
  FS_LOG(WARNING) << "group=" << rec.id << " module=" << Display(m.name)
                  << ": its initialisation did not finish on " << internal::RankListText(torn)
                  << " before the daemon died: not adopted (registering it again runs the "
                     "initialisation)";
  return false;  // its buffers go: it was never initialised
}

}  // namespace flatshard::server
