// Checkpoints: loads (resharded by FQN and element range), staged in the committed copies and
// checked before any shard changes, then copied into the shards.

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
using checkpoint_internal::Raw;

using internal::Display;

namespace {

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

// The checkpoint was saved under `plan` by `world_size` ranks: rank r's file holds exactly
// rank r's shards (and optimizer state) in the same layout.
bool SavedUnderPlan(const checkpoint::Metadata& meta, const Plan& plan, int32_t world_size) {
  return meta.world_size == world_size && !plan.fingerprint.empty() &&
         meta.plan.fingerprint == plan.fingerprint;
}

}  // namespace

// What a load reads: a flatshard checkpoint directory (with its metadata) or a safetensors
// file, and how its tensors bind to the held module's plan. Not movable in effect: the sources
// point into `ckpt`.
struct Checkpoints::LoadSource {
  std::optional<checkpoint::Checkpoint> ckpt;
  std::unique_ptr<checkpoint::ParamSource> params;
  std::vector<checkpoint::Binding> bindings;  // once the module is held
  int64_t unused = 0;                         // source tensors no parameter takes
  int32_t files = 1;
  // A checkpoint saved under the module's plan: each local rank's file is read once, straight
  // into that rank's committed copies, its CRC-32C checked on the way (ReadSavedLayout).
  // Otherwise the files are verified first and the shards filled by FQN (FillResharded).
  bool one_pass = false;
};

// How the module's optimizer state is loaded (README "Checkpoints"), decided before anything
// changes:
//  - the module has no state registered: the checkpoint's state (if any) is not loaded;
//  - the module has state and the source none (a parameters-only checkpoint, safetensors):
//    the state is zeroed, as a freshly registered one (the loaded step starts a fresh
//    optimizer);
//  - both: the specs must be equal; under the same plan each (rank, unit, state) is copied;
//    under another plan SHARD states reshard like the parameters (by FQN and element range)
//    and a SCALAR state of a unit takes the saved value of the saved unit holding the unit's
//    first parameter, from the saved rank holding that parameter's first element.
struct Checkpoints::StateLoad {
  enum Mode { kNone, kZero, kCopy, kReshard };
  Mode mode = kNone;
  bool install = false;  // the state buffers are the load's (AllocateStateForLoad)
  std::vector<std::unique_ptr<checkpoint::ParamSource>> sources;  // by spec (SHARD, kReshard)
  std::vector<std::vector<checkpoint::Binding>> bindings;         // by spec (SHARD, kReshard)
  std::vector<std::vector<std::vector<char>>> scalars;            // [spec][unit] (SCALAR)
  // The saved state tensors by (rank, unit, name) (Metadata::FindTensor is a linear scan).
  std::map<std::tuple<int32_t, int32_t, std::string>, const checkpoint::TensorEntry*> saved;

  const checkpoint::TensorEntry* Saved(int32_t rank, int32_t unit, const std::string& name) const {
    auto found = saved.find({rank, unit, name});
    return found == saved.end() ? nullptr : found->second;
  }
};

