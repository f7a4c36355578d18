#pragma once
// DeviceVersions: published versions placed in GPU memory (README "Versions in GPU memory",
// issue 25). A publish with options.device = N builds the version as a host one is built (the
// committed copies, cast on the way) into a host staging buffer, then copies it once to a
// block of GPU N's pool, allocated for the publisher's uid (its device bytes count against
// --gpu_memory_quota_mib_per_uid; the GPU's pool limit bounds them too). Readers open the
// pool slab through CUDA IPC (the simulated GPUs of --simulate_gpus: by shm name).
//
// Rules this owner checks:
// - the GPU must be one the daemon uses (FAILED_PRECONDITION naming it and the daemon's GPUs);
// - CUDA IPC maps a whole pool slab read-write for every process holding its handle, so a
//   device version grants no other reader: reader_uids and reader_token are refused
//   (INVALID_ARGUMENT naming the field); only the owner uid and admins open it;
// - a group on several daemons places the version in GPU N of each daemon (each uploads the
//   leader's host bytes itself, publisher.h); copies to readers' daemons (--weights_sources)
//   and the state directory are host only (device versions do not survive a daemon restart).
//
// Thread safety: thread-safe (immutable after construction; the contexts are thread-safe).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace flatshard::gpu {
class DeviceContext;
}  // namespace flatshard::gpu

namespace flatshard::server {

class Buffer;
class ShardStore;

class DeviceVersions {
 public:
  DeviceVersions(ShardStore* store, std::vector<std::shared_ptr<gpu::DeviceContext>> gpus);

  // OK when a version of `name` may go to GPU `device` with these grants. Errors:
  // INVALID_ARGUMENT for device < 0 or grants (naming options.reader_uids or
  // options.reader_token); FAILED_PRECONDITION for a GPU this daemon does not use.
  absl::Status Check(const std::string& name, int device, const std::vector<int64_t>& reader_uids,
                     const std::string& reader_token) const;

  // A block of GPU `device` holding a copy of `host` (all of its bytes), allocated for
  // `owner_uid` (the store's device quota). Errors: Check's; the store's RESOURCE_EXHAUSTED
  // (the uid's device quota, the GPU's pool limit); the copy's (CUDA, DEADLINE_EXCEEDED).
  absl::StatusOr<std::shared_ptr<Buffer>> Upload(const Buffer& host, int device,
                                                 const std::string& label, int64_t owner_uid) const;

 private:
  gpu::DeviceContext* Find(int device) const;

  ShardStore* const store_;
  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
};

}  // namespace flatshard::server
