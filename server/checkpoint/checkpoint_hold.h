#pragma once
// Internal to server/checkpoint/: the hold on a module's committed copies, and the pool of
// file threads saves and loads share.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/manifest.h"
#include "common/status_macros.h"
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

namespace checkpoint_internal {

// Files written or read at once by one daemon.
inline constexpr int kCheckpointThreads = 8;

// Runs fn(i) for i in [0, n) on up to kCheckpointThreads threads; the first error wins.
inline absl::Status ParallelFor(size_t n, const std::function<absl::Status(size_t)>& fn) {
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

}  // namespace checkpoint_internal

}  // namespace flatshard::server