absl::StatusOr<CheckpointResult> Checkpoints::LoadCheckpoint(const CheckpointArgs& args,
                                                             CheckpointProgress* progress) {
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
  // 1. Everything that can be checked without the module: the source itself (checksums aside).
  LoadSource src;
  FS_RETURN_IF_ERROR(OpenLoadSource(args, &src));
  // 2. The module: hold it, then check the source fits its plan before any shard changes.
  FS_ASSIGN_OR_RETURN(CheckpointHold hold, HoldForCheckpoint(args, /*load=*/true, progress));
  absl::StatusOr<std::vector<checkpoint::Binding>> bindings = checkpoint::Bind(
      *src.params, hold.plan, &src.unused, checkpoint::TiedAliases(hold.manifest, hold.plan));
  if (!bindings.ok()) {
    ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
    return absl::FailedPreconditionError(absl::StrCat("cannot load into group ", hold.group,
                                                      " module ", Display(hold.module), ": ",
                                                      bindings.status().message()));
  }
  src.bindings = *std::move(bindings);
  StateLoad state;
  absl::Status s = PlanStateLoad(args, hold, src, &state);
  if (s.ok()) s = VerifyOtherFiles(hold, &src, progress);
  if (!s.ok()) {
    ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
    return s;
  }
  progress->done_bytes = 0;
  progress->total_bytes = LoadBytes(hold, src, state);
  progress->phase = CheckpointProgress::kLoading;
  // A multi-daemon group: the other daemons load their ranks meanwhile (each checks the same
  // files against the same plan first, so they reach the same verdict but for I/O errors).
  std::vector<absl::StatusOr<CheckpointResult>> remote;
  std::thread asking;
  if (!args.from_peer && !hold.peers.empty()) {
    asking = std::thread([&] { remote = AskPeers(hold, args, /*load=*/true); });
  }
  // 3. Stage: the loaded values go into the committed copies (invisible to the trainers, who
  // map the shards), checked as they are read; the shards do not change. Restarts: the intent
  // says the shards are whole at the held generation, so a daemon killed now restores the
  // committed copies from them (server/durable/adoption.cc), as a failure does below.
  records_.NoteLoadCopying(hold.group, hold.module, hold.ranks, hold.generation);
  s = ParallelFor(hold.ranks.size(), [&](size_t i) -> absl::Status {
    return FillRank(i, args, hold, src, state, progress);
  });
  if (s.ok() && state.install) s = InstallLoadedState(hold);
  const bool filled = s.ok();
  const uint64_t generation =
      src.ckpt.has_value() ? src.ckpt->meta.generation : hold.generation + 1;
  // 4. Swap: every file was read and checked; the record says the committed copies hold the
  // loaded generation (a daemon killed during the copies restores the shards from them), then
  // the shards take their values. A failure restores the committed copies from the shards.
  if (filled) records_.NoteLoadStaged(hold.group, hold.module, hold.ranks, generation);
  absl::Status copied = ParallelFor(hold.ranks.size(), [&](size_t i) -> absl::Status {
    std::vector<std::shared_ptr<Buffer>> shards;
    for (const UnitShard& sh : hold.shards[i]) shards.push_back(sh.shard);
    std::vector<std::shared_ptr<Buffer>> committed = hold.committed[i];
    if (state.mode != StateLoad::kNone) {
      shards.insert(shards.end(), hold.state_live[i].begin(), hold.state_live[i].end());
      committed.insert(committed.end(), hold.state_committed[i].begin(),
                       hold.state_committed[i].end());
    }
    // Host or device alike (a GPU rank's copies stay on its device).
    return filled ? devices_.CopyEach(hold.ranks[i], Raw(committed), Raw(shards))
                  : devices_.CopyEach(hold.ranks[i], Raw(shards), Raw(committed));
  });
  if (asking.joinable()) asking.join();
  if (filled && !copied.ok()) {
    // The committed copies (and the record) hold the loaded generation; some shards do not.
    ReleaseCheckpointHold(hold, /*load=*/true, generation);
    FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module) << ": load of "
                  << from << ": the shards could not take the loaded values: " << copied;
    return copied;
  }
  if (s.ok()) s = copied;
  for (size_t k = 0; k < remote.size(); ++k) {
    if (!remote[k].ok()) {
      // This daemon's ranks are loaded; that one's are not: their generations now differ, so
      // the group's next commit is refused on every rank (the agreement compares them).
      FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module) << ": daemon "
                    << hold.peers[k] << " could not load " << from << ": " << remote[k].status();
      if (s.ok()) {
        s = absl::Status(remote[k].status().code(),
                         absl::StrCat("daemon ", hold.peers[k],
                                      " could not load its ranks: ", remote[k].status().message()));
        if (filled) {
          ReleaseCheckpointHold(hold, /*load=*/true, generation);
          return s;
        }
      }
    }
  }
  if (!s.ok()) {
    ReleaseCheckpointHold(hold, /*load=*/true, std::nullopt);
    FS_LOG(ERROR) << "group=" << hold.group << " module=" << Display(hold.module) << ": load of "
                  << from << " failed (nothing changed): " << s;
    return s;
  }
  ReleaseCheckpointHold(hold, /*load=*/true, generation);
  progress->phase = CheckpointProgress::kDone;
  CheckpointResult result;
  result.generation = generation;
  result.bytes = progress->total_bytes;
  result.files = src.files;
  result.ranks = static_cast<int32_t>(hold.ranks.size());
  for (const auto& r : remote) result.ranks += r->ranks;
  result.unused_tensors = src.unused;
  FS_LOG(INFO) << "group=" << hold.group << " module=" << Display(hold.module) << " loaded " << from
               << ": generation " << generation << " on " << result.ranks << " local rank(s)";
  return result;
}

