#pragma once
// Checkpoints' hold on a module's committed copies (internal to server/checkpoint/).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/manifest.h"
#include "common/plan.h"
#include "common/state_spec.h"
#include "server/checkpoint/checkpoints.h"

namespace flatshard::server {

struct Checkpoints::CheckpointHold {
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

}  // namespace flatshard::server
