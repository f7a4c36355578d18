#pragma once
// The daemon's device memory: a DevicePool carves blocks out of a few large backing
// allocations ("slabs") on one GPU, so that a training loop that unshards and reshards every
// step reuses the same slabs instead of calling cudaMalloc per step, and trainers, which open
// each slab once through CUDA IPC and cache the mapping, make zero IPC opens in steady state.
//
// Policy: first fit over the slabs in creation order, with neighbouring free ranges coalesced.
// Requests above `slab_bytes` get a slab of their own. A slab whose last block is freed stays
// reserved for reuse; slabs are returned to the driver only by Trim(), when a new slab would
// pass `limit_bytes` (empty slabs are freed first, just enough of them), when the allocator
// reports out-of-memory (empty slabs are freed and the allocation retried once), or, once the
// pool is gone, when their last block is freed.
//
// The allocator is called without the pool's lock held (it may be slow: cudaMalloc, memset).
//
// Thread safety: DevicePool is thread-safe. A DeviceBlock is immutable; its destructor may run
// on any thread, also after the DevicePool was destroyed.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::gpu {

// One backing allocation ("slab") of a pool: what a trainer opens through CUDA IPC once.
struct Slab {
  uint64_t id = 0;       // unique per process, never reused
  void* base = nullptr;  // device pointer
  size_t bytes = 0;
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes (kIpcHandleBytes), for the client
};

// Where slabs come from. Real: cudaMalloc + cudaIpcGetMemHandle on one device. Tests: a fake.
// Implementations must be thread-safe.
class SlabAllocator {
 public:
  virtual ~SlabAllocator() = default;
  // A new slab of exactly `bytes` (> 0). RESOURCE_EXHAUSTED when the device is out of memory.
  virtual absl::StatusOr<Slab> Allocate(size_t bytes) = 0;  // Slab::id filled by the pool
  // Returns a slab from Allocate. Errors are logged, not returned (nothing could act on them).
  virtual void Free(const Slab& slab) = 0;
  virtual absl::Status Zero(void* device_ptr, size_t bytes) = 0;  // memset 0, completed on return
};

// A SlabAllocator on CUDA device `device`: cudaMalloc, cudaIpcGetMemHandle, cudaMemsetAsync on
// its own non-blocking stream (waited for with a deadline), cudaFree.
// Errors: FAILED_PRECONDITION when built without CUDA, without a usable GPU, or when `device`
// is not one of this process's GPUs.
absl::StatusOr<std::unique_ptr<SlabAllocator>> MakeCudaSlabAllocator(int device);

struct DevicePoolOptions {
  int device = 0;
  std::string device_uuid;
  int64_t limit_bytes = std::numeric_limits<int64_t>::max();  // on reserved (slab) bytes
  size_t slab_bytes = size_t{256} << 20;  // requests above it get a dedicated slab
  size_t alignment = 512;                 // of every block's offset; a power of two
};

struct DevicePoolUsage {
  int64_t reserved_bytes = 0;  // slabs (what cudaMalloc holds)
  int64_t in_use_bytes = 0;    // live blocks (as requested)
  int64_t limit_bytes = 0;
  int64_t slabs = 0;
  int64_t blocks = 0;  // live blocks, zero-byte ones included
  // "reserved=… in_use=… limit=… slabs=… blocks=…"
  std::string DebugString() const;
};

namespace internal {
struct PoolState;
}  // namespace internal

// A live allocation inside a slab; returns to the pool when the last shared_ptr drops (the
// pool may be gone by then: blocks keep the pool's state alive).
class DeviceBlock {
 public:
  ~DeviceBlock();
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  void* data() const;    // device pointer; nullptr for 0 bytes
  size_t bytes() const;  // as requested
  int device() const;
  const std::string& device_uuid() const;
  uint64_t slab_id() const;  // 0 for a zero-byte block (it has no slab)
  size_t slab_bytes() const;
  size_t offset() const;                  // from the slab's base
  const std::string& ipc_handle() const;  // the slab's; empty for a zero-byte block
  const std::string& label() const;

 private:
  friend class DevicePool;
  DeviceBlock(std::shared_ptr<internal::PoolState> state, Slab slab, size_t offset, size_t bytes,
              size_t reserved_bytes, std::string label);

  std::shared_ptr<internal::PoolState> state_;
  Slab slab_;  // a copy of the slab's description (id, base, bytes, handle)
  size_t offset_ = 0;
  size_t bytes_ = 0;
  size_t reserved_bytes_ = 0;  // bytes taken from the slab (`bytes_` rounded to the alignment)
  std::string label_;
};

class DevicePool {
 public:
  // REQUIRES: `allocator` is not null; `options.alignment` is a power of two.
  static std::shared_ptr<DevicePool> Create(DevicePoolOptions options,
                                            std::unique_ptr<SlabAllocator> allocator);
  // Frees the empty slabs now; slabs that still hold blocks are freed with their last block.
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // Zero-filled block of `bytes` (0 allowed). RESOURCE_EXHAUSTED when reserving a new slab
  // would pass limit_bytes even after freeing empty slabs (message names device, label, bytes
  // requested, reserved, in use and the limit) or when cudaMalloc fails; nothing changes then.
  // Errors of SlabAllocator::Zero are returned as they are (the block is released again).
  absl::StatusOr<std::shared_ptr<DeviceBlock>> Allocate(size_t bytes, absl::string_view label);
  DevicePoolUsage Usage() const;
  // Frees slabs with no live block. Returns bytes released.
  int64_t Trim();
  int device() const;
  const std::string& device_uuid() const;

 private:
  explicit DevicePool(std::shared_ptr<internal::PoolState> state);
  std::shared_ptr<internal::PoolState> state_;
};

}  // namespace flatshard::gpu
