// GroupManager: checkpoints of registered modules (README "Checkpoints", issue 14).
//
// What is saved is the committed step: every local rank's committed copies
// (Registered::committed), which all hold one generation whenever no copy into them is in
// flight. A save "holds" the module (Registered::ckpt_hold) once `busy` is 0 (no commit,
// writeback or rollback copying), so from then on the copies stay still: a commit whose
// agreement completes meanwhile queues its copy (Registered::after_ckpt) and runs it once the
// data files are written. The trainers never stop; only a commit that lands during a save
// waits for it. A checkpoint is thus one generation on every rank, never a mix.
//
// A load checks everything first (metadata, every data file's CRC-32C, FQNs, shapes, dtypes)
// with nothing held, then holds the module (and `busy`, which keeps rollbacks out), writes
// every local rank's shards from the source (resharding by FQN and element range), then the
// committed copies from the shards, and sets the generation: a load is a committed step. The
// ranks are marked stale, so each must read its views again before its next commit.
//
// File I/O runs on the caller's thread and on threads started here (one per rank file, at most
// kCheckpointThreads at once), never under mu_. GPU ranks go through host staging buffers
// (HostCopies): a save copies the committed copies to host memory first, a load fills host
// memory and copies it to the device; the committed copies of a load are copied on the device.
// What a GPU daemon keeps across its own death is thus what was last checkpointed.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint/checkpoint.h"
#include "common/checkpoint/param_source.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::Display;

namespace {

constexpr int kCheckpointThreads = 8;

// Runs fn(i) for i in [0, n) on up to kCheckpointThreads threads; the first error wins.
absl::Status ParallelFor(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> results(n);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) results[i] = fn(i);
  };
  const size_t threads = std::min<size_t>(n, kCheckpointThreads);
  std::vector<std::thread> pool;
  for (size_t i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (const absl::Status& s : results) FS_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status CheckSize(const Buffer& b, const PlanUnit& u) {
  if (b.bytes() >= u.shard_numel * ItemSize(u.dtype)) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("unit ", u.index, ": a ", b.bytes(),
                                          "-byte buffer for a shard of ",
                                          u.shard_numel * ItemSize(u.dtype), " bytes"));
}

// A caller who is neither root nor the daemon's uid may only have the daemon write into, or
// read from, a path that caller owns (the directory; for a new directory, its parent; a
// safetensors file): the daemon's privileges must not reach other users' files.
absl::Status CheckOwner(const GroupManager::CheckpointArgs& args, const std::string& path,
                        bool parent_if_missing) {
  if (args.privileged) return absl::OkStatus();
  struct stat st;
  std::string at = path;
  if (::stat(at.c_str(), &st) != 0 && parent_if_missing) {
    at = checkpoint::internal::DirOf(path);
    if (::stat(at.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat(at, ": ", std::strerror(errno)));
    }
  } else if (::stat(at.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(at, ": ", std::strerror(errno)));
  }
  if (args.uid >= 0 && static_cast<int64_t>(st.st_uid) == args.uid) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      at, " belongs to uid ", st.st_uid, ", not to the caller (uid ",
      args.uid < 0 ? std::string("(remote)") : absl::StrCat(args.uid),
      "): the daemon reads and writes checkpoints only in the caller's own directories"));
}

