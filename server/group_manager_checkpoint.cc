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
// Multi-daemon groups: the daemon asked holds and writes its own ranks and asks every other
// daemon of the group (the peer table's addresses; CheckpointPeerService) to do the same into
// the same directory (a shared file system), then writes the metadata. The holds are per
// daemon, so a commit landing between them can leave two daemons at different generations: the
// save is then written again (never given metadata). A load: every daemon loads its own ranks.
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
#include <map>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/checkpoint/checkpoint.h"
#include "common/checkpoint/param_source.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "flatshard/v1/checkpoint_peer.grpc.pb.h"
#include "common/status_macros.h"
#include "server/group_manager_internal.h"
#include <grpcpp/grpcpp.h>

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

// Bytes of one rank's file: its shards and optimizer state.
int64_t RankBytes(const Plan& plan, const std::vector<StateSpec>& specs) {
  int64_t n = 0;
  for (const PlanUnit& u : plan.units) {
    n += u.shard_numel * ItemSize(u.dtype);
    for (const StateSpec& st : specs) n += st.Numel(u.shard_numel) * ItemSize(st.dtype);
  }
  return n;
}

absl::Status CheckStateSize(const Buffer& b, const PlanUnit& u, const StateSpec& st) {
  const int64_t want = st.Numel(u.shard_numel) * ItemSize(st.dtype);
  if (b.bytes() >= want) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("unit ", u.index, ": a ", b.bytes(),
                                          "-byte buffer for optimizer state \"", st.name,
                                          "\" of ", want, " bytes"));
}

// The unit of `meta`'s plan holding the parameter a source knows as `name` (its FQN, a shared
// alias or a tied alias), and that parameter; {-1, null} when none.
std::pair<int32_t, const PlanParam*> SavedParam(const checkpoint::Metadata& meta,
                                                const std::string& name) {
  std::string fqn = name;
  for (const SharedParam& t : meta.tied) {
    if (t.fqn == name) fqn = t.same_as;
  }
  for (const PlanUnit& u : meta.plan.units) {
    for (const SharedParam& sh : u.shared) {
      if (sh.fqn == fqn) fqn = sh.same_as;
    }
  }
  for (const PlanUnit& u : meta.plan.units) {
    for (const PlanParam& p : u.params) {
      if (p.fqn == fqn) return {u.index, &p};
    }
  }
  return {-1, nullptr};
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
  std::vector<std::string> peers;  // multi-daemon groups: the other daemons' peer addresses
  std::string token;
  // Optimizer state (RegisterState): the module's specs (empty: none) and, by position in
  // `ranks`, the live state buffers and their committed copies, unit-major
  // ([unit * state_specs.size() + spec]). Every local rank has them when the specs are set.
  std::vector<StateSpec> state_specs;
  std::vector<std::vector<std::shared_ptr<Buffer>>> state_live;
  std::vector<std::vector<std::shared_ptr<Buffer>>> state_committed;
  int64_t owner_uid = -1;  // the group's (owner of buffers a load allocates)
};