absl::Status Checkpoints::OpenLoadSource(const CheckpointArgs& args, LoadSource* src) {
  if (args.dir.empty()) {
    absl::StatusOr<std::unique_ptr<checkpoint::ParamSource>> st =
        checkpoint::SafetensorsSource(args.safetensors);
    if (!st.ok()) return absl::FailedPreconditionError(st.status().message());
    src->params = *std::move(st);
    return absl::OkStatus();
  }
  FS_ASSIGN_OR_RETURN(src->ckpt, checkpoint::OpenCheckpoint(args.dir));
  src->params = checkpoint::CheckpointSource(*src->ckpt);
  src->files = static_cast<int32_t>(src->ckpt->meta.files.size());
  return absl::OkStatus();
}

absl::Status Checkpoints::VerifyOtherFiles(const CheckpointHold& hold, LoadSource* src,
                                           CheckpointProgress* progress) {
  if (!src->ckpt.has_value()) return absl::OkStatus();
  const checkpoint::Metadata& meta = src->ckpt->meta;
  src->one_pass = SavedUnderPlan(meta, hold.plan, hold.world_size);
  // Resharding reads ranges of several files per shard: every file is checked first. One
  // pass checks the local ranks' files as it reads them; the other daemons' ranks' files
  // (a multi-daemon group) are checked here, so every daemon reaches the same verdict.
  std::vector<int32_t> files;
  for (const checkpoint::FileEntry& e : meta.files) {
    if (!src->one_pass ||
        std::find(hold.ranks.begin(), hold.ranks.end(), e.rank) == hold.ranks.end()) {
      files.push_back(e.rank);
    }
  }
  if (files.empty()) return absl::OkStatus();
  progress->phase = CheckpointProgress::kVerifying;
  progress->done_bytes = 0;
  int64_t total = 0;
  for (int32_t r : files) total += meta.files.at(r).bytes;
  progress->total_bytes = total;
  return checkpoint::VerifyFiles(*src->ckpt, files,
                                 [progress](int64_t n) { progress->done_bytes += n; });
}

int64_t Checkpoints::LoadBytes(const CheckpointHold& hold, const LoadSource& src,
                               const StateLoad& state) {
  const bool with_state = state.mode != StateLoad::kNone;
  const int64_t ranks = static_cast<int64_t>(hold.ranks.size());
  if (!src.one_pass) {
    return RankBytes(hold.plan, with_state ? hold.state_specs : std::vector<StateSpec>{}) * ranks;
  }
  // The local ranks' files as read, and the optimizer state zeroed where they have none.
  int64_t bytes = 0;
  for (int32_t r : hold.ranks) bytes += src.ckpt->meta.files.at(r).bytes;
  if (state.mode == StateLoad::kZero) {
    bytes += (RankBytes(hold.plan, hold.state_specs) - RankBytes(hold.plan, {})) * ranks;
  }
  return bytes;
}