std::vector<const Buffer*> Raw(const std::vector<std::shared_ptr<Buffer>>& v) {
  std::vector<const Buffer*> out;
  for (const auto& b : v) out.push_back(b.get());
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> GroupManager::HostCopies(
    int32_t rank, const std::vector<std::shared_ptr<Buffer>>& buffers, bool copy_in) const {
  bool device = false;
  for (const auto& b : buffers) device |= b != nullptr && b->on_device();
  if (!device) return buffers;
  std::vector<std::shared_ptr<Buffer>> host;
  for (size_t u = 0; u < buffers.size(); ++u) {
    FS_ASSIGN_OR_RETURN(
        std::shared_ptr<Buffer> b,
        store_->Allocate(BufferKind::kStaging, buffers[u]->bytes(),
                         absl::StrCat("checkpoint rank=", rank, " unit=", u), -1,
                         Placement::Host()));
    host.push_back(std::move(b));
  }
  if (copy_in) FS_RETURN_IF_ERROR(devices_.CopyEach(rank, Raw(buffers), Raw(host)));
  return host;
}

struct GroupManager::CheckpointHold {
  std::string group;
  std::string module;
  int32_t world_size = 0;
  Plan plan;
  std::vector<int32_t> ranks;  // the local ranks, ascending
  std::vector<std::vector<UnitShard>> shards;                  // by position in `ranks`
  std::vector<std::vector<std::shared_ptr<Buffer>>> committed;  // by position in `ranks`
  uint64_t generation = 0;  // of every local rank
  Manifest manifest;  // for checkpoint::TiedAliases (computed without mu_)
};

absl::StatusOr<GroupManager::CheckpointHold> GroupManager::HoldForCheckpoint(
    const CheckpointArgs& args, bool load, CheckpointProgress* progress) {
  progress->phase = CheckpointProgress::kWaiting;
  const absl::Time deadline = absl::Now() + args.wait;
  absl::Status last_wait;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return absl::UnavailableError("flatshardd is shutting down");
      auto git = groups_.find(args.group);
      if (git == groups_.end()) {
        return absl::NotFoundError(absl::StrCat("no group ", Truncated(args.group), " here"));
      }
      Group& g = *git->second;
      if (!args.privileged) FS_RETURN_IF_ERROR(internal::CheckUid(g, args.uid));
      auto it = g.registered.find(args.module);
      if (it == g.registered.end()) {
        return absl::NotFoundError(absl::StrCat("group ", g.id, ": module ", Display(args.module),
                                                " is not registered"));
      }
      Registered& reg = it->second;
      if (!reg.initialized) FS_RETURN_IF_ERROR(CheckUsable(g, args.module, reg));
      if (g.multi() || static_cast<int32_t>(g.local_ranks.size()) != g.world_size) {
        return absl::UnimplementedError(absl::StrCat(
            "group ", g.id, " spans several daemons: checkpoints of multi-daemon groups are not "
            "implemented yet (this daemon hosts ", internal::RankListText(g.local_ranks), " of ",
            g.world_size, ")"));
      }
      for (int32_t r : g.local_ranks) {
        if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) ||
            reg.shards_by_rank[r].empty()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "group ", g.id, " rank ", r, " holds no shards of module ", Display(args.module)));
        }
      }
      if (load) {
        for (const auto& [id, open] : g.open_summons) {
          if (open.module == args.module) {
            return absl::FailedPreconditionError(absl::StrCat(
                "group ", g.id, " rank ", open.rank, " has summon ", id, " of module ",
                Display(args.module), " open: end it before loading"));
          }
        }
      }
      uint64_t lo = UINT64_MAX, hi = 0;
      for (int32_t r : g.local_ranks) {
        lo = std::min(lo, reg.generation[r]);
        hi = std::max(hi, reg.generation[r]);
      }
      // A copy into (or out of) the committed copies is in flight, a rollback is due, or a
      // commit has reached some ranks and not yet others: look again shortly.
      const bool still = reg.busy == 0 && !reg.rollback_pending && lo == hi &&
                         (!load || reg.ckpt_hold == 0);
      if (still) {
        ++reg.ckpt_hold;
        if (load) ++reg.busy;  // keeps rollbacks out while the shards are written
        CheckpointHold h;
        h.group = g.id;
        h.module = args.module;
        h.world_size = g.world_size;
        h.plan = reg.plan;
        h.manifest = reg.manifest;
        h.ranks = g.local_ranks;
        for (int32_t r : g.local_ranks) {
          h.shards.push_back(reg.shards_by_rank[r]);
          h.committed.push_back(reg.committed[r]);
        }
        h.generation = lo;
        return h;
      }
      last_wait = absl::DeadlineExceededError(absl::StrCat(
          "group ", g.id, " module ", Display(args.module),
          ": its committed shards did not come to rest within the wait (",
          reg.busy, " copies in flight", reg.rollback_pending ? ", a rollback pending" : "",
          lo != hi ? absl::StrCat(", ranks at generations ", lo, " to ", hi) : std::string(),
          reg.ckpt_hold > 0 ? ", another checkpoint running" : "", ")"));
    }
    if (absl::Now() >= deadline) return last_wait;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

