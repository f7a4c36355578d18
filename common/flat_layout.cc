#include "common/flat_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace flatshard {
namespace {

absl::Status Overflow() {
  return absl::InvalidArgumentError("unit's flat buffer would exceed 2^63 elements");
}

}  // namespace

absl::StatusOr<FlatLayout> FlatLayout::Create(absl::Span<const int64_t> numels,
                                              const FlatLayoutOptions& options) {
  if (options.pad_world_size < 1 || options.shard_world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size must be at least 1, got ",
                                                   options.pad_world_size, " and ",
                                                   options.shard_world_size));
  }
  FlatLayout layout;
  layout.shard_world_size_ = options.shard_world_size;
  layout.offsets_.reserve(numels.size());
  const int64_t align = options.align ? kAlignmentBytes / ItemSize(options.dtype) : 1;
  int64_t total = 0;
  for (int64_t n : numels) {
    // FSDP pads before a param only when the running total is misaligned.
    if (align > 1 && total % align != 0) {
      if (__builtin_add_overflow(total, align - total % align, &total)) return Overflow();
    }
    layout.offsets_.push_back(total);
    if (__builtin_add_overflow(total, n, &total)) return Overflow();
    layout.numel_ += n;  // <= total, cannot overflow
  }
  layout.data_end_ = total;
  if (options.align && total % options.pad_world_size != 0) {
    if (__builtin_add_overflow(total, options.pad_world_size - total % options.pad_world_size,
                               &total)) {
      return Overflow();
    }
  }
  // torch.chunk: every shard has ceil(total / W) elements, the missing tail is padding.
  const int64_t w = options.shard_world_size;
  layout.shard_numel_ = total / w + (total % w != 0 ? 1 : 0);
  if (__builtin_mul_overflow(layout.shard_numel_, w, &layout.padded_numel_)) return Overflow();
  return layout;
}

ElementRange FlatLayout::ShardRange(int r) const {
  FS_CHECK(r >= 0 && r < shard_world_size_) << "shard rank " << r << " of " << shard_world_size_;
  return ElementRange{r * shard_numel_, (r + 1) * shard_numel_};
}

ElementRange FlatLayout::UnpaddedShardRange(int r) const {
  ElementRange range = ShardRange(r);
  range.begin = std::min(range.begin, data_end_);
  range.end = std::min(range.end, data_end_);
  return range;
}

}  // namespace flatshard
