#pragma once
// Internal to server/checkpoint/: the hold on a module's committed copies, and the pool of
// file threads saves and loads share.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/state_spec.h"
#include "common/status_macros.h"
#include "server/checkpoint/checkpoints.h"

namespace flatshard::server {

struct Checkpoints::CheckpointHold {
  std::string group;
  std::string module;
  int32_t world_size = 0;
  Plan plan;
  std::vector<int32_t> ranks;                                   // the local ranks, ascending
  std::vector<std::vector<UnitShard>> shards;                   // by position in `ranks`
  std::vector<std::vector<std::shared_ptr<Buffer>>> committed;  // by position in `ranks`
  uint64_t generation = 0;                                      // of every local rank
  Manifest manifest;               // for checkpoint::TiedAliases (computed without mu_)
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

// The raw pointers RankDevices::CopyEach takes.
inline std::vector<const Buffer*> Raw(const std::vector<std::shared_ptr<Buffer>>& v) {
  std::vector<const Buffer*> out;
  for (const auto& b : v) out.push_back(b.get());
  return out;
}

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

// Bytes of one rank's file: its shards and optimizer state.
inline int64_t RankBytes(const Plan& plan, const std::vector<StateSpec>& specs) {
  int64_t n = 0;
  for (const PlanUnit& u : plan.units) {
    n += u.shard_numel * ItemSize(u.dtype);
    for (const StateSpec& st : specs) n += st.Numel(u.shard_numel) * ItemSize(st.dtype);
  }
  return n;
}

inline absl::Status CheckStateSize(const Buffer& b, const PlanUnit& u, const StateSpec& st) {
  const int64_t want = st.Numel(u.shard_numel) * ItemSize(st.dtype);
  if (b.bytes() >= want) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("unit ", u.index, ": a ", b.bytes(),
                                          "-byte buffer for optimizer state \"", st.name, "\" of ",
                                          want, " bytes"));
}

inline absl::Status CheckSize(const Buffer& b, const PlanUnit& u) {
  if (b.bytes() >= u.shard_numel * ItemSize(u.dtype)) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("unit ", u.index, ": a ", b.bytes(),
                                          "-byte buffer for a shard of ",
                                          u.shard_numel * ItemSize(u.dtype), " bytes"));
}

// A caller who is neither root nor the daemon's uid may only have the daemon write into, or
// read from, a path that caller owns (the directory; for a new directory, its parent; a
// safetensors file): the daemon's privileges must not reach other users' files.
inline absl::Status CheckOwner(const CheckpointArgs& args, const std::string& path,
                               bool parent_if_missing) {
  if (args.privileged) return absl::OkStatus();
  struct stat st;
  std::string at = path;
  if (::stat(at.c_str(), &st) != 0 && parent_if_missing) {
    at = checkpoint::internal::DirOf(path);
    if (::stat(at.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat(at, ": ", std::strerror(errno)));
    }
  } else if (::stat(at.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(at, ": ", std::strerror(errno)));
  }
  if (args.uid >= 0 && static_cast<int64_t>(st.st_uid) == args.uid) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      at, " belongs to uid ", st.st_uid, ", not to the caller (uid ",
      args.uid < 0 ? std::string("(remote)") : absl::StrCat(args.uid),
      "): the daemon reads and writes checkpoints only in the caller's own directories"));
}

}  // namespace checkpoint_internal

}  // namespace flatshard::server
