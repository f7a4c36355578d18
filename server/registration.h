#pragma once
// The registration exchange (GroupManager::Register's collective part), one rank's view:
//
//   1. Plan       GroupManager plans the manifest under the policy (outside its lock).
//   2. Allocate   AllocateRegistration: this rank's shards (zeros), their committed copies
//                 and, for the FROM_* init modes, the full init buffers (outside the lock).
//   3. Agree      AgreeOnRegistration: every rank puts one record (plan fingerprint, unit
//                 count, init mode, whether planning and allocation succeeded, why not) into an
//                 all-gather over the group's collectives, so that every rank reaches the same
//                 verdict from the same records: all commit or none. When the fingerprints
//                 differ, two more all-gathers find the first differing unit (per-unit
//                 digests) and describe it on both sides (one-line summaries), so that every
//                 rank names the same difference.
//   4. Commit     GroupManager::FinishRegister installs the module under its lock (or drops
//                 the buffers on a refusal).
//
// The verdict's errors, in the order they are checked (identical on every rank):
//   a rank's plan was refused      its own: the planner's status; others: INVALID_ARGUMENT
//                                  "group G: rank K's registration of module M was refused: ..."
//   a corrupt record               INTERNAL "... rank K's registration record claims N units"
//   different plans                INVALID_ARGUMENT "group G: ranks registered different models
//                                  for module M: first difference at unit U: rank 0 has ...,
//                                  rank K has ..." (or the unit counts, or "outside the units")
//   different init modes           INVALID_ARGUMENT "... rank 0 and rank K asked for different
//                                  init modes"
//   a rank could not allocate      RESOURCE_EXHAUSTED "group G: rank K could not allocate the
//                                  shards of module M: ..."
// and the collectives' own errors (DEADLINE_EXCEEDED, ABORTED, UNAVAILABLE) as they come.
//
// Thread-compatible values; AgreeOnRegistration may be called from any thread and calls
// `done` exactly once, on the thread that completes the last all-gather (never under a lock
// of its own).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/plan.h"
#include "common/rpc_types.h"
#include "server/collective/collective_engine.h"
#include "server/module/module.h"
#include "server/shard_store.h"

namespace flatshard::server {

// Step 2: one rank's memory for a registration. On failure every buffer is released and
// `status` says why (the ShardStore's error).
struct RegistrationBuffers {
  std::vector<UnitShard> shards;                      // per unit, zeros
  std::vector<std::shared_ptr<Buffer>> committed;     // per unit: the committed copies
  std::vector<std::shared_ptr<Buffer>> init_buffers;  // per unit; null where none
  absl::Status status;
};

// Allocates `caller`'s buffers for `plan` of `module` in `store` at `placement`: a shard and
// its committed copy per unit, and the full init buffer of each unit when `init` asks this rank
// for initial values (kFromEveryRank; kFromRank0 on rank 0). May block (shm creation, device
// allocation): never call it under a lock.
RegistrationBuffers AllocateRegistration(ShardStore& store, const Plan& plan, const Caller& caller,
                                         const std::string& module, InitMode init,
                                         Placement placement);

// Step 3: what this rank brings to the agreement.
struct RegistrationProposal {
  std::string group;
  int32_t rank = 0;
  int32_t world_size = 0;
  std::string module;
  // This rank's plan, or why planning refused the manifest or policy (the refused rank still
  // takes part, so the other ranks fail at once too). Shared with the caller, which commits it.
  std::shared_ptr<const absl::StatusOr<Plan>> plan;
  InitMode init = InitMode::kZeros;
  absl::Status allocation;  // RegistrationBuffers::status
};

// Runs the agreement of `proposal` on `coll` (REQUIRES: `proposal.rank` is local to it); each
// all-gather gets the time left until `deadline` on `clock`. `done` gets OK when every rank
// planned the same model with the same init mode and allocated it, else the verdict (above).
void AgreeOnRegistration(std::shared_ptr<collective::CollectiveGroup> coll,
                         RegistrationProposal proposal, absl::Time deadline, Clock* clock,
                         absl::AnyInvocable<void(absl::Status)> done);

}  // namespace flatshard::server