absl::StatusOr<GroupManager::CheckpointHold> GroupManager::HoldForCheckpoint(
    const CheckpointArgs& args, bool load, CheckpointProgress* progress) {
  progress->phase = CheckpointProgress::kWaiting;
  const absl::Time deadline = absl::Now() + args.wait;
  absl::Status last_wait;
  while (true) {
    {
      if (shutdown_) return absl::UnavailableError("flatshardd is shutting down");
      std::shared_ptr<Group> held = GroupOrGone(args.group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (g.removed) {
        return absl::NotFoundError(absl::StrCat("no group ", Truncated(args.group), " here"));
      }
      if (args.from_peer) {
        if (!internal::TokensEqual(args.token, g.token)) {
          return absl::PermissionDeniedError(
              absl::StrCat("group ", g.id, ": wrong token in a checkpoint request of a peer"));
        }
      } else if (!args.privileged) {
        FS_RETURN_IF_ERROR(internal::CheckUid(g, args.uid));
      }
      auto it = g.registered.find(args.module);
      if (it == g.registered.end()) {
        return absl::NotFoundError(absl::StrCat("group ", g.id, ": module ", Display(args.module),
                                                " is not registered"));
      }
      Registered& reg = it->second;
      if (!reg.initialized) FS_RETURN_IF_ERROR(CheckUsable(g, args.module, reg));
      std::vector<std::string> peers;  // the other daemons' peer addresses
      if (g.multi()) {
        if (static_cast<int32_t>(g.table.rank_daemons.size()) != g.world_size || !g.coll) {
          return absl::UnavailableError(absl::StrCat(
              "group ", g.id, " is not formed (every rank must have joined once)"));
        }
        for (int32_t r = 0; r < g.world_size; ++r) {
          const std::string& a = g.table.rank_daemons[r].peer_address;
          if (std::find(g.local_ranks.begin(), g.local_ranks.end(), r) != g.local_ranks.end() ||
              a == self_.peer_address ||
              std::find(peers.begin(), peers.end(), a) != peers.end()) {
            continue;
          }
          peers.push_back(a);
        }
      } else if (static_cast<int32_t>(g.local_ranks.size()) != g.world_size) {
        return absl::FailedPreconditionError(absl::StrCat(
            "group ", g.id, ": not every rank has joined (this daemon hosts ",
            internal::RankListText(g.local_ranks), " of ", g.world_size, ")"));
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
      // Optimizer state: a checkpoint holds every rank's or none, so every local rank must
      // have registered it once the module's spec is fixed.
      for (const StateSpec& st : reg.state_specs) {
        if (st.name == checkpoint::kShardTensor) {
          return absl::FailedPreconditionError(absl::StrCat(
              "group ", g.id, " module ", Display(args.module), ": optimizer state \"",
              st.name, "\" has the name of the parameters' tensor in a checkpoint"));
        }
      }
      for (int32_t r : reg.state_specs.empty() ? std::vector<int32_t>{} : g.local_ranks) {
        const bool has = r < static_cast<int32_t>(reg.committed_state.size()) &&
                         reg.committed_state[r].size() == reg.shards_by_rank[r].size() &&
                         std::all_of(reg.shards_by_rank[r].begin(), reg.shards_by_rank[r].end(),
                                     [&](const UnitShard& sh) {
                                       return sh.state.size() == reg.state_specs.size();
                                     });
        if (!has) {
          return absl::FailedPreconditionError(absl::StrCat(
              "group ", g.id, " rank ", r, " has not registered the optimizer state of module ",
              Display(args.module), " (another rank did): every rank registers it "
              "(RegisterState, keep_optimizer_state) before a checkpoint ", load ? "load" : "save"));
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
        h.peers = std::move(peers);
        h.token = g.token;
        h.state_specs = reg.state_specs;
        h.owner_uid = g.owner_uid;
        for (int32_t r : h.state_specs.empty() ? std::vector<int32_t>{} : g.local_ranks) {
          std::vector<std::shared_ptr<Buffer>> live, kept;
          for (size_t u = 0; u < reg.shards_by_rank[r].size(); ++u) {
            for (size_t k = 0; k < h.state_specs.size(); ++k) {
              live.push_back(reg.shards_by_rank[r][u].state[k]);
              kept.push_back(reg.committed_state[r][u][k]);
            }
          }
          h.state_live.push_back(std::move(live));
          h.state_committed.push_back(std::move(kept));
        }
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
  AfterUnlock run;
  {
    std::shared_ptr<Group> held = GroupOrGone(hold.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    auto it = g.registered.find(hold.module);
    if (it == g.registered.end()) return;
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
      for (auto& f : reg.after_ckpt) run.Call(std::move(f));
      reg.after_ckpt.clear();
    }
    if (load) DoneCopying(g, reg, &run);
    // Restarts: the record holds the loaded generation before the load is answered.
    if (load) LoadRecordedLocked(g, reg, generation.has_value(), &run);
  }
  run.Run();
}

absl::StatusOr<GroupManager::CheckpointResult> GroupManager::SaveCheckpoint(
    const CheckpointArgs& args, CheckpointProgress* progress) {
  if (args.dir.empty() || args.dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory must be an absolute path, got \"",
                     Truncated(args.dir), "\""));
  }
  if (!args.from_peer) FS_RETURN_IF_ERROR(CheckOwner(args, args.dir, /*parent_if_missing=*/true));
  FS_RETURN_IF_ERROR(checkpoint::MakeDirs(args.dir));
  const absl::Time start = absl::Now();
  // A multi-daemon group: each daemon holds and writes its own ranks, so two daemons may hold
  // different generations when a commit lands between their holds. Such a save is written
  // again (never given metadata); the commit goes through between the attempts.
  constexpr int kAttempts = 5;
  for (int attempt = 1;; ++attempt) {
    FS_ASSIGN_OR_RETURN(CheckpointHold hold, HoldForCheckpoint(args, /*load=*/false, progress));
    // Overwriting a checkpoint: its metadata goes first (only once the save is sure to
    // start: a refused save leaves the old checkpoint alone), so a save that does not finish
    // leaves an incomplete checkpoint (refused), never old metadata over new data files.
    const std::string meta_path = absl::StrCat(args.dir, "/", checkpoint::kMetadataFile);
    if (!args.from_peer && ::unlink(meta_path.c_str()) == 0) {
      if (absl::Status s = checkpoint::internal::FsyncDir(args.dir); !s.ok()) {
        ReleaseCheckpointHold(hold, /*load=*/false, std::nullopt);
        return s;
      }
    }
    const int64_t per_rank = RankBytes(hold.plan, hold.state_specs);
    progress->total_bytes = per_rank * (args.from_peer ? static_cast<int64_t>(hold.ranks.size())
                                                       : hold.world_size);
    progress->done_bytes = 0;
    progress->phase = CheckpointProgress::kWriting;
    // The other daemons write their ranks while this one writes its own.
    std::vector<absl::StatusOr<CheckpointResult>> remote;
    std::thread asking;
    if (!args.from_peer && !hold.peers.empty()) {
      asking = std::thread([&] { remote = AskPeers(hold, args, /*load=*/false); });
    }
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
      // Optimizer state: every named state buffer's committed copy (the same step as the
      // committed shard above), as tensor (rank, unit, state name); a SCALAR state is one
      // element. GPU ranks stage it in host memory like the shards.
      std::vector<std::shared_ptr<Buffer>> host_state;
      if (!hold.state_specs.empty()) {
        FS_ASSIGN_OR_RETURN(host_state,
                            HostCopies(hold.ranks[i], hold.state_committed[i], /*copy_in=*/true));
        const size_t n = hold.state_specs.size();
        for (const PlanUnit& u : hold.plan.units) {
          for (size_t k = 0; k < n; ++k) {
            const StateSpec& st = hold.state_specs[k];
            const Buffer& b = *host_state[u.index * n + k];
            FS_RETURN_IF_ERROR(CheckStateSize(b, u, st));
            tensors.push_back({u.index, st.name, st.dtype, b.data(),
                               st.Numel(u.shard_numel) * ItemSize(st.dtype)});
          }
        }
      }
      absl::StatusOr<checkpoint::WrittenFile> w = checkpoint::WriteRankFile(
          args.dir, hold.ranks[i], hold.world_size, tensors,
          [progress](int64_t n) { progress->done_bytes += n; });
      if (!w.ok()) return w.status();
      written[i] = *std::move(w);
      return absl::OkStatus();
    });
    // The committed copies are no longer read: commits that waited go on now.
    ReleaseCheckpointHold(hold, /*load=*/false, std::nullopt);
    if (asking.joinable()) asking.join();
    for (size_t k = 0; k < remote.size() && s.ok(); ++k) {
      if (!remote[k].ok()) {
        s = absl::Status(remote[k].status().code(),
                         absl::StrCat("daemon ", hold.peers[k], " could not write its ranks: ",
                                      remote[k].status().message()));
      }
    }
    if (!s.ok()) {
      FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module)
                    << ": checkpoint save to " << args.dir << " failed: " << s;
      return s;
    }
    CheckpointResult result;
    result.generation = hold.generation;
    result.ranks = static_cast<int32_t>(hold.ranks.size());
    for (checkpoint::WrittenFile& w : written) {
      result.bytes += w.file.bytes;
      result.written_files.push_back(w.file);
      for (checkpoint::TensorEntry& t : w.tensors) result.written_tensors.push_back(std::move(t));
    }
    result.files = static_cast<int32_t>(result.written_files.size());
    if (args.from_peer) return result;
    bool same = true;
    for (const auto& r : remote) {
      same &= r->generation == hold.generation;
      result.written_files.insert(result.written_files.end(), r->written_files.begin(),
                                  r->written_files.end());
      result.written_tensors.insert(result.written_tensors.end(), r->written_tensors.begin(),
                                    r->written_tensors.end());
    }
    if (!same) {
      if (attempt == kAttempts) {
        return absl::AbortedError(absl::StrCat(
            "group ", hold.group, " module ", Display(hold.module), ": the daemons held "
            "different generations in ", kAttempts, " attempts (commits kept landing between "
            "their holds); nothing was given metadata"));
      }
      FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module)
                   << ": daemons held different generations; writing the checkpoint again";
      absl::SleepFor(absl::Milliseconds(20 * attempt));
      continue;
    }
    checkpoint::Metadata meta;
    meta.module = hold.module;
    meta.group = hold.group;
    meta.world_size = hold.world_size;
    meta.generation = hold.generation;
    meta.created = checkpoint::internal::NowText();
    meta.plan = hold.plan;
    meta.tied = checkpoint::TiedAliases(hold.manifest, hold.plan);
    meta.state_specs = hold.state_specs;
    meta.files = std::move(result.written_files);
    meta.tensors = std::move(result.written_tensors);
    std::sort(meta.files.begin(), meta.files.end(),
              [](const auto& a, const auto& b) { return a.rank < b.rank; });
    for (int32_t r = 0; r < hold.world_size; ++r) {
      if (r >= static_cast<int32_t>(meta.files.size()) || meta.files[r].rank != r) {
        return absl::InternalError(absl::StrCat("group ", hold.group, ": no daemon wrote rank ",
                                                r, "'s file"));
      }
    }
    // Every daemon wrote the same optimizer state (each fixes its module's spec on its own):
    // every (rank, unit) has each state of the specs and no other, or no metadata is written.
    {
      std::map<std::pair<int32_t, int32_t>, std::vector<std::string>> names;
      for (const checkpoint::TensorEntry& t : meta.tensors) {
        if (t.name != checkpoint::kShardTensor) names[{t.rank, t.unit}].push_back(t.name);
      }
      std::vector<std::string> want;
      for (const StateSpec& st : meta.state_specs) want.push_back(st.name);
      std::sort(want.begin(), want.end());
      for (int32_t r = 0; r < hold.world_size; ++r) {
        for (const PlanUnit& u : hold.plan.units) {
          std::vector<std::string>& got = names[{r, u.index}];
          std::sort(got.begin(), got.end());
          if (got != want) {
            return absl::FailedPreconditionError(absl::StrCat(
                "group ", hold.group, " module ", Display(hold.module), ": rank ", r,
                " wrote optimizer state [", absl::StrJoin(got, ", "), "] for unit ", u.index,
                ", this daemon's module has [", absl::StrJoin(want, ", "),
                "]: every rank registers the same optimizer state before a save (no metadata "
                "written)"));
          }
        }
      }
    }
    FS_RETURN_IF_ERROR(checkpoint::WriteMetadata(args.dir, meta));
    progress->done_bytes = progress->total_bytes.load();
    progress->phase = CheckpointProgress::kDone;
    CheckpointResult out;
    out.generation = hold.generation;
    out.bytes = meta.total_bytes();
    out.files = static_cast<int32_t>(meta.files.size());
    out.ranks = hold.world_size;
    FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module)
                 << " saved generation " << hold.generation << " to " << args.dir << " ("
                 << out.bytes << " bytes, " << out.files << " files, "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s)";
    return out;
  }
}