absl::Status Checkpoints::PlanStateLoad(const CheckpointArgs& args, CheckpointHold& hold,
                                        const LoadSource& src, StateLoad* state) {
  const std::optional<checkpoint::Checkpoint>& ckpt = src.ckpt;
  const bool source_state = ckpt.has_value() && !ckpt->meta.state_specs.empty();
  if (!hold.state_specs.empty()) {
    state->mode = StateLoad::kZero;
    if (!source_state) return absl::OkStatus();
    const std::string diff = StateSpecDifference(hold.state_specs, ckpt->meta.state_specs);
    if (!diff.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot load into group ", hold.group, " module ", Display(hold.module),
          ": the optimizer state of checkpoint ", args.dir, " differs from the module's: ", diff));
    }
  } else if (source_state) {
    // The module has no optimizer state yet (a fresh job): the load creates it for the local
    // ranks with the checkpoint's specs, as RegisterState would, so a trainer that then
    // keeps its optimizer's state in the daemon (keep_optimizer_state) re-attaches to the
    // loaded values.
    FS_RETURN_IF_ERROR(AllocateStateForLoad(hold, ckpt->meta.state_specs));
    state->install = true;
  } else {
    return absl::OkStatus();  // kNone
  }
  state->mode = SavedUnderPlan(ckpt->meta, hold.plan, hold.world_size) ? StateLoad::kCopy
                                                                       : StateLoad::kReshard;
  for (const checkpoint::TensorEntry& t : ckpt->meta.tensors) {
    if (t.name != checkpoint::kShardTensor) state->saved[{t.rank, t.unit, t.name}] = &t;
  }
  if (state->mode != StateLoad::kReshard) return absl::OkStatus();
  absl::Status st = PrepareStateReshard(args, hold, src, state);
  if (!st.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot load the optimizer state into group ",
                                                      hold.group, " module ", Display(hold.module),
                                                      ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status Checkpoints::PrepareStateReshard(const CheckpointArgs& args,
                                              const CheckpointHold& hold, const LoadSource& src,
                                              StateLoad* state) {
  const checkpoint::Checkpoint& ckpt = *src.ckpt;
  const std::vector<SharedParam> tied = checkpoint::TiedAliases(hold.manifest, hold.plan);
  state->scalars.resize(hold.state_specs.size());
  for (size_t k = 0; k < hold.state_specs.size(); ++k) {
    const StateSpec& spec = hold.state_specs[k];
    state->sources.push_back(checkpoint::CheckpointStateSource(ckpt, spec));
    state->bindings.emplace_back();
    if (spec.shape == StateShape::kShard) {
      FS_ASSIGN_OR_RETURN(
          state->bindings.back(),
          checkpoint::Bind(*state->sources.back(), hold.plan, nullptr, tied, spec.dtype));
      continue;
    }
    // SCALAR: one value per target unit, read now (small).
    const int64_t item = ItemSize(spec.dtype);
    for (const PlanUnit& u : hold.plan.units) {
      std::vector<char> value(item, 0);
      const checkpoint::Binding* first = nullptr;
      for (const checkpoint::Binding& b : src.bindings) {
        if (b.unit->index == u.index &&
            (first == nullptr || b.param->offset < first->param->offset)) {
          first = &b;
        }
      }
      if (first != nullptr) {
        const auto [saved_unit, saved_param] = SavedParam(ckpt.meta, first->source_fqn);
        if (saved_unit < 0) {
          return absl::InternalError(
              absl::StrCat("parameter ", first->source_fqn, " is bound but not in the saved plan"));
        }
        const PlanUnit& su = ckpt.meta.plan.units[saved_unit];
        const int32_t saved_rank = static_cast<int32_t>(
            std::min<int64_t>(saved_param->offset / su.shard_numel, ckpt.meta.world_size - 1));
        const checkpoint::TensorEntry* t = state->Saved(saved_rank, saved_unit, spec.name);
        if (t == nullptr) {
          return absl::FailedPreconditionError(absl::StrCat(args.dir, ": no optimizer state \"",
                                                            spec.name, "\" of rank ", saved_rank,
                                                            " unit ", saved_unit));
        }
        FS_RETURN_IF_ERROR(
            checkpoint::ReadFileRange(ckpt, saved_rank, t->offset, item, value.data()));
      }
      state->scalars[k].push_back(std::move(value));
    }
  }
  return absl::OkStatus();
}

absl::Status Checkpoints::FillRank(size_t i, const CheckpointArgs& args, const CheckpointHold& hold,
                                   const LoadSource& src, const StateLoad& state,
                                   CheckpointProgress* progress) const {
  const int32_t rank = hold.ranks[i];
  // The committed copies are the staging area; GPU ranks' are filled in host memory, then
  // copied to the device.
  FS_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Buffer>> host,
                      HostCopies(rank, hold.committed[i], /*copy_in=*/false));
  std::vector<std::shared_ptr<Buffer>> host_state;
  if (state.mode != StateLoad::kNone) {
    FS_ASSIGN_OR_RETURN(host_state, HostCopies(rank, hold.state_committed[i], /*copy_in=*/false));
  }
  for (const PlanUnit& u : hold.plan.units) FS_RETURN_IF_ERROR(CheckSize(*host[u.index], u));
  const size_t n = hold.state_specs.size();
  for (size_t j = 0; j < host_state.size(); ++j) {
    const PlanUnit& u = hold.plan.units[j / n];
    const StateSpec& spec = hold.state_specs[j % n];
    FS_RETURN_IF_ERROR(CheckStateSize(*host_state[j], u, spec));
    if (state.mode == StateLoad::kZero) {
      const int64_t bytes = spec.Numel(u.shard_numel) * ItemSize(spec.dtype);
      std::memset(host_state[j]->data(), 0, bytes);
      progress->done_bytes += bytes;
    }
  }
  FS_RETURN_IF_ERROR(src.one_pass
                         ? ReadSavedLayout(args, hold, i, src, state, host, host_state, progress)
                         : FillResharded(hold, i, src, state, host, host_state, progress));
  if (host != hold.committed[i]) {
    FS_RETURN_IF_ERROR(devices_.CopyEach(rank, Raw(host), Raw(hold.committed[i])));
  }
  if (!host_state.empty() && host_state != hold.state_committed[i]) {
    FS_RETURN_IF_ERROR(devices_.CopyEach(rank, Raw(host_state), Raw(hold.state_committed[i])));
  }
  return absl::OkStatus();
}

