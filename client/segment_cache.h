#pragma once
// Client internals: the per-client cache of mapped daemon segments, and the views built over
// them (DESIGN "Data paths": map each segment once, then only pointer arithmetic).
//
//   SegmentCache       maps a segment the first time a reply names it, then returns the same
//                      mapping: a steady-state summon makes no mmap call. Segments the daemon
//                      freed are unmapped once no view uses them (DropUnlinked), so they do
//                      not keep node shared memory alive. Device segments (the
//                      daemon's GPU pool slabs) are opened through CUDA IPC once per slab in
//                      the same way (DeviceMemoryOpener, client/cuda_ipc.h).
//   ModuleLayout       computed once per registered module from its plan: each unit's
//                      parameters as (FQN, shape, byte offset), tied FQNs resolved, an FQN
//                      index; so building a summon's views is pointer arithmetic.
//   ViewBuilder        ModuleLayout + the mapped range of each unit -> ParamViews.
//
// Everything here takes domain types (no protobuf): client.cc converts MemoryHandle into
// SegmentRange. Ranges and layouts come from the daemon, so inconsistencies between them are
// the daemon's bugs and fail with INTERNAL.
//
// Thread safety: SegmentCache is thread-safe. ModuleLayout is immutable after Create and
// safe to share. ViewBuilder is thread-compatible.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/cuda_ipc.h"
#include "common/dtype.h"
#include "common/plan.h"
#include "common/shm_segment.h"
#include "flatshard/client.h"

namespace flatshard::client::internal {

// A byte range of a daemon segment: the domain form of proto MemoryHandle.
struct SegmentRange {
  std::string segment;         // shm name, with its leading "/"; device: the slab's id
  uint64_t segment_bytes = 0;  // bytes to map (the whole segment or slab)
  uint64_t offset = 0;         // start of the range in the segment
  uint64_t bytes = 0;
  // Device memory (proto MemoryHandle.cuda set): the slab's cudaIpcMemHandle_t bytes and the
  // GPU holding it. Host shared memory when `cuda` is false.
  bool cuda = false;
  std::string cuda_ipc_handle;
  std::string device_uuid;
};

// A range inside a cached mapping. `mapping` (a ShmSegment, or a DeviceMapping) keeps the
// segment mapped while this (or a copy) lives, even after the cache forgot it.
struct MappedRange {
  std::shared_ptr<const void> mapping;
  void* data = nullptr;  // start of the range; nullptr when bytes is 0
  uint64_t bytes = 0;
  // Whether writes are kept. Device memory has no read-only mapping, so for it this states
  // the contract only.
  bool writable = false;
  int device = -1;  // this process's CUDA ordinal of `data`; -1 for host memory
};

// Maps daemon segments once per client. A host segment has at most two mappings: one
// read-only (for summons without writeback, so stray writes fault instead of corrupting a
// copy other processes share) and one read-write; each is made on first use and then reused.
// A device slab has one IPC mapping, shared by read-only and writable ranges.
class SegmentCache {
 public:
  // When more than `max_entries` segments are cached, Map drops those no MappedRange uses
  // any more, so segments the daemon replaced do not stay mapped (and their pages alive).
  // `opener` opens device slabs; nullptr: the real one (NewCudaIpcOpener). It is called only
  // for device ranges, so host-only use never touches CUDA.
  explicit SegmentCache(size_t max_entries = 4096,
                        std::unique_ptr<DeviceMemoryOpener> opener = nullptr);
  SegmentCache(const SegmentCache&) = delete;
  SegmentCache& operator=(const SegmentCache&) = delete;
  ~SegmentCache();

  // The range, mapped. Host: maps `range.segment_bytes` of the segment (ShmSegment::Open)
  // when no mapping with the wanted access exists yet, or the cached one is smaller. Device:
  // opens the slab through the opener when it is not cached yet (or came with another IPC
  // handle); concurrent first uses of one slab open it once.
  // Errors: INTERNAL when the range does not fit in segment_bytes or names no segment, or a
  // device handle has the wrong size; ShmSegment::Open's errors (NOT_FOUND: the daemon
  // removed it; FAILED_PRECONDITION: the segment is smaller than segment_bytes;
  // PERMISSION_DENIED); the opener's (NOT_FOUND: GPU not visible here; FAILED_PRECONDITION:
  // no usable GPU in this process), prefixed with the segment and GPU; DEADLINE_EXCEEDED when
  // another thread's open of the same slab takes over a minute.
  absl::StatusOr<MappedRange> Map(const SegmentRange& range, bool writable);

  // Unmaps the cached host segments that no MappedRange uses any more and whose name the
  // daemon has unlinked (or reused for another segment): the daemon freed them, and only
  // this process's mapping would keep their pages alive. Segments still linked stay mapped,
  // so a steady state makes no mmap call. One stat(2) per unused cached segment, none under
  // the lock. Returns how many segments it dropped.
  size_t DropUnlinked();

  // Forgets every mapping (a new session). Ranges already handed out stay valid.
  void Clear();

