// Checkpoints: the hold on a module's committed copies, and the other daemons' parts.

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
#include "server/group/access.h"
#include "server/messages.h"
#include "server/module/modules.h"

namespace flatshard::server {

using checkpoint_internal::Raw;

using internal::Display;

Checkpoints::Checkpoints(CheckpointsOptions options)
    : store_(options.store),
      devices_(*options.devices),
      table_(*options.table),
      modules_(*options.modules),
      records_(*options.records),
      shutdown_(*options.shutdown),
      peers_(options.peers),
      self_peer_address_(std::move(options.self_peer_address)) {}

absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> Checkpoints::HostCopies(
    int32_t rank, const std::vector<std::shared_ptr<Buffer>>& buffers, bool copy_in) const {
  bool device = false;
  for (const auto& b : buffers) device |= b != nullptr && b->on_device();
  if (!device) return buffers;
  std::vector<std::shared_ptr<Buffer>> host;
  for (size_t u = 0; u < buffers.size(); ++u) {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b,
                        store_->Allocate(BufferKind::kStaging, buffers[u]->bytes(),
                                         absl::StrCat("checkpoint rank=", rank, " unit=", u), -1,
                                         Placement::Host()));
    host.push_back(std::move(b));
  }
  if (copy_in) FS_RETURN_IF_ERROR(devices_.CopyEach(rank, Raw(buffers), Raw(host)));
  return host;
}

absl::StatusOr<Checkpoints::CheckpointHold> Checkpoints::HoldForCheckpoint(
    const CheckpointArgs& args, bool load, CheckpointProgress* progress) {
  progress->phase = CheckpointProgress::kWaiting;
  const absl::Time deadline = absl::Now() + args.wait;
  absl::Status last_wait;
  while (true) {
    {
      if (shutdown_) return absl::UnavailableError("flatshardd is shutting down");
      std::shared_ptr<Group> held = table_.FindOrGone(args.group);
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
        return absl::NotFoundError(
            absl::StrCat("group ", g.id, ": module ", Display(args.module), " is not registered"));
      }
      Registered& reg = it->second;
      std::vector<std::string> peers;  // the other daemons' peer addresses
      FS_RETURN_IF_ERROR(CheckHoldableLocked(g, args, load, reg, &peers));
      uint64_t lo = UINT64_MAX, hi = 0;
      for (int32_t r : g.local_ranks) {
        lo = std::min(lo, reg.generation[r]);
        hi = std::max(hi, reg.generation[r]);
      }
      // A copy into (or out of) the committed copies is in flight, a rollback is due, or a
      // commit has reached some ranks and not yet others: look again shortly.
      const bool still = reg.busy == 0 && !reg.rollback_pending && lo == hi &&
                         (!load || reg.ckpt_hold == 0) && !reg.pending_committed.Prune();
      if (still) return HoldLocked(g, args.module, reg, load, lo, std::move(peers));
      last_wait = absl::DeadlineExceededError(absl::StrCat(
          "group ", g.id, " module ", Display(args.module),
          ": its committed shards did not come to rest within the wait (", reg.busy,
          " copies in flight", reg.pending_committed.Prune() ? ", a writeback End's copy" : "",
          reg.rollback_pending ? ", a rollback pending" : "",
          lo != hi ? absl::StrCat(", ranks at generations ", lo, " to ", hi) : std::string(),
          reg.ckpt_hold > 0 ? ", another checkpoint running" : "", ")"));
    }
    if (absl::Now() >= deadline) return last_wait;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

absl::Status Checkpoints::CheckHoldableLocked(Group& g, const CheckpointArgs& args, bool load,
                                              Registered& reg, std::vector<std::string>* peers) {
  if (!reg.initialized) FS_RETURN_IF_ERROR(modules_.CheckUsable(g, args.module, reg));
  if (g.multi()) {
    if (static_cast<int32_t>(g.table.rank_daemons.size()) != g.world_size || !g.coll) {
      return absl::UnavailableError(
          absl::StrCat("group ", g.id, " is not formed (every rank must have joined once)"));
    }
    for (int32_t r = 0; r < g.world_size; ++r) {
      const std::string& a = g.table.rank_daemons[r].peer_address;
      if (std::find(g.local_ranks.begin(), g.local_ranks.end(), r) != g.local_ranks.end() ||
          a == self_peer_address_ || std::find(peers->begin(), peers->end(), a) != peers->end()) {
        continue;
      }
      peers->push_back(a);
    }
  } else if (static_cast<int32_t>(g.local_ranks.size()) != g.world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, ": not every rank has joined (this daemon hosts ",
                     internal::RankListText(g.local_ranks), " of ", g.world_size, ")"));
  }
  for (int32_t r : g.local_ranks) {
    if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) || reg.shards_by_rank[r].empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", g.id, " rank ", r, " holds no shards of module ", Display(args.module)));
    }
  }
  if (load) {
    for (const auto& [id, open] : g.open_summons) {
      if (open.module == args.module) {
        return absl::FailedPreconditionError(
            absl::StrCat("group ", g.id, " rank ", open.rank, " has summon ", id, " of module ",
                         Display(args.module), " open: end it before loading"));
      }
    }
  }
  // Optimizer state: a checkpoint holds every rank's or none, so every local rank must
  // have registered it once the module's spec is fixed.
  for (const StateSpec& st : reg.state_specs) {
    if (st.name == checkpoint::kShardTensor) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", g.id, " module ", Display(args.module), ": optimizer state \"",
                       st.name, "\" has the name of the parameters' tensor in a checkpoint"));
    }
  }
  for (int32_t r : reg.state_specs.empty() ? std::vector<int32_t>{} : g.local_ranks) {
    const bool has =
        r < static_cast<int32_t>(reg.committed_state.size()) &&
        reg.committed_state[r].size() == reg.shards_by_rank[r].size() &&
        std::all_of(reg.shards_by_rank[r].begin(), reg.shards_by_rank[r].end(),
                    [&](const UnitShard& sh) { return sh.state.size() == reg.state_specs.size(); });
    if (!has) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", g.id, " rank ", r,
                       " has not registered the optimizer state of module ", Display(args.module),
                       " (another rank did): every rank registers it "
                       "(RegisterState, keep_optimizer_state) before a checkpoint ",
                       load ? "load" : "save"));
    }
  }
  return absl::OkStatus();
}

