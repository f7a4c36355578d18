#pragma once
// ShardStore owns all of the daemon's host memory, for every group: shards, gradient shards,
// unsharded buffers and staging buffers (DESIGN "Data paths"). Each buffer lives in its own
// shared-memory segment (common/shm_segment.h) that clients map by name; replies carry
// (segment name, offset, bytes) and parameter bytes never travel in gRPC messages.
//
//   ShardStore store({.segment_prefix = "flatshard", .memory_limit_bytes = 64 << 30});
//   FS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> shard,
//                       store.Allocate(BufferKind::kShard, bytes, "group=g unit=3 rank=1"));
//   ... reply {shard->segment_name(), shard->offset(), shard->bytes()} ...
//   shard.reset();  // the last reference frees: munmap, unlink, accounting
//
// Accounting: every committed buffer counts its `bytes` (as requested, not page-rounded) for
// its kind; the sum never exceeds `memory_limit_bytes`. An allocation that would exceed it
// fails with RESOURCE_EXHAUSTED and changes nothing. The same holds for the per-uid quotas
// (committed host bytes, live segments) and for the daemon's segment budget (each host
// segment holds a descriptor; the budget keeps the daemon below its descriptor limit).
//
// Steady-state summons without mmap: a client caches one mapping per segment, so a unit's
// unsharded buffer should keep its segment across summons. Keep the Buffer and Decommit() it
// on reshard (its pages go back to the kernel, accounting drops, clients' mappings stay valid
// and read zeros), then Commit() it on the next unshard (re-checked against the limit). Only
// kUnsharded and kStaging buffers may be decommitted; shards never lose their bytes that way.
//
// Placement (GPU daemons, issue "GPU backend"): a buffer lives in host shared memory (the
// default), in host shared memory page-locked for DMA (kHostPinned: offload_to_cpu copies), or
// in device memory of one GPU (kCuda: a block of that GPU's DevicePool, opened by trainers
// through CUDA IPC once per pool slab). Device bytes are accounted by the pool against its own
// limit (--gpu_memory_limit), not against memory_limit_bytes, which covers host memory only.
// Decommit() of a device buffer returns its block to the pool (the slab stays, so trainers'
// IPC mappings stay valid) and Commit() takes a fresh zeroed block, possibly at another
// offset: read data()/offset() after Commit.
//
// Lifetime: buffers may outlive the ShardStore (they share its accounting state). Shutdown()
// unlinks every live segment's name (daemon SIGTERM) so nothing is left in /dev/shm even if
// buffers are still referenced; their mappings stay valid until they are dropped.
//
// Thread safety: ShardStore and Buffer are thread-safe. A Buffer's bytes are not synchronized:
// who reads or writes them when is the caller's (GroupManager's) business.

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/shm_segment.h"
#include "server/collective/buffer.h"

namespace flatshard::gpu {
class DevicePool;
class DeviceBlock;
}  // namespace flatshard::gpu

namespace flatshard::server {

enum class BufferKind {
  kShard = 0,      // a rank's slice of a unit's flat buffer; lives as long as the registration
  kGradShard = 1,  // reduce-scattered gradients of a shard
  kUnsharded = 2,  // a unit's full flat buffer (all-gather target), mapped by clients
  kStaging = 3,    // transient buffers (incoming writeback, collective scratch)
};
inline constexpr int kNumBufferKinds = 4;

// "shard", "grad_shard", "unsharded", "staging".
absl::string_view BufferKindName(BufferKind kind);

struct ShardStoreOptions {
  // Segment names are "/<segment_prefix>.<pid>.<counter>" (MakeSegmentName).
  std::string segment_prefix = "flatshard";
  // Upper bound for the committed bytes of all kinds together. 0 refuses every non-empty
  // allocation; the default is effectively unlimited.
  int64_t memory_limit_bytes = std::numeric_limits<int64_t>::max();
  // GPU daemons: the pool of each device ordinal Allocate may place buffers on (null entries
  // for devices this daemon does not use). Empty: host memory only.
  std::vector<std::shared_ptr<gpu::DevicePool>> device_pools{};
  // Page-lock kHostPinned buffers (cudaHostRegister). False with simulated GPUs (no CUDA):
  // they are then plain host shared memory.
  bool pin_host_memory = true;
  // Per-uid quotas (the uid a buffer is allocated for, Allocate's `owner_uid`; -1, remote
  // callers, is one tenant too) so that one tenant cannot starve the others. 0: none.
  // Committed host bytes of one uid (--memory_quota_mib_per_uid).
  int64_t memory_quota_bytes_per_uid = 0;
  // Live host segments of one uid: each holds one of the daemon's descriptors
  // (--max_segments_per_uid).
  int64_t max_segments_per_uid = 0;
  // Live host segments of all uids together: the daemon's descriptor budget for segments,
  // below its RLIMIT_NOFILE so that sockets and files still open when it is reached.
  int64_t max_segments = 0;
  // Committed device bytes of one uid, all GPUs together (--gpu_memory_quota_mib_per_uid):
  // buffers Allocate places on a device for that uid. 0: none.
  int64_t device_quota_bytes_per_uid = 0;
};

// Where Allocate puts a buffer.
struct Placement {
  collective::MemoryKind kind = collective::MemoryKind::kHost;
  int device = -1;  // kCuda: the device ordinal (an index into device_pools)