  // Successful host maps (ShmSegment::Open calls) since construction. Never decreases.
  int64_t map_calls() const;
  // Successful device opens (DeviceMemoryOpener::Open calls) since construction.
  int64_t ipc_open_calls() const;
  // Segments with at least one cached mapping (host and device).
  size_t size() const;

 private:
  struct Entry {
    std::shared_ptr<const ShmSegment> read_only;
    std::shared_ptr<const ShmSegment> read_write;
    // The segment file's identity when first mapped (0, 0: unknown), to tell a name the
    // daemon reused from the segment we mapped.
    uint64_t dev = 0;
    uint64_t ino = 0;
  };
  struct DeviceEntry {
    std::string ipc_handle;  // the handle it was opened from
    std::shared_ptr<const DeviceMapping> mapping;
  };
  absl::StatusOr<MappedRange> MapHost(const SegmentRange& range, bool writable);
  absl::StatusOr<MappedRange> MapDevice(const SegmentRange& range, bool writable);
  // Drops unused mappings into `dropped`, which the caller destroys after unlocking (closing
  // an IPC mapping is a CUDA call).
  void EvictUnusedLocked(std::vector<std::shared_ptr<const void>>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_entries_;
  const std::unique_ptr<DeviceMemoryOpener> opener_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, DeviceEntry> device_entries_ ABSL_GUARDED_BY(mu_);
  // Device slabs being opened (outside mu_) by some thread; others wait for it.
  std::vector<std::string> opening_ ABSL_GUARDED_BY(mu_);
  size_t evict_above_ ABSL_GUARDED_BY(mu_);
  int64_t map_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ipc_open_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// One parameter of a unit, relative to the unit's flat buffer.
struct ViewTemplate {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t byte_offset = 0;
};

struct UnitTemplate {
  int32_t index = 0;     // PlanUnit::index
  int32_t position = 0;  // position in Plan::units
  DType dtype = DType::kFloat32;
  int64_t item_size = 4;
  int64_t numel = 0;         // elements of the unpadded flat buffer
  int64_t padded_numel = 0;  // elements of the full flat buffer the daemon hands out
  int64_t shard_numel = 0;
  int64_t extent_bytes = 0;  // end of the last view: a range must hold at least this
  // Params in flat order, then each tied FQN (PlanUnit::shared) with its target's offset.
  std::vector<ViewTemplate> views;
};

// The views of a registered module's plan, precomputed. Immutable.
class ModuleLayout {
 public:
  // Errors: INVALID_ARGUMENT when the plan is inconsistent: duplicate unit indices or FQNs,
  // negative offsets or sizes, a view past padded_numel, byte offsets beyond int64, a tied
  // FQN whose target is not in its unit.
  static absl::StatusOr<std::shared_ptr<const ModuleLayout>> Create(
      std::shared_ptr<const Plan> plan);

  const Plan& plan() const { return *plan_; }
  const std::shared_ptr<const Plan>& shared_plan() const { return plan_; }
  const std::vector<UnitTemplate>& units() const { return units_; }
  // The unit with PlanUnit::index `index`; nullptr if none.
  const UnitTemplate* FindUnit(int32_t index) const;
  // (unit position, view index in that unit) of `fqn`; nullptr if no unit holds it.
  const std::pair<int32_t, int32_t>* FindFqn(absl::string_view fqn) const;
  // Mixed precision: `layout` with each unit in its compute dtype (the views of a summon with
  // compute_precision) or its reduce dtype (the full gradient of a reduce-scatter); `layout`
  // itself when no unit has one.
  static std::shared_ptr<const ModuleLayout> Compute(
      const std::shared_ptr<const ModuleLayout>& layout);
  static std::shared_ptr<const ModuleLayout> Reduce(
      const std::shared_ptr<const ModuleLayout>& layout);

 private:
  ModuleLayout() = default;

  std::shared_ptr<const Plan> plan_;
  std::shared_ptr<const ModuleLayout> compute_;  // null: no unit has a compute dtype
  std::shared_ptr<const ModuleLayout> reduce_;   // null: no unit has a reduce dtype
  std::vector<UnitTemplate> units_;
  absl::flat_hash_map<int32_t, int32_t> position_by_index_;
  absl::flat_hash_map<std::string, std::pair<int32_t, int32_t>> by_fqn_;
};

// Builds a ParamViews from mapped unit buffers.
class ViewBuilder {
 public:
  explicit ViewBuilder(std::shared_ptr<const ModuleLayout> layout);

  // Appends the views of unit `index` over `range` (the unit's full flat buffer, or its
  // gradient).
  // Errors: INTERNAL when the unit is unknown or already added, or when the range is shorter
  // than the unit's views reach.
  absl::Status AddUnit(int32_t index, const MappedRange& range);

  // The views added so far. The builder is empty afterwards.
  ParamViews Build();

 private:
  ParamViews views_;
};

// OK when `mapped` holds `elements` elements of `dtype`; INTERNAL naming `what` otherwise.
absl::Status CheckRangeHolds(const MappedRange& mapped, int64_t elements, DType dtype,
                             absl::string_view what);

}  // namespace flatshard::client::internal
