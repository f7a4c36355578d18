// Checkpoints: saves of the committed step, one file per rank in parallel.

#include "server/checkpoint/checkpoints.h"

#include <grpcpp/grpcpp.h>
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
#include "common/status_macros.h"
#include "flatshard/v1/checkpoint_peer.grpc.pb.h"
#include "server/checkpoint/checkpoint_hold.h"
#include "server/checkpoint/checkpoint_peer_client.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/modules.h"

namespace flatshard::server {

using checkpoint_internal::CheckOwner;
using checkpoint_internal::CheckSize;
using checkpoint_internal::CheckStateSize;
using checkpoint_internal::ParallelFor;
using checkpoint_internal::RankBytes;

using internal::Display;

absl::StatusOr<CheckpointResult> Checkpoints::SaveCheckpoint(const CheckpointArgs& args,
                                                             CheckpointProgress* progress) {
  if (args.dir.empty() || args.dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint directory must be an absolute path, got \"", Truncated(args.dir), "\""));
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
    progress->total_bytes =
        per_rank * (args.from_peer ? static_cast<int64_t>(hold.ranks.size()) : hold.world_size);
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
      FS_ASSIGN_OR_RETURN(written[i], WriteRank(i, args, hold, progress));
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
        return absl::AbortedError(absl::StrCat("group ", hold.group, " module ",
                                               Display(hold.module),
                                               ": the daemons held "
                                               "different generations in ",
                                               kAttempts,
                                               " attempts (commits kept landing between "
                                               "their holds); nothing was given metadata"));
      }
      FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module)
                   << ": daemons held different generations; writing the checkpoint again";
      absl::SleepFor(absl::Milliseconds(20 * attempt));
      continue;
    }
    FS_ASSIGN_OR_RETURN(checkpoint::Metadata meta, MetadataOf(hold, std::move(result)));
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

absl::StatusOr<checkpoint::WrittenFile> Checkpoints::WriteRank(size_t i, const CheckpointArgs& args,
                                                               const CheckpointHold& hold,
                                                               CheckpointProgress* progress) const {
  // GPU ranks: the committed copies go through host memory first (one staging buffer
  // per unit, for as long as the file is written).
  FS_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Buffer>> host,
                      HostCopies(hold.ranks[i], hold.committed[i], /*copy_in=*/true));
  std::vector<checkpoint::TensorToWrite> tensors;
  for (const PlanUnit& u : hold.plan.units) {
    const Buffer& b = *host[u.index];
    FS_RETURN_IF_ERROR(CheckSize(b, u));
    tensors.push_back(
        {u.index, checkpoint::kShardTensor, u.dtype, b.data(), u.shard_numel * ItemSize(u.dtype)});
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
        tensors.push_back(
            {u.index, st.name, st.dtype, b.data(), st.Numel(u.shard_numel) * ItemSize(st.dtype)});
      }
    }
  }
  return checkpoint::WriteRankFile(args.dir, hold.ranks[i], hold.world_size, tensors,
                                   [progress](int64_t n) { progress->done_bytes += n; });
}

absl::StatusOr<checkpoint::Metadata> Checkpoints::MetadataOf(const CheckpointHold& hold,
                                                             CheckpointResult result) {
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
      return absl::InternalError(
          absl::StrCat("group ", hold.group, ": no daemon wrote rank ", r, "'s file"));
    }
  }
  // Every daemon wrote the same optimizer state (each fixes its module's spec on its own):
  // every (rank, unit) has each state of the specs and no other, or no metadata is written.
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
  return meta;
}

}  // namespace flatshard::server
