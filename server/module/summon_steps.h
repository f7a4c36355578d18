#pragma once
// The steps of a summon that summon.cc, end.cc and reduce_scatter.cc share: what a summon
// needs from a module's kept buffers, and the helpers that get it with or without the
// group's lock. Internal to server/module/.

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/kept_buffers.h"
#include "server/module/modules.h"

namespace flatshard::server {

// One view buffer a summon (or a rank0_only End) needs from the module's kept buffers.
struct Modules::ViewNeed {
  int32_t unit = 0;
  KeptUse use = KeptUse::kParams;
  KeptKey key;
  int64_t bytes = 0;
  std::string label;
};

// What a summon of one rank needs, as DecideSummon found it.
struct Modules::SummonDecision {
  std::vector<int32_t> units;
  bool sharded = false;
  bool shared = false;  // one read-only copy per node, assembled by the local ranks together
  Placement placement;  // of the views
  int64_t owner_uid = -1;
  std::shared_ptr<KeptBuffers> kept;
  std::vector<ViewNeed> needs;  // view buffers to get (a slot's node copy already made is not one)
  // Read-only summons (`shared`): the slot of this summon, the node copies this rank would
  // make, and whether another local rank is making one this summon needs.
  std::shared_ptr<SummonSlot> slot;
  std::vector<std::pair<int32_t, KeptUse>> make;
  bool wait = false;
};

// Mixed precision: `count` elements of the shard `from` cast into `to` at byte `to_offset`.
struct SummonCast {
  std::shared_ptr<Buffer> from;
  DType from_dtype = DType::kFloat32;
  std::shared_ptr<Buffer> to;
  int64_t to_offset = 0;
  DType to_dtype = DType::kFloat32;
  int64_t count = 0;
};

// HYBRID_* over 1 < s < world ranks per shard group (strategy::Unshard::kRegroup): op `op`
// all-gathers the world into `scratch` (allocated after mu_, like the view's placement), and
// `scratch_offset` onwards, this rank's shard group's copy of the unit, goes into `view`.
struct SummonRegroup {
  size_t op = 0;
  std::shared_ptr<Buffer> view;
  int64_t scratch_offset = 0;  // bytes
  int64_t scratch_bytes = 0;
  int64_t bytes = 0;  // of the unit in `dtype`: what goes into `view`
  DType dtype = DType::kFloat32;
  std::shared_ptr<Buffer> scratch;
};

// A summon OpenSummonLocked opened: what the steps after mu_ need.
struct Modules::SummonStart {
  SummonResult result;
  std::vector<collective::CollectiveOp> ops;
  std::shared_ptr<collective::CollectiveGroup> coll;
  std::shared_ptr<SummonSlot> shared_slot;  // a read-only copy several local ranks assemble
  std::vector<int32_t> shared_ranks;        // they are the group's local ranks
  // HYBRID_* across daemons (kShardGroupGather): no ops, each rank's shard copied (`casts`).
  bool shard_group_gather = false;
  // NO_SHARD: the whole shard into the view (dst, src).
  std::vector<std::pair<std::shared_ptr<Buffer>, std::shared_ptr<Buffer>>> copies;
  // Compute summons of mixed-precision units: each shard into its low-precision view, before
  // the all-gather (the ops read what the casts wrote).
  std::vector<SummonCast> casts;
  std::vector<SummonRegroup> regroups;
};

namespace summon_steps {

// Takes the buffers of `needs` not in `got` yet from `kept`. Allocates: REQUIRES no mu_.
template <typename Needs, typename Got>
inline absl::Status GetViewBuffers(KeptBuffers& kept, const Needs& needs, BufferKind kind,
                                   int64_t owner_uid, Placement placement, Got* got) {
  for (const auto& need : needs) {
    if (got->contains({need.unit, need.use})) continue;
    absl::StatusOr<std::shared_ptr<Buffer>> b =
        kept.Get(need.key, kind, need.bytes, need.label, owner_uid, placement);
    if (!b.ok()) return b.status();
    (*got)[{need.unit, need.use}] = *std::move(b);
  }
  return absl::OkStatus();
}

// Takes the buffers of `needs` not in `got` yet that `kept` has ready (no allocation, no
// syscall: safe under mu_).
template <typename Needs, typename Got>
inline void TryKept(KeptBuffers& kept, const Needs& needs, Placement placement, Got* got) {
  for (const auto& need : needs) {
    if (got->contains({need.unit, need.use})) continue;
    if (std::shared_ptr<Buffer> b = kept.TryGet(need.key, placement)) {
      (*got)[{need.unit, need.use}] = std::move(b);
    }
  }
}

template <typename Needs, typename Got>
inline bool AllAtHand(const Needs& needs, const Got& got) {
  for (const auto& need : needs) {
    if (!got.contains({need.unit, need.use})) return false;
  }
  return true;
}

// A summon re-decides after each round of allocations; a round only repeats when a node copy
// another local rank was making vanished in the gap (its slot was dropped), so this bound is
// never reached in practice.
inline constexpr int kSummonRounds = 4;

}  // namespace summon_steps

}  // namespace flatshard::server