  static Placement Host() { return {}; }
  static Placement Pinned() { return {collective::MemoryKind::kHostPinned, -1}; }
  static Placement Device(int device) { return {collective::MemoryKind::kCuda, device}; }
  bool on_device() const { return kind == collective::MemoryKind::kCuda; }
  friend bool operator==(const Placement&, const Placement&) = default;
};

// A snapshot of the accounting.
struct MemoryUsage {
  std::array<int64_t, kNumBufferKinds> bytes_by_kind{};  // committed bytes per kind
  int64_t total_bytes = 0;  // sum of bytes_by_kind; includes allocations still in flight
  int64_t limit_bytes = 0;
  int64_t buffers = 0;              // live buffers, committed or not (= live segments)
  int64_t decommitted_buffers = 0;  // of which decommitted
  int64_t device_bytes = 0;         // committed device buffers (not in total_bytes)

  int64_t bytes(BufferKind kind) const { return bytes_by_kind[static_cast<int>(kind)]; }
  // "shard=1024 grad_shard=0 unsharded=4096 staging=0 total=5120 limit=1048576 buffers=2".
  std::string DebugString() const;
};

namespace internal {
class StoreState;  // accounting shared by a ShardStore and its Buffers; shard_store.cc
}  // namespace internal

// One block of daemon memory: host memory in its own segment at offset 0, or a device block
// inside a pool slab at offset(). Created by ShardStore::Allocate, zero-filled, freed when the
// last shared_ptr drops.
class Buffer {
 public:
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  // Unmaps and unlinks the segment and returns the bytes to the accounting.
  ~Buffer();

  BufferKind kind() const { return kind_; }
  const Placement& placement() const { return placement_; }
  bool on_device() const { return placement_.on_device(); }
  // The memory as collectives see it.
  collective::MutableBuffer view(DType dtype) const;
  // Host: the shm name a client passes to ShmSegment::Open (with its leading "/"). Device:
  // "cuda-slab-<id>" of the current block's slab.
  std::string segment_name() const;
  // Bytes of the segment (host) or slab (device) the client maps or opens.
  int64_t segment_bytes() const;
  // Where the buffer starts in the segment or slab.
  int64_t offset() const;
  int64_t bytes() const { return bytes_; }
  // The daemon's pointer (a device pointer for kCuda); nullptr when bytes() is 0 or a device
  // buffer is decommitted. Host: valid until the Buffer is destroyed; device: until Decommit.
  void* data() const;
  // Device buffers: the slab's cudaIpcMemHandle_t bytes and the GPU's uuid; empty otherwise.
  std::string ipc_handle() const;
  std::string device_uuid() const;
  // Host buffers: the segment's descriptor (the store keeps it open; not to be closed), for
  // changing who may open the segment (server/publish/: read-only grants); -1 for device ones.
  int segment_fd() const { return on_device() ? -1 : segment_.fd(); }
  // Free text given to Allocate ("group=g unit=3 rank=1"), used in logs and errors.
  const std::string& label() const { return label_; }

  // False between Decommit() and Commit().
  bool committed() const;
  // Returns the pages to the kernel and the bytes to the accounting; the bytes read as zero
  // afterwards, here and in every client mapping, which all stay valid. No-op when already
  // decommitted. Nobody may write the buffer until Commit(): such writes would use memory the
  // accounting does not see.
  // Errors: FAILED_PRECONDITION for kShard and kGradShard buffers; the segment's error when
  // the kernel refuses (the buffer then stays committed).
  absl::Status Decommit();
  // Charges the bytes again and reserves the pages; the buffer is zero. No-op when committed.
  // Errors: RESOURCE_EXHAUSTED over the limit or when /dev/shm is full; FAILED_PRECONDITION
  // after ShardStore::Shutdown(). On error the buffer stays decommitted.
  absl::Status Commit();
  // Host buffers: the segment's name stays when the buffer goes (it is left for the next
  // daemon, or was never ours to remove: a refused adoption). No-op for device buffers.
  void Disown();

 private:
  friend class ShardStore;
  Buffer(std::shared_ptr<internal::StoreState> state, BufferKind kind, Placement placement,
         int64_t bytes, ShmSegment segment, std::shared_ptr<gpu::DeviceBlock> block,
         std::shared_ptr<gpu::DevicePool> pool, std::string label, int64_t owner_uid);