absl::Status Checkpoints::ReadSavedLayout(const CheckpointArgs& args, const CheckpointHold& hold,
                                          size_t i, const LoadSource& src, const StateLoad& state,
                                          const std::vector<std::shared_ptr<Buffer>>& host,
                                          const std::vector<std::shared_ptr<Buffer>>& host_state,
                                          CheckpointProgress* progress) {
  const int32_t rank = hold.ranks[i];
  std::map<std::pair<int32_t, std::string>, const checkpoint::TensorEntry*> saved;
  for (const checkpoint::TensorEntry& t : src.ckpt->meta.tensors) {
    if (t.rank == rank) saved[{t.unit, t.name}] = &t;
  }
  std::vector<checkpoint::TensorDestination> dests;
  auto take = [&](const PlanUnit& u, const std::string& name, int64_t bytes,
                  const Buffer& b) -> absl::Status {
    auto found = saved.find({u.index, name});
    if (found == saved.end() || found->second->bytes != bytes) {
      return absl::InternalError(absl::StrCat(args.dir, ": tensor \"", name, "\" of rank ", rank,
                                              " unit ", u.index, " is missing or not ", bytes,
                                              " bytes"));
    }
    dests.push_back({found->second, b.data()});
    return absl::OkStatus();
  };
  const size_t n = hold.state_specs.size();
  for (const PlanUnit& u : hold.plan.units) {
    FS_RETURN_IF_ERROR(
        take(u, checkpoint::kShardTensor, u.shard_numel * ItemSize(u.dtype), *host[u.index]));
    if (state.mode != StateLoad::kCopy) continue;
    for (size_t k = 0; k < n; ++k) {
      const StateSpec& spec = hold.state_specs[k];
      FS_RETURN_IF_ERROR(take(u, spec.name, spec.Numel(u.shard_numel) * ItemSize(spec.dtype),
                              *host_state[u.index * n + k]));
    }
  }
  return checkpoint::ReadRankFile(*src.ckpt, rank, dests,
                                  [progress](int64_t b) { progress->done_bytes += b; });
}

absl::Status Checkpoints::FillResharded(const CheckpointHold& hold, size_t i, const LoadSource& src,
                                        const StateLoad& state,
                                        const std::vector<std::shared_ptr<Buffer>>& host,
                                        const std::vector<std::shared_ptr<Buffer>>& host_state,
                                        CheckpointProgress* progress) {
  const int32_t shard_rank = hold.plan.ShardRank(hold.ranks[i]);
  for (const PlanUnit& u : hold.plan.units) {
    FS_RETURN_IF_ERROR(checkpoint::FillShard(*src.params, src.bindings, hold.plan, u.index,
                                             shard_rank, host[u.index]->data()));
    progress->done_bytes += u.shard_numel * ItemSize(u.dtype);
  }
  if (state.mode != StateLoad::kReshard) return absl::OkStatus();  // none, or zeroed
  const size_t n = hold.state_specs.size();
  for (const PlanUnit& u : hold.plan.units) {
    for (size_t k = 0; k < n; ++k) {
      const StateSpec& spec = hold.state_specs[k];
      void* data = host_state[u.index * n + k]->data();
      const int64_t bytes = spec.Numel(u.shard_numel) * ItemSize(spec.dtype);
      if (spec.shape == StateShape::kShard) {
        FS_RETURN_IF_ERROR(checkpoint::FillShard(*state.sources[k], state.bindings[k], hold.plan,
                                                 u.index, shard_rank, data, spec.dtype));
      } else {
        std::memcpy(data, state.scalars[k][u.index].data(), bytes);
      }
      progress->done_bytes += bytes;
    }
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
