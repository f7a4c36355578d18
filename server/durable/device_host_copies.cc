// DeviceHostCopies: a host copy of each GPU module's committed generation, made off the RPC
// path and recorded once complete (see the header).

#include "server/durable/device_host_copies.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/after_unlock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/generations.h"

ABSL_FLAG(bool, gpu_host_copies, true,
          "GPU daemons with a state directory: after each change of a module's committed "
          "generation, copy its committed device shards and optimizer state to host shared "
          "memory (asynchronously, two slots per rank: 2x the committed bytes) and record it, "
          "so that a restart after kill -9 resumes from the newest complete copy");
ABSL_FLAG(std::string, testing_pause_host_copy, "",
          "testing only: G:DURATION pauses the host copy of generation G for DURATION once "
          "its first local rank's copy is written (the others' not yet, nothing recorded)");

namespace flatshard::server {

using internal::Display;

namespace {

void PauseIfTesting(const std::string& group, const std::string& module, uint64_t generation) {
  static const std::pair<uint64_t, absl::Duration> pause = [] {
    std::pair<uint64_t, absl::Duration> p{0, absl::ZeroDuration()};
    const std::string v = absl::GetFlag(FLAGS_testing_pause_host_copy);
    std::vector<std::string> parts = absl::StrSplit(v, absl::MaxSplits(':', 1));
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &p.first) ||
        !absl::ParseDuration(parts[1], &p.second)) {
      if (!v.empty()) FS_LOG(ERROR) << "--testing_pause_host_copy=" << v << " ignored";
      return std::pair<uint64_t, absl::Duration>{0, absl::ZeroDuration()};
    }
    return p;
  }();
  if (pause.second == absl::ZeroDuration() || pause.first != generation) return;
  FS_LOG(WARNING) << "testing: host copy of group=" << group << " module=" << Display(module)
                  << " generation " << generation << " paused for "
                  << absl::FormatDuration(pause.second);
  absl::SleepFor(pause.second);
}

bool OnDevice(const std::vector<std::shared_ptr<Buffer>>& v) {
  return !v.empty() && v[0] != nullptr && v[0]->on_device();
}

}  // namespace

// One module's copy: per local rank, the committed device buffers (held still by ckpt_hold)
// and the spare slot they are copied into.
struct DeviceHostCopies::Job {
  std::string group, module;
  uint64_t generation = 0;
  int64_t owner_uid = -1;
  std::vector<std::string> state_names;
  std::vector<int32_t> ranks;
  std::vector<std::vector<std::shared_ptr<Buffer>>> committed, spare;  // [rank][unit]
  // [rank][unit][state]
  std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>> committed_state, spare_state;
  int64_t bytes = 0;
};

DeviceHostCopies::DeviceHostCopies(Options options)
    : records_(options.records),
      store_(options.store),
      devices_(*options.devices),
      table_(*options.table),
      enabled_(options.enabled && absl::GetFlag(FLAGS_gpu_host_copies)) {
  if (enabled_) thread_ = std::thread([this] { Loop(); });
}

DeviceHostCopies::~DeviceHostCopies() { Stop(); }

void DeviceHostCopies::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    queue_.clear();
    queued_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

void DeviceHostCopies::NoteCopiesDoneLocked(Group& g, const std::string& module, Registered& reg) {
  if (!enabled_ || !reg.initialized || reg.busy > 0) return;
  bool due = false;
  for (int32_t r : g.local_ranks) {
    if (r >= static_cast<int32_t>(reg.committed.size()) || !OnDevice(reg.committed[r])) continue;
    const bool copied = r < static_cast<int32_t>(reg.host_committed.size()) &&
                        !reg.host_committed[r].empty() &&
                        r < static_cast<int32_t>(reg.host_generation.size()) &&
                        reg.host_generation[r] == reg.generation[r];
    if (!copied) due = true;
  }
  if (!due) return;
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  // Coalesced: a module already queued is copied once, at its newest generation.
  if (queued_.emplace(g.id, module).second) queue_.emplace_back(g.id, module);
}