void GroupManager::ReleaseCheckpointHold(const CheckpointHold& hold, bool load,
                                         std::optional<uint64_t> generation) {
  std::vector<absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    auto g = groups_.find(hold.group);
    if (g == groups_.end()) return;
    auto it = g->second->registered.find(hold.module);
    if (it == g->second->registered.end()) return;
    Registered& reg = it->second;
    if (load && generation.has_value()) {
      for (int32_t r : hold.ranks) {
        reg.generation[r] = *generation;
        // Every rank must read its views again before it commits: in-place writes it made on
        // top of the old values must never be committed over the loaded ones.
        reg.stale[r] = true;
      }
    }
    --reg.ckpt_hold;
    if (reg.ckpt_hold == 0) {
      for (auto& f : reg.after_ckpt) run.push_back(std::move(f));
      reg.after_ckpt.clear();
    }
    if (load) DoneCopying(*g->second, reg, &run);
  }
  for (auto& f : run) f();
}

absl::StatusOr<GroupManager::CheckpointResult> GroupManager::SaveCheckpoint(
    const CheckpointArgs& args, CheckpointProgress* progress) {
  if (args.dir.empty() || args.dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory must be an absolute path, got \"",
                     Truncated(args.dir), "\""));
  }
  FS_RETURN_IF_ERROR(CheckOwner(args, args.dir, /*parent_if_missing=*/true));
  FS_RETURN_IF_ERROR(checkpoint::MakeDirs(args.dir));
  const absl::Time start = absl::Now();
  FS_ASSIGN_OR_RETURN(CheckpointHold hold, HoldForCheckpoint(args, /*load=*/false, progress));
  // Overwriting a checkpoint: its metadata goes first (only once the save is sure to start:
  // a refused save leaves the old checkpoint alone), so a save that does not finish leaves an
  // incomplete checkpoint (refused), never old metadata over new data files.
  const std::string meta_path = absl::StrCat(args.dir, "/", checkpoint::kMetadataFile);
  if (::unlink(meta_path.c_str()) == 0) {
    if (absl::Status s = checkpoint::internal::FsyncDir(args.dir); !s.ok()) {
      ReleaseCheckpointHold(hold, /*load=*/false, std::nullopt);
      return s;
    }
  }
  int64_t total = 0;
  for (const PlanUnit& u : hold.plan.units) total += u.shard_numel * ItemSize(u.dtype);
  total *= static_cast<int64_t>(hold.ranks.size());
  progress->total_bytes = total;
  progress->phase = CheckpointProgress::kWriting;
  std::vector<checkpoint::WrittenFile> written(hold.ranks.size());
  absl::Status s = ParallelFor(hold.ranks.size(), [&](size_t i) -> absl::Status {
    // GPU ranks: the committed copies go through host memory first (one staging buffer
    // per unit, for as long as the file is written).
    FS_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Buffer>> host,
                        HostCopies(hold.ranks[i], hold.committed[i], /*copy_in=*/true));
    std::vector<checkpoint::TensorToWrite> tensors;
    for (const PlanUnit& u : hold.plan.units) {
      const Buffer& b = *host[u.index];
      FS_RETURN_IF_ERROR(CheckSize(b, u));
      tensors.push_back({u.index, checkpoint::kShardTensor, u.dtype, b.data(),
                         u.shard_numel * ItemSize(u.dtype)});
    }
    // ---- Optimizer state (branch optstate; the lead adds it here) ----
    // For every named state buffer of (rank hold.ranks[i], unit u), committed with the
    // shards: tensors.push_back({u.index, name, dtype, data, bytes}). The format stores and
    // finds them by (rank, unit, name) (checkpoint::Metadata::FindTensor); a SCALAR state
    // ("step") is a tensor of one element.
    absl::StatusOr<checkpoint::WrittenFile> w = checkpoint::WriteRankFile(
        args.dir, hold.ranks[i], hold.world_size, tensors,
        [progress](int64_t n) { progress->done_bytes += n; });
    if (!w.ok()) return w.status();
    written[i] = *std::move(w);
    return absl::OkStatus();
  });
  // The committed copies are no longer read: commits that waited go on now.
  ReleaseCheckpointHold(hold, /*load=*/false, std::nullopt);
  if (!s.ok()) {
    FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module)
                  << ": checkpoint save to " << args.dir << " failed: " << s;
    return s;
  }
  checkpoint::Metadata meta;
  meta.module = hold.module;
  meta.group = hold.group;
  meta.world_size = hold.world_size;
  meta.generation = hold.generation;
  meta.created = checkpoint::internal::NowText();
  meta.plan = hold.plan;
  meta.tied = checkpoint::TiedAliases(hold.manifest, hold.plan);
  for (checkpoint::WrittenFile& w : written) {
    meta.files.push_back(w.file);
    for (checkpoint::TensorEntry& t : w.tensors) meta.tensors.push_back(std::move(t));
  }
  FS_RETURN_IF_ERROR(checkpoint::WriteMetadata(args.dir, meta));
  progress->phase = CheckpointProgress::kDone;
  CheckpointResult result;
  result.generation = hold.generation;
  result.bytes = meta.total_bytes();
  result.files = static_cast<int32_t>(meta.files.size());
  result.ranks = static_cast<int32_t>(hold.ranks.size());
  FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module)
               << " saved generation " << hold.generation << " to " << args.dir << " ("
               << result.bytes << " bytes, " << result.files << " files, "
               << absl::ToDoubleSeconds(absl::Now() - start) << " s)";
  return result;
}