  const std::shared_ptr<internal::StoreState> state_;
  const BufferKind kind_;
  const Placement placement_;
  const int64_t bytes_;
  const int64_t owner_uid_;  // whose quotas it counts against (device buffers: device quota)
  // Host: immutable after construction except for its pages (Commit/Decommit, under mu_).
  ShmSegment segment_;
  bool pinned_ = false;  // segment_ is page-locked (cudaHostRegister); set by Allocate
  const std::shared_ptr<gpu::DevicePool> pool_;  // device buffers
  const std::string label_;
  mutable absl::Mutex mu_;  // serializes Commit/Decommit of this buffer
  bool committed_ ABSL_GUARDED_BY(mu_) = true;
  std::shared_ptr<gpu::DeviceBlock> block_ ABSL_GUARDED_BY(mu_);  // device; null decommitted
};

class ShardStore {
 public:
  // OK when `options` are usable: INVALID_ARGUMENT for a bad segment_prefix
  // (ValidateSegmentPrefix) or a negative memory_limit_bytes. Daemon config validation calls
  // it; a store built from bad options refuses every Allocate with the same error.
  static absl::Status ValidateOptions(const ShardStoreOptions& options);

  explicit ShardStore(ShardStoreOptions options);
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;
  // Does not free live buffers (they own their memory); see Shutdown().
  ~ShardStore();

  // A new zero-filled, committed buffer of `bytes` bytes (0 is allowed) in a fresh segment
  // named with the store's prefix, mode 0600. `label` is kept for logs and errors.
  // Errors: INVALID_ARGUMENT for bytes < 0 or bad options; RESOURCE_EXHAUSTED when the limit
  // would be exceeded (naming the kind, bytes requested, bytes in use and the limit), when a
  // per-uid quota or the segment budget would be (naming the uid, the quota and its usage) or when
  // /dev/shm, memory or descriptors run out; FAILED_PRECONDITION after Shutdown(). A failed
  // allocation changes nothing.
  // `owner_uid` >= 0 and not the daemon's uid: the segment is given to that uid (fchown, mode
  // still 0600), so a trainer running as another user can map it and nobody else can; needs
  // CAP_CHOWN (PERMISSION_DENIED otherwise). -1: the daemon's uid keeps it.
  // `placement`: host (default), pinned host (needs CUDA: FAILED_PRECONDITION without) or a
  // device of options().device_pools (FAILED_PRECONDITION for a device without a pool; the
  // pool's RESOURCE_EXHAUSTED over its limit). On a device, owner_uid gives no ownership
  // (CUDA IPC has none; the daemon's socket admission is the check there) but its bytes count
  // against that uid's device_quota_bytes_per_uid (RESOURCE_EXHAUSTED naming the uid, the
  // quota and its usage).
  absl::StatusOr<std::shared_ptr<Buffer>> Allocate(BufferKind kind, int64_t bytes,
                                                   absl::string_view label = "",
                                                   int64_t owner_uid = -1,
                                                   Placement placement = {});

  MemoryUsage Usage() const;
  // What one uid holds of the per-uid quotas.
  struct UidUsage {
    int64_t bytes = 0;         // committed host bytes
    int64_t segments = 0;      // live host segments
    int64_t device_bytes = 0;  // committed device bytes (device_quota_bytes_per_uid)
  };
  UidUsage UsageOf(int64_t uid) const;

  // Unlinks the name of every live segment and refuses later allocations and commits. The
  // buffers' mappings stay valid until they are dropped. Idempotent. Logs what it removed.
  void Shutdown();
  // As Shutdown(), but with `keep_durable` the segments of kShard and kGradShard buffers
  // (shards, committed copies, gradient shards) stay for the next daemon (--keep_shards):
  // only unsharded and staging buffers are unlinked.
  void Shutdown(bool keep_durable);

  // A restarted daemon takes over an existing segment of this store's prefix (state
  // directory re-adoption, GroupManager::AdoptGroups): its size must be exactly `bytes` and,
  // for `owner_uid` >= 0, it must belong to that uid. Charged as Allocate charges. The buffer
  // owns the name from now on. Errors: INVALID_ARGUMENT for another prefix; NOT_FOUND for a
  // missing segment; FAILED_PRECONDITION for a size or owner that differs; Allocate's
  // RESOURCE_EXHAUSTED. On error the segment is left as it was. `populate`: as
  // ShmSegment::Adopt's.
  absl::StatusOr<std::shared_ptr<Buffer>> Adopt(BufferKind kind, const std::string& segment_name,
                                                int64_t bytes, absl::string_view label = "",
                                                int64_t owner_uid = -1, bool populate = true);

  const ShardStoreOptions& options() const { return options_; }

 private:
  absl::StatusOr<std::shared_ptr<Buffer>> AllocateOnDevice(BufferKind kind, int64_t bytes,
                                                           absl::string_view label,
                                                           Placement placement, int64_t owner_uid);

  const ShardStoreOptions options_;
  const absl::Status options_status_;  // ValidateOptions(options_)
  const std::shared_ptr<internal::StoreState> state_;
};

}  // namespace flatshard::server