void DeviceHostCopies::ReplacedLocked(Registered& reg, int32_t rank) {
  const size_t r = static_cast<size_t>(rank);
  if (r >= reg.host_committed.size() || reg.host_committed[r].empty()) return;
  if (reg.host_spare.size() <= r) reg.host_spare.resize(r + 1);
  if (reg.host_spare_state.size() <= r) reg.host_spare_state.resize(r + 1);
  reg.host_spare[r] = std::move(reg.host_committed[r]);
  reg.host_committed[r].clear();
  if (r < reg.host_spare_generation.size()) reg.host_spare_generation[r] = -1;
  if (r < reg.host_committed_state.size()) {
    reg.host_spare_state[r] = std::move(reg.host_committed_state[r]);
    reg.host_committed_state[r].clear();
  }
}

void DeviceHostCopies::Loop() {
  for (;;) {
    std::pair<std::string, std::string> next;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &DeviceHostCopies::Ready));
      if (stopped_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      queued_.erase(next);
    }
    CopyModule(next.first, next.second);
  }
}

void DeviceHostCopies::CopyModule(const std::string& group, const std::string& module) {
  Job job;
  job.group = group;
  job.module = module;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    auto it = g.registered.find(module);
    if (it == g.registered.end()) return;
    Registered& reg = it->second;
    // A copy into the committed copies in flight, or ranks between two generations: the
    // copy that ends it asks again (NoteCopiesDoneLocked).
    if (!reg.initialized || reg.busy > 0 || reg.rollback_pending || reg.pending_commit) return;
    uint64_t lo = UINT64_MAX, hi = 0;
    bool due = false;
    for (int32_t r : g.local_ranks) {
      if (r >= static_cast<int32_t>(reg.committed.size()) || !OnDevice(reg.committed[r])) {
        continue;
      }
      lo = std::min(lo, reg.generation[r]);
      hi = std::max(hi, reg.generation[r]);
      job.ranks.push_back(r);
      due = due || r >= static_cast<int32_t>(reg.host_committed.size()) ||
            reg.host_committed[r].empty() ||
            r >= static_cast<int32_t>(reg.host_generation.size()) ||
            reg.host_generation[r] != reg.generation[r];
    }
    if (job.ranks.empty() || lo != hi || !due) return;
    job.generation = lo;
    job.owner_uid = g.owner_uid;
    for (const StateSpec& spec : reg.state_specs) job.state_names.push_back(spec.name);
    const size_t n = reg.committed.size();
    reg.host_spare.resize(n);
    reg.host_spare_state.resize(n);
    reg.host_spare_generation.resize(n, -1);
    for (int32_t r : job.ranks) {
      reg.host_spare_generation[r] = -1;  // being written: no re-form falls back to it
      job.committed.push_back(reg.committed[r]);
      job.committed_state.push_back(r < static_cast<int32_t>(reg.committed_state.size())
                                        ? reg.committed_state[r]
                                        : std::vector<std::vector<std::shared_ptr<Buffer>>>{});
      job.spare.push_back(std::move(reg.host_spare[r]));
      job.spare_state.push_back(std::move(reg.host_spare_state[r]));
      reg.host_spare[r].clear();
      reg.host_spare_state[r].clear();
    }
    ++reg.ckpt_hold;  // the committed copies stay still: a commit waits in after_ckpt
  }
  const absl::Time start = absl::Now();
  absl::Status s = CopyToSpare(job);
  AfterUnlock run;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    auto it = g.registered.find(module);
    if (it == g.registered.end()) return;
    Registered& reg = it->second;
    // A roll forward (the only other writer of the committed copies: it takes `busy`, not
    // the hold) ran during the copy, or a rank registered afresh (other buffers): the copy
    // may mix two generations or be of the old buffers, never swapped in.
    for (size_t i = 0; i < job.ranks.size(); ++i) {
      const int32_t r = job.ranks[i];
      if (reg.busy > 0 || reg.generation[r] != job.generation ||
          reg.committed[r] != job.committed[i]) {
        s = absl::AbortedError("the committed copies changed during the copy");
      }
    }
    const size_t n = reg.committed.size();
    reg.host_committed.resize(n);
    reg.host_committed_state.resize(n);
    reg.host_generation.resize(n, 0);
    reg.host_spare.resize(n);
    reg.host_spare_state.resize(n);
    reg.host_spare_generation.resize(n, -1);
    for (size_t i = 0; i < job.ranks.size(); ++i) {
      const int32_t r = job.ranks[i];
      if (s.ok()) {
        // The complete copy becomes the recorded slot; the previous one the spare, which still
        // holds its generation completely: a re-form rolls back to it when another daemon's
        // copy of this generation never completed (internal::HostFallback).
        reg.host_spare_generation[r] =
            reg.host_committed[r].empty() ? -1 : static_cast<int64_t>(reg.host_generation[r]);
        std::swap(reg.host_committed[r], job.spare[i]);
        std::swap(reg.host_committed_state[r], job.spare_state[i]);
        reg.host_generation[r] = job.generation;
      }
      reg.host_spare[r] = std::move(job.spare[i]);
      reg.host_spare_state[r] = std::move(job.spare_state[i]);
    }
    // The commits that waited for the copy go on first (their copies do not touch the host
    // slots), then the record naming the new slot is written.
    if (--reg.ckpt_hold == 0) {
      for (auto& f : reg.after_ckpt) run.Call(std::move(f));
      reg.after_ckpt.clear();
    }
    if (s.ok()) records_->PersistModuleLater(g, module, &run);
  }
  if (!s.ok()) {
    FS_LOG(ERROR) << "group=" << group << " module=" << Display(module)
                  << ": host copy of generation " << job.generation
                  << " failed (the previous host copy stays recorded): " << s;
    run.Run();
    return;
  }
  run.Run();  // the record is written (fsync'd) when this returns
  FS_LOG(INFO) << "group=" << group << " module=" << Display(module) << ": host copy of generation "
               << job.generation << " recorded (" << job.ranks.size() << " rank(s), " << job.bytes
               << " bytes, " << absl::FormatDuration(absl::Now() - start) << ")";
}