absl::StatusOr<GroupManager::CheckpointResult> GroupManager::LoadCheckpoint(
    const CheckpointArgs& args, CheckpointProgress* progress) {
  if (args.dir.empty() == args.safetensors.empty()) {
    return absl::InvalidArgumentError(
        "LoadCheckpoint needs exactly one of a checkpoint directory and a safetensors file");
  }
  const std::string& from = args.dir.empty() ? args.safetensors : args.dir;
  if (from[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("the path must be absolute, got \"", Truncated(from), "\""));
  }
  FS_RETURN_IF_ERROR(CheckOwner(args, from, /*parent_if_missing=*/false));
  // 1. Everything that can be checked without the module: the source itself.
  std::optional<checkpoint::Checkpoint> ckpt;
  std::unique_ptr<checkpoint::ParamSource> source;
  int32_t files = 1;
  if (!args.dir.empty()) {
    FS_ASSIGN_OR_RETURN(ckpt, checkpoint::OpenCheckpoint(args.dir));
    progress->phase = CheckpointProgress::kVerifying;
    progress->total_bytes = ckpt->meta.total_bytes();
    FS_RETURN_IF_ERROR(checkpoint::VerifyFiles(
        *ckpt, {}, [progress](int64_t n) { progress->done_bytes += n; }));
    source = checkpoint::CheckpointSource(*ckpt);
    files = static_cast<int32_t>(ckpt->meta.files.size());
  } else {
    absl::StatusOr<std::unique_ptr<checkpoint::ParamSource>> st =
        checkpoint::SafetensorsSource(args.safetensors);
    if (!st.ok()) return absl::FailedPreconditionError(st.status().message());
    source = *std::move(st);
  }
  // 2. The module: hold it, then check the source fits its plan before any shard changes.
  FS_ASSIGN_OR_RETURN(CheckpointHold hold, HoldForCheckpoint(args, /*load=*/true, progress));
  int64_t unused = 0;
  absl::StatusOr<std::vector<checkpoint::Binding>> bindings = checkpoint::Bind(
      *source, hold.plan, &unused, checkpoint::TiedAliases(hold.manifest, hold.plan));
  if (!bindings.ok()) {
    ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot load into group ", hold.group, " module ", Display(hold.module), ": ",
        bindings.status().message()));
  }
  int64_t per_rank = 0;
  for (const PlanUnit& u : hold.plan.units) per_rank += u.shard_numel * ItemSize(u.dtype);
  progress->done_bytes = 0;
  progress->total_bytes = per_rank * static_cast<int64_t>(hold.ranks.size());
  progress->phase = CheckpointProgress::kLoading;
  // 3. Shards first; the committed copies only once every rank's shards are written, so a
  // failure (an I/O error: everything else was checked) restores the shards from them.
  absl::Status s = ParallelFor(hold.ranks.size(), [&](size_t i) -> absl::Status {
    const int32_t rank = hold.ranks[i];
    const int32_t shard_rank = hold.plan.ShardRank(rank);
    std::vector<std::shared_ptr<Buffer>> shards;
    for (const UnitShard& sh : hold.shards[i]) shards.push_back(sh.shard);
    // GPU ranks: filled in host memory, then copied to the device.
    FS_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Buffer>> host,
                        HostCopies(rank, shards, /*copy_in=*/false));
    for (const PlanUnit& u : hold.plan.units) {
      const Buffer& b = *host[u.index];
      FS_RETURN_IF_ERROR(CheckSize(b, u));
      FS_RETURN_IF_ERROR(
          checkpoint::FillShard(*source, *bindings, hold.plan, u.index, shard_rank, b.data()));
      progress->done_bytes += u.shard_numel * ItemSize(u.dtype);
    }
    if (host != shards) FS_RETURN_IF_ERROR(devices_.CopyEach(rank, Raw(host), Raw(shards)));
    // ---- Optimizer state (branch optstate; the lead adds it here) ----
    // A checkpoint saved under the same plan has each named state buffer of (rank, unit)
    // (ckpt->meta.FindTensor(rank, unit, name)): read it with checkpoint::ReadFileRange into
    // the state buffer, and into its committed copy below. Under another plan, SHARD-shaped
    // states reshard exactly like the parameters (a ParamSource over the state's tensors).
    return absl::OkStatus();
  });
  const bool filled = s.ok();
  absl::Status copied = ParallelFor(hold.ranks.size(), [&](size_t i) -> absl::Status {
    std::vector<std::shared_ptr<Buffer>> shards;
    for (const UnitShard& sh : hold.shards[i]) shards.push_back(sh.shard);
    // Host or device alike (a GPU rank's copies stay on its device).
    return filled ? devices_.CopyEach(hold.ranks[i], Raw(shards), Raw(hold.committed[i]))
                  : devices_.CopyEach(hold.ranks[i], Raw(hold.committed[i]), Raw(shards));
  });
  if (s.ok()) s = copied;
  if (!s.ok()) {
    ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
    FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module)
                  << ": load of " << from << " failed (shards restored): " << s;
    return s;
  }
  const uint64_t generation = ckpt.has_value() ? ckpt->meta.generation : hold.generation + 1;
  ReleaseCheckpointHold(hold, /*load=*/true, generation);
  progress->phase = CheckpointProgress::kDone;
  CheckpointResult result;
  result.generation = generation;
  result.bytes = progress->total_bytes;
  result.files = files;
  result.ranks = static_cast<int32_t>(hold.ranks.size());
  result.unused_tensors = unused;
  FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module) << " loaded "
               << from << ": generation " << generation << " on " << result.ranks
               << " local rank(s)";
  return result;
}

}  // namespace flatshard::server
