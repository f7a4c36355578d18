#pragma once
// The flat buffer of one unit (FSDP's FlatParameter): where each parameter sits, how much
// padding there is, and which slice each rank owns (semantics.md §2).
//
//   use_orig_params=false: params back to back; shards follow torch.chunk:
//     shard_numel = ceil(numel / W), padded_numel = shard_numel * W.
//   use_orig_params=true: each param starts at a multiple of 16 / itemsize elements, the
//     total is padded to a multiple of W, then split evenly.
//   NO_SHARD keeps the whole buffer on every rank (shard_numel = padded_numel).
// Thread-safe for concurrent reads (immutable after Create).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace flatshard {

// Half-open range of elements [begin, end).
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend bool operator==(const ElementRange&, const ElementRange&) = default;
};

struct FlatLayoutOptions {
  DType dtype = DType::kFloat32;
  // FSDP use_orig_params=true: 16-byte alignment of every param and padding to `pad_world_size`.
  bool align = false;
  // Ranks the buffer is padded for (the process group of the unit's FlatParamHandle).
  int pad_world_size = 1;
  // Ranks the buffer is split over: pad_world_size when sharded, 1 for NO_SHARD.
  int shard_world_size = 1;
};

class FlatLayout {
 public:
  // Alignment FSDP uses with use_orig_params=true, in bytes.
  static constexpr int64_t kAlignmentBytes = 16;

  // `numels`: the params' element counts in flat order.
  // INVALID_ARGUMENT when a world size is < 1 or the buffer would exceed 2^63 elements.
  static absl::StatusOr<FlatLayout> Create(absl::Span<const int64_t> numels,
                                           const FlatLayoutOptions& options);

  // Element offset of param i in the unsharded buffer.
  const std::vector<int64_t>& offsets() const { return offsets_; }
  // Sum of the params' numels (no padding).
  int64_t numel() const { return numel_; }
  // End of the last param: numel() plus alignment padding between params.
  int64_t data_end() const { return data_end_; }
  // Length of the unsharded buffer with all padding.
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  int shard_world_size() const { return shard_world_size_; }
  // Alignment plus world-size padding elements.
  int64_t padding_numel() const { return padded_numel_ - numel_; }

  // The slice of the padded buffer that shard rank `r` owns.
  // REQUIRES: 0 <= r < shard_world_size().
  ElementRange ShardRange(int r) const;
  // ShardRange(r) without world-size padding: its intersection with [0, data_end()); empty
  // for high ranks of a small unit (FSDP `_get_unpadded_shard`).
  ElementRange UnpaddedShardRange(int r) const;

 private:
  std::vector<int64_t> offsets_;
  int64_t numel_ = 0;
  int64_t data_end_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  int shard_world_size_ = 1;
};

}  // namespace flatshard
