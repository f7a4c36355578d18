#pragma once
// Modules::WritebackEnd: the state every step of a writeback End after its agreement shares
// (end.cc, end_vote.cc; an init End settles in init_undo.cc).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/module/modules.h"

namespace flatshard::server {

// A writeback End every step after the agreement shares (read-only once made).
struct Modules::WritebackEnd {
  Caller caller;
  uint64_t summon = 0;
  std::string module;
  uint64_t k = 0;
  const Plan* plan = nullptr;
  std::vector<UnitShard> shards;
  std::vector<internal::DurablePair> durable;
  bool is_init = false;
  uint64_t generation = 0;  // the rank's committed generation when the End started
  // Restarts, host daemons with a state directory: the copies into the committed copies wait
  // until every local rank has written back into its shards (EndArrive), so that a daemon
  // killed during them comes back with every rank at one generation.
  bool batched = false;
  // Batched, and other daemons host ranks (not an init): the daemons vote once their ranks
  // wrote back, before any copy (VoteEnd, server/durable/commit_votes.cc).
  bool vote = false;
  std::shared_ptr<collective::CollectiveGroup> coll;  // the vote's
  int32_t world_size = 0;
  absl::Time deadline;
  // An init End: its summon's slot, where the daemon's local ranks' init Ends meet
  // (NodeAssembly), and those ranks.
  std::shared_ptr<SummonSlot> slot;
  std::vector<int32_t> locals;

  // An init End of this rank ended here with `own` (OK: applied into its shards). The daemon
  // decides the initialisation once for all its local ranks: initialised when every one's
  // applied, else no local rank's End is OK. `done` gets this rank's answer once decided
  // (init_undo.cc).
  void SettleInit(Modules& modules, absl::Status own, StatusCallback done) const;

  uint64_t target() const { return is_init ? generation : generation + 1; }
  const char* kind() const { return is_init ? "init" : "end"; }
};

}  // namespace flatshard::server