absl::Status DeviceHostCopies::CopyToSpare(Job& job) {
  auto fit = [&](std::shared_ptr<Buffer>& slot, const Buffer& from,
                 const std::string& label) -> absl::Status {
    if (slot != nullptr && slot->bytes() == from.bytes()) return absl::OkStatus();
    absl::StatusOr<std::shared_ptr<Buffer>> b =
        store_->Allocate(BufferKind::kShard, from.bytes(), label, job.owner_uid, Placement::Host());
    FS_RETURN_IF_ERROR(b.status());
    slot = *std::move(b);
    return absl::OkStatus();
  };
  for (size_t i = 0; i < job.ranks.size(); ++i) {
    const int32_t rank = job.ranks[i];
    const std::string where = absl::StrCat("group=", job.group, " module=", job.module);
    std::vector<std::shared_ptr<Buffer>>& spare = job.spare[i];
    spare.resize(job.committed[i].size());
    std::vector<const Buffer*> from, to;
    for (size_t u = 0; u < spare.size(); ++u) {
      FS_RETURN_IF_ERROR(fit(spare[u], *job.committed[i][u],
                             absl::StrCat(where, " unit=", u, " rank=", rank, " host copy")));
      from.push_back(job.committed[i][u].get());
      to.push_back(spare[u].get());
      job.bytes += spare[u]->bytes();
    }
    const auto& state = job.committed_state[i];
    auto& spare_state = job.spare_state[i];
    spare_state.resize(state.size());
    for (size_t u = 0; u < state.size(); ++u) {
      spare_state[u].resize(state[u].size());
      for (size_t k = 0; k < state[u].size(); ++k) {
        if (state[u][k] == nullptr) continue;
        FS_RETURN_IF_ERROR(
            fit(spare_state[u][k], *state[u][k],
                absl::StrCat(where, " unit=", u, " rank=", rank, " state=",
                             k < job.state_names.size() ? job.state_names[k] : std::to_string(k),
                             " host copy")));
        job.bytes += spare_state[u][k]->bytes();
        if (state[u][k]->on_device()) {
          from.push_back(state[u][k].get());
          to.push_back(spare_state[u][k].get());
        } else if (state[u][k]->bytes() > 0) {
          std::memcpy(spare_state[u][k]->data(), state[u][k]->data(),
                      static_cast<size_t>(state[u][k]->bytes()));
        }
      }
    }
    FS_RETURN_IF_ERROR(devices_.CopyEach(rank, from, to));
    if (i == 0) PauseIfTesting(job.group, job.module, job.generation);  // half written
  }
  return absl::OkStatus();
}