std::vector<absl::StatusOr<GroupManager::CheckpointResult>> GroupManager::AskPeers(
    const CheckpointHold& hold, const CheckpointArgs& args, bool load) {
  std::vector<absl::StatusOr<CheckpointResult>> out(hold.peers.size(),
                                                    absl::UnknownError("not asked"));
  std::vector<std::thread> threads;
  for (size_t k = 0; k < hold.peers.size(); ++k) {
    threads.emplace_back([&, k] {
      auto creds = peer_credentials_ ? peer_credentials_ : grpc::InsecureChannelCredentials();
      auto stub = v1::CheckpointPeerService::NewStub(grpc::CreateChannel(hold.peers[k], creds));
      v1::CheckpointRanksRequest request;
      request.set_group(hold.group);
      request.set_token(hold.token);
      request.set_module(hold.module);
      request.set_dir(args.dir);
      request.set_wait_ms(absl::ToInt64Milliseconds(args.wait));
      v1::CheckpointRanksResponse response;
      grpc::ClientContext ctx;
      // The transfer has no deadline of its own; a daemon that dies ends the call.
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + args.wait + absl::Hours(1)));
      const grpc::Status st = load ? stub->LoadRanks(&ctx, request, &response)
                                   : stub->WriteRanks(&ctx, request, &response);
      if (!st.ok()) {
        out[k] = FromGrpcStatus(st);
        return;
      }
      CheckpointResult r;
      r.generation = response.generation();
      r.bytes = response.bytes();
      r.ranks = response.ranks();
      for (const v1::CheckpointFile& f : response.files()) {
        r.written_files.push_back({f.name(), f.rank(), f.bytes(), f.crc32c()});
      }
      for (const v1::CheckpointTensor& t : response.tensors()) {
        r.written_tensors.push_back({t.rank(), t.unit(), t.name(),
                             ParseDType(t.dtype()).value_or(DType::kUInt8), t.offset(),
                             t.bytes()});
      }
      out[k] = std::move(r);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

absl::Status GroupManager::AllocateStateForLoad(CheckpointHold& hold,
                                                const std::vector<StateSpec>& specs) {
  // Allocation (shm creation, device memory) without the lock; the hold keeps the module.
  const size_t n = specs.size();
  std::vector<std::vector<std::shared_ptr<Buffer>>> live(hold.ranks.size()),
      kept(hold.ranks.size());
  for (size_t i = 0; i < hold.ranks.size(); ++i) {
    const int32_t rank = hold.ranks[i];
    const Placement placement = PlacementOf(rank);
    for (const PlanUnit& u : hold.plan.units) {
      for (const StateSpec& spec : specs) {
        const int64_t bytes = spec.Numel(u.shard_numel) * ItemSize(spec.dtype);
        for (auto* out : {&live[i], &kept[i]}) {
          absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
              BufferKind::kShard, bytes,
              absl::StrCat("group=", hold.group, " module=", hold.module, " unit=", u.index,
                           " rank=", rank, " state=", spec.name,
                           out == &kept[i] ? " committed" : ""),
              hold.owner_uid, placement);
          if (!b.ok()) {
            return absl::Status(
                b.status().code(),
                absl::StrCat("group ", hold.group, " rank ", rank,
                             ": could not allocate optimizer state \"", spec.name,
                             "\" of unit ", u.index, " of module ", Display(hold.module),
                             " to load a checkpoint into: ", b.status().message()));
          }
          out->push_back(*std::move(b));
        }
      }
    }
  }
  std::shared_ptr<Group> held = GroupOrGone(hold.group);
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  if (g.removed || !g.registered.contains(hold.module)) {
    return absl::UnavailableError(absl::StrCat("group ", hold.group, ": module ",
                                               Display(hold.module),
                                               " was dropped during the load"));
  }
  Registered& reg = g.registered.at(hold.module);
  bool any = !reg.state_specs.empty() || !reg.state_allocating.empty();
  for (const auto& shards : reg.shards_by_rank) {
    for (const UnitShard& sh : shards) any = any || !sh.state.empty();
  }
  if (any) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", g.id, " module ", Display(hold.module),
        ": a rank registered optimizer state while the checkpoint was being loaded; load again"));
  }
  reg.state_specs = specs;
  reg.committed_state.resize(g.world_size);
  hold.state_specs = specs;
  hold.state_live.clear();
  hold.state_committed.clear();
  for (size_t i = 0; i < hold.ranks.size(); ++i) {
    const int32_t rank = hold.ranks[i];
    std::vector<UnitShard>& shards = reg.shards_by_rank[rank];
    auto& committed = reg.committed_state[rank];
    committed.assign(shards.size(), {});
    for (size_t u = 0; u < shards.size(); ++u) {
      shards[u].state.assign(live[i].begin() + u * n, live[i].begin() + (u + 1) * n);
      committed[u].assign(kept[i].begin() + u * n, kept[i].begin() + (u + 1) * n);
    }
    hold.state_live.push_back(live[i]);
    hold.state_committed.push_back(kept[i]);
  }
  FS_LOG(INFO) << "group=" << g.id << " module=" << Display(hold.module)
               << ": optimizer state created by a checkpoint load (" << n << " state(s) x "
               << hold.plan.units.size() << " unit(s) on " << hold.ranks.size()
               << " local rank(s))";
  return absl::OkStatus();
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
  if (!args.from_peer) FS_RETURN_IF_ERROR(CheckOwner(args, from, /*parent_if_missing=*/false));
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
  // Optimizer state (README "Checkpoints"), checked before anything changes:
  //  - the module has no state registered: the checkpoint's state (if any) is not loaded;
  //  - the module has state and the source none (a parameters-only checkpoint, safetensors):
  //    the state is zeroed, as a freshly registered one (the loaded step starts a fresh
  //    optimizer);
  //  - both: the specs must be equal; under the same plan each (rank, unit, state) is copied;
  //    under another plan SHARD states reshard like the parameters (by FQN and element range)
  //    and a SCALAR state of a unit takes the saved value of the saved unit holding the unit's
  //    first parameter, from the saved rank holding that parameter's first element.
  enum class StateLoad { kNone, kZero, kCopy, kReshard };
  StateLoad state_mode = StateLoad::kNone;
  std::vector<std::unique_ptr<checkpoint::ParamSource>> state_sources;  // by spec (SHARD)
  std::vector<std::vector<checkpoint::Binding>> state_bindings;         // by spec (SHARD)
  std::vector<std::vector<std::vector<char>>> scalars;  // [spec][unit] (SCALAR, kReshard)
  const bool source_state = ckpt.has_value() && !ckpt->meta.state_specs.empty();
  if (!hold.state_specs.empty()) {
    state_mode = StateLoad::kZero;
    if (source_state) {
      const std::string diff = StateSpecDifference(hold.state_specs, ckpt->meta.state_specs);
      if (!diff.empty()) {
        ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot load into group ", hold.group, " module ", Display(hold.module),
            ": the optimizer state of checkpoint ", args.dir, " differs from the module's: ",
            diff));
      }
      const bool same_plan = ckpt->meta.world_size == hold.world_size &&
                             !hold.plan.fingerprint.empty() &&
                             ckpt->meta.plan.fingerprint == hold.plan.fingerprint;
      state_mode = same_plan ? StateLoad::kCopy : StateLoad::kReshard;
    }
  } else if (source_state) {
    // The module has no optimizer state yet (a fresh job): the load creates it for the local
    // ranks with the checkpoint's specs, as RegisterState would, so a trainer that then
    // keeps its optimizer's state in the daemon (keep_optimizer_state) re-attaches to the
    // loaded values.
    if (absl::Status st = AllocateStateForLoad(hold, ckpt->meta.state_specs); !st.ok()) {
      ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
      return st;
    }
    const bool same_plan = ckpt->meta.world_size == hold.world_size &&
                           !hold.plan.fingerprint.empty() &&
                           ckpt->meta.plan.fingerprint == hold.plan.fingerprint;
    state_mode = same_plan ? StateLoad::kCopy : StateLoad::kReshard;
  }
  // The saved state tensors by (rank, unit, name) (Metadata::FindTensor is a linear scan).
  std::map<std::tuple<int32_t, int32_t, std::string>, const checkpoint::TensorEntry*> saved_state;
  if (state_mode == StateLoad::kCopy || state_mode == StateLoad::kReshard) {
    for (const checkpoint::TensorEntry& t : ckpt->meta.tensors) {
      if (t.name != checkpoint::kShardTensor) saved_state[{t.rank, t.unit, t.name}] = &t;
    }
  }
  if (state_mode == StateLoad::kReshard) {
    const std::vector<SharedParam> tied = checkpoint::TiedAliases(hold.manifest, hold.plan);
    absl::Status st;
    scalars.resize(hold.state_specs.size());
    for (size_t k = 0; k < hold.state_specs.size() && st.ok(); ++k) {
      const StateSpec& spec = hold.state_specs[k];
      state_sources.push_back(checkpoint::CheckpointStateSource(*ckpt, spec));
      state_bindings.emplace_back();
      if (spec.shape == StateShape::kShard) {
        absl::StatusOr<std::vector<checkpoint::Binding>> b =
            checkpoint::Bind(*state_sources.back(), hold.plan, nullptr, tied, spec.dtype);
        if (!b.ok()) {
          st = b.status();
          break;
        }
        state_bindings.back() = *std::move(b);
        continue;
      }
      // SCALAR: one value per target unit, read now (small).
      const int64_t item = ItemSize(spec.dtype);
      for (const PlanUnit& u : hold.plan.units) {
        std::vector<char> value(item, 0);
        const checkpoint::Binding* first = nullptr;
        for (const checkpoint::Binding& b : *bindings) {
          if (b.unit->index == u.index && (first == nullptr || b.param->offset < first->param->offset)) {
            first = &b;
          }
        }
        if (first != nullptr) {
          const auto [saved_unit, saved_param] = SavedParam(ckpt->meta, first->source_fqn);
          if (saved_unit < 0) {
            st = absl::InternalError(absl::StrCat("parameter ", first->source_fqn,
                                                  " is bound but not in the saved plan"));
            break;
          }
          const PlanUnit& su = ckpt->meta.plan.units[saved_unit];
          const int32_t saved_rank =
              static_cast<int32_t>(std::min<int64_t>(saved_param->offset / su.shard_numel,
                                                     ckpt->meta.world_size - 1));
          auto found = saved_state.find({saved_rank, saved_unit, spec.name});
          const checkpoint::TensorEntry* t =
              found == saved_state.end() ? nullptr : found->second;
          if (t == nullptr) {
            st = absl::FailedPreconditionError(absl::StrCat(
                args.dir, ": no optimizer state \"", spec.name, "\" of rank ", saved_rank,
                " unit ", saved_unit));
            break;
          }
          st = checkpoint::ReadFileRange(*ckpt, saved_rank, t->offset, item, value.data());
          if (!st.ok()) break;
        }
        scalars[k].push_back(std::move(value));
      }
    }
    if (!st.ok()) {
      ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot load the optimizer state into group ", hold.group, " module ",
          Display(hold.module), ": ", st.message()));
    }
  }
  const int64_t per_rank = RankBytes(
      hold.plan, state_mode == StateLoad::kNone ? std::vector<StateSpec>{} : hold.state_specs);
  progress->done_bytes = 0;
  progress->total_bytes = per_rank * static_cast<int64_t>(hold.ranks.size());
  progress->phase = CheckpointProgress::kLoading;
  // A multi-daemon group: the other daemons load their ranks meanwhile (each checks the same
  // files against the same plan first, so they reach the same verdict but for I/O errors).
  std::vector<absl::StatusOr<CheckpointResult>> remote;
  std::thread asking;
  if (!args.from_peer && !hold.peers.empty()) {
    asking = std::thread([&] { remote = AskPeers(hold, args, /*load=*/true); });
  }
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
    // Optimizer state (see above); its committed copies below with the shards'.
    if (state_mode == StateLoad::kNone) return absl::OkStatus();
    FS_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Buffer>> host_state,
                        HostCopies(rank, hold.state_live[i], /*copy_in=*/false));
    const size_t n = hold.state_specs.size();
    for (const PlanUnit& u : hold.plan.units) {
      for (size_t k = 0; k < n; ++k) {
        const StateSpec& spec = hold.state_specs[k];
        const Buffer& b = *host_state[u.index * n + k];
        FS_RETURN_IF_ERROR(CheckStateSize(b, u, spec));
        const int64_t bytes = spec.Numel(u.shard_numel) * ItemSize(spec.dtype);
        switch (state_mode) {
          case StateLoad::kNone:
            break;
          case StateLoad::kZero:
            std::memset(b.data(), 0, bytes);
            break;
          case StateLoad::kCopy: {
            auto found = saved_state.find({rank, u.index, spec.name});
            const checkpoint::TensorEntry* t =
                found == saved_state.end() ? nullptr : found->second;
            if (t == nullptr || t->bytes != bytes) {
              return absl::InternalError(absl::StrCat(
                  args.dir, ": optimizer state \"", spec.name, "\" of rank ", rank, " unit ",
                  u.index, " is missing or not ", bytes, " bytes"));
            }
            FS_RETURN_IF_ERROR(checkpoint::ReadFileRange(*ckpt, rank, t->offset, bytes, b.data()));
            break;
          }
          case StateLoad::kReshard:
            if (spec.shape == StateShape::kShard) {
              FS_RETURN_IF_ERROR(checkpoint::FillShard(*state_sources[k], state_bindings[k],
                                                       hold.plan, u.index, shard_rank, b.data(),
                                                       spec.dtype));
            } else {
              std::memcpy(b.data(), scalars[k][u.index].data(), bytes);
            }
            break;
        }
        progress->done_bytes += bytes;
      }
    }
    if (host_state != hold.state_live[i]) {
      FS_RETURN_IF_ERROR(devices_.CopyEach(rank, Raw(host_state), Raw(hold.state_live[i])));
    }
    return absl::OkStatus();
  });
  const bool filled = s.ok();
  // Restarts: the load's intent is durable before any committed copy changes (a daemon killed
  // during the copies finishes them from the shards; group_manager_state.cc).
  if (filled) {
    NoteLoadCopying(hold.group, hold.module, hold.ranks,
                    ckpt.has_value() ? ckpt->meta.generation : hold.generation + 1);
  }
  absl::Status copied = ParallelFor(hold.ranks.size(), [&](size_t i) -> absl::Status {
    std::vector<std::shared_ptr<Buffer>> shards;
    for (const UnitShard& sh : hold.shards[i]) shards.push_back(sh.shard);
    std::vector<std::shared_ptr<Buffer>> committed = hold.committed[i];
    if (state_mode != StateLoad::kNone) {
      shards.insert(shards.end(), hold.state_live[i].begin(), hold.state_live[i].end());
      committed.insert(committed.end(), hold.state_committed[i].begin(),
                       hold.state_committed[i].end());
    }
    // Host or device alike (a GPU rank's copies stay on its device).
    return filled ? devices_.CopyEach(hold.ranks[i], Raw(shards), Raw(committed))
                  : devices_.CopyEach(hold.ranks[i], Raw(committed), Raw(shards));
  });
  if (s.ok()) s = copied;
  if (asking.joinable()) asking.join();
  for (size_t k = 0; k < remote.size(); ++k) {
    if (!remote[k].ok()) {
      // This daemon's ranks are loaded; that one's are not: their generations now differ, so
      // the group's next commit is refused on every rank (the agreement compares them).
      FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module)
                    << ": daemon " << hold.peers[k] << " could not load " << from << ": "
                    << remote[k].status();
      if (s.ok()) {
        s = absl::Status(remote[k].status().code(),
                         absl::StrCat("daemon ", hold.peers[k], " could not load its ranks: ",
                                      remote[k].status().message()));
        if (filled) {
          const uint64_t generation =
              ckpt.has_value() ? ckpt->meta.generation : hold.generation + 1;
          ReleaseCheckpointHold(hold, /*load=*/true, generation);
          return s;
        }
      }
    }
  }
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
  for (const auto& r : remote) result.ranks += r->ranks;
  result.unused_tensors = unused;
  FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module) << " loaded "
               << from << ": generation " << generation << " on " << result.ranks
               << " local rank(s)";
  return result;
}

}  // namespace flatshard::server