Checkpoints::CheckpointHold Checkpoints::HoldLocked(Group& g, const std::string& module,
                                                    Registered& reg, bool load, uint64_t generation,
                                                    std::vector<std::string> peers) {
  ++reg.ckpt_hold;
  if (load) ++reg.busy;  // keeps rollbacks out while the shards are written
  CheckpointHold h;
  h.group = g.id;
  h.module = module;
  h.world_size = g.world_size;
  h.plan = reg.plan;
  h.manifest = reg.manifest;
  h.ranks = g.local_ranks;
  for (int32_t r : g.local_ranks) {
    h.shards.push_back(reg.shards_by_rank[r]);
    h.committed.push_back(reg.committed[r]);
  }
  h.generation = generation;
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

void Checkpoints::ReleaseCheckpointHold(const CheckpointHold& hold, bool load,
                                        std::optional<uint64_t> generation) {
  AfterUnlock run;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(hold.group);
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
    if (load) modules_.DoneCopying(g, reg, &run);
    // Restarts: the record holds the loaded generation before the load is answered.
    if (load) records_.LoadRecordedLocked(g, reg, generation.has_value(), &run);
  }
  run.Run();
}

absl::Status Checkpoints::AllocateStateForLoad(CheckpointHold& hold,
                                               const std::vector<StateSpec>& specs) {
  // Allocation (shm creation, device memory) without the lock; the hold keeps the module.
  std::vector<std::vector<std::shared_ptr<Buffer>>> live(hold.ranks.size()),
      kept(hold.ranks.size());
  for (size_t i = 0; i < hold.ranks.size(); ++i) {
    const int32_t rank = hold.ranks[i];
    const Placement placement = devices_.PlacementOf(rank);
    for (const PlanUnit& u : hold.plan.units) {
      for (const StateSpec& spec : specs) {
        const int64_t bytes = spec.Numel(u.shard_numel) * ItemSize(spec.dtype);
        for (auto* out : {&live[i], &kept[i]}) {
          absl::StatusOr<std::shared_ptr<Buffer>> b =
              store_->Allocate(BufferKind::kShard, bytes,
                               absl::StrCat("group=", hold.group, " module=", hold.module,
                                            " unit=", u.index, " rank=", rank, " state=", spec.name,
                                            out == &kept[i] ? " committed" : ""),
                               hold.owner_uid, placement);
          if (!b.ok()) {
            return absl::Status(
                b.status().code(),
                absl::StrCat("group ", hold.group, " rank ", rank,
                             ": could not allocate optimizer state \"", spec.name, "\" of unit ",
                             u.index, " of module ", Display(hold.module),
                             " to load a checkpoint into: ", b.status().message()));
          }
          out->push_back(*std::move(b));
        }
      }
    }
  }
  hold.state_specs = specs;
  hold.state_live = std::move(live);
  hold.state_committed = std::move(kept);
  return absl::OkStatus();
}

absl::Status Checkpoints::InstallLoadedState(const CheckpointHold& hold) {
  const size_t n = hold.state_specs.size();
  std::shared_ptr<Group> held = table_.FindOrGone(hold.group);
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  if (g.removed || !g.registered.contains(hold.module)) {
    return absl::UnavailableError(absl::StrCat(
        "group ", hold.group, ": module ", Display(hold.module), " was dropped during the load"));
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
  reg.state_specs = hold.state_specs;
  reg.committed_state.resize(g.world_size);
  for (size_t i = 0; i < hold.ranks.size(); ++i) {
    const int32_t rank = hold.ranks[i];
    const auto& live = hold.state_live[i];
    const auto& kept = hold.state_committed[i];
    std::vector<UnitShard>& shards = reg.shards_by_rank[rank];
    auto& committed = reg.committed_state[rank];
    committed.assign(shards.size(), {});
    for (size_t u = 0; u < shards.size(); ++u) {
      shards[u].state.assign(live.begin() + u * n, live.begin() + (u + 1) * n);
      committed[u].assign(kept.begin() + u * n, kept.begin() + (u + 1) * n);
    }
  }
  FS_LOG(INFO) << "group=" << g.id << " module=" << Display(hold.module)
               << ": optimizer state created by a checkpoint load (" << n << " state(s) x "
               << hold.plan.units.size() << " unit(s) on " << hold.ranks.size()
               << " local rank(s))";
  return absl::OkStatus();
}

std::vector<absl::StatusOr<CheckpointResult>> Checkpoints::AskPeers(const CheckpointHold& hold,
                                                                    const CheckpointArgs& args,
                                                                    bool load) {
  return peers_->AskAll(hold.peers, {hold.group, hold.token, hold.module, args.dir, args.wait},
                        load);
}

}  // namespace flatshard::server