absl::Status DeviceHostCopies::RollBack(const std::string& group, const std::string& module,
                                        uint64_t target, const std::vector<int32_t>& ranks) {
  // Per rank, the host slot's buffers and where they go (kept alive by `hold`).
  std::vector<std::vector<const Buffer*>> from(ranks.size()), to(ranks.size());
  std::vector<std::shared_ptr<Buffer>> hold;
  absl::Status refused;
  bool edited = false;
  records_->EditAndRecord(group, module, [&](Registered& reg) {
    for (int32_t r : ranks) {
      const std::optional<internal::HostSlot> slot = internal::HostFallback(reg, r);
      if (!slot.has_value() || slot->generation != target) {
        refused = absl::FailedPreconditionError(
            absl::StrCat("rank ", r, " holds no complete host copy of generation ", target));
        return false;
      }
    }
    for (size_t i = 0; i < ranks.size(); ++i) {
      const size_t r = static_cast<size_t>(ranks[i]);
      if (internal::HostFallback(reg, r)->spare) {
        std::swap(reg.host_committed[r], reg.host_spare[r]);
        reg.host_committed_state.resize(std::max(reg.host_committed_state.size(), r + 1));
        reg.host_spare_state.resize(std::max(reg.host_spare_state.size(), r + 1));
        std::swap(reg.host_committed_state[r], reg.host_spare_state[r]);
      }
      reg.host_spare_generation[r] = -1;  // the newer copy: of a generation given up
      reg.host_generation[r] = target;    // recorded from here on (SnapshotModuleLocked)
      auto pair = [&](const std::shared_ptr<Buffer>& host, const std::shared_ptr<Buffer>& dst) {
        if (host == nullptr || dst == nullptr) return;
        from[i].push_back(host.get());
        to[i].push_back(dst.get());
        hold.push_back(host);
        hold.push_back(dst);
      };
      for (size_t u = 0; u < reg.host_committed[r].size(); ++u) {
        pair(reg.host_committed[r][u], reg.committed[r][u]);
        pair(reg.host_committed[r][u], reg.shards_by_rank[r][u].shard);
        if (r >= reg.host_committed_state.size() || u >= reg.host_committed_state[r].size()) {
          continue;
        }
        const auto& host = reg.host_committed_state[r][u];
        for (size_t k = 0; k < host.size(); ++k) {
          if (r < reg.committed_state.size() && u < reg.committed_state[r].size() &&
              k < reg.committed_state[r][u].size()) {
            pair(host[k], reg.committed_state[r][u][k]);
          }
          if (k < reg.shards_by_rank[r][u].state.size()) {
            pair(host[k], reg.shards_by_rank[r][u].state[k]);
          }
        }
      }
    }
    edited = true;
    return true;
  });
  if (!refused.ok()) return refused;
  if (!edited) return absl::NotFoundError("the module is gone");
  for (size_t i = 0; i < ranks.size(); ++i) {
    std::vector<const Buffer*> device_from, device_to;
    for (size_t j = 0; j < from[i].size(); ++j) {
      if (to[i][j]->on_device()) {
        device_from.push_back(from[i][j]);
        device_to.push_back(to[i][j]);
      } else if (to[i][j]->bytes() > 0) {  // host optimizer state (a scalar)
        std::memcpy(to[i][j]->data(), from[i][j]->data(), static_cast<size_t>(to[i][j]->bytes()));
      }
    }
    FS_RETURN_IF_ERROR(devices_.CopyEach(ranks[i], device_from, device_to));
  }
  {
    std::shared_ptr<Group> held = table_.FindOrGone(group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    auto it = g.registered.find(module);
    if (g.removed || it == g.registered.end()) return absl::NotFoundError("the module is gone");
    for (int32_t r : ranks) it->second.generation[r] = target;
  }
  FS_LOG(INFO) << "group=" << group << " module=" << Display(module) << " rank(s) "
               << absl::StrJoin(ranks, ",") << " rolled back to generation " << target
               << " from their host copy (another daemon's copy of generation " << target + 1
               << " never completed)";
  return absl::OkStatus();
}

}  // namespace flatshard::server
