#pragma once
// NodeAssembly: where a daemon's local ranks meet on the one read-only copy of a summon they
// share (SummonSlot). Each local rank's part arrives here once done: its all-gather into the
// copy (one daemon holds the whole world), or, for HYBRID_* across daemons, its own shard
// copied into its block (strategy::Unshard::kShardGroupGather: no collective). One rank's part
// may be done before the copy is whole, so every local rank is answered once all of them
// arrived, with the first error if any part failed; a failure answers every waiting rank at
// once (a rank that died never arrives: nobody waits for it).
//
// Deadlines: a collective's deadline bounds a part that ran one (it fails, and that failure
// answers). A part that ran none passes its summon's deadline: a rank still waiting then is
// answered DEADLINE_EXCEEDED naming the local ranks that did not arrive, never left hanging;
// a local rank whose session ends (Modules::DropSummons) fails the wait at once (Fail).
//
// Thread safety: thread-safe. Answers run on the arriving thread or the assembly's deadline
// thread, never under a lock.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/collective/deadline_timer.h"
#include "server/module/module.h"

namespace flatshard::server {

class NodeAssembly {
 public:
  NodeAssembly() : timer_(std::make_shared<collective::DeadlineTimer>()) {}

  // Rank `rank`'s part of `slot` ended with `part`; `answer` runs once every rank of `locals`
  // arrived (OK or the first error), at once on a failure, or at `deadline` (when set) if a
  // local rank is still missing then. `what` names the summon in that error ("group g rank r:
  // summon of 'layer'").
  void Arrive(const std::shared_ptr<SummonSlot>& slot, int32_t rank,
              const std::vector<int32_t>& locals, absl::Status part,
              std::optional<absl::Time> deadline, const std::string& what,
              absl::AnyInvocable<void(absl::Status)> answer);

  // Local rank `rank` will not arrive at `slot` (its session ended): unless it arrived already
  // or the copy is whole, `why` answers every waiting rank and every later arrival.
  void Fail(const std::shared_ptr<SummonSlot>& slot, int32_t rank, const absl::Status& why);

 private:
  const std::shared_ptr<collective::DeadlineTimer> timer_;
};

}  // namespace flatshard::server
