// Checkpoints: the committed copies held still for a reader other than a save (the publisher
// of weights, server/publish/).

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/checkpoint/checkpoint_hold.h"
#include "server/checkpoint/checkpoints.h"

namespace flatshard::server {

absl::Status Checkpoints::ReadCommitted(
    const CheckpointArgs& args, const std::function<absl::Status(const CommittedCopies&)>& read) {
  CheckpointProgress progress;
  FS_ASSIGN_OR_RETURN(CheckpointHold hold, HoldForCheckpoint(args, /*load=*/false, &progress));
  auto status = [&]() -> absl::Status {
    CommittedCopies c;
    c.group = hold.group;
    c.module = hold.module;
    c.world_size = hold.world_size;
    c.plan = hold.plan;
    c.manifest = hold.manifest;
    c.ranks = hold.ranks;
    c.generation = hold.generation;
    c.owner_uid = hold.owner_uid;
    c.peers = hold.peers;
    c.token = hold.token;
    for (size_t i = 0; i < hold.ranks.size(); ++i) {
      // GPU ranks: device copies go through host buffers (HostCopies), freed after `read`.
      FS_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Buffer>> host,
                          HostCopies(hold.ranks[i], hold.committed[i], /*copy_in=*/true));
      std::vector<std::shared_ptr<Buffer>> by_unit(hold.plan.units.size());
      for (size_t j = 0; j < hold.shards[i].size() && j < host.size(); ++j) {
        const int32_t u = hold.shards[i][j].unit;
        if (u >= 0 && u < static_cast<int32_t>(by_unit.size())) by_unit[u] = host[j];
      }
      c.by_unit.push_back(std::move(by_unit));
    }
    return read(c);
  }();
  ReleaseCheckpointHold(hold, /*load=*/false, std::nullopt);
  return status;
}

}  // namespace flatshard::server
