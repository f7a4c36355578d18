#pragma once
// The layout of a published version of weights (README "Publishing weights"): the full
// unsharded parameters of a registered module in the unwrapped module's state_dict layout,
// one tensor per FQN, each at an aligned offset of one segment, and the copy that fills the
// segment from the committed shards of every rank (padding dropped, cast on the way).
// Pure functions of their arguments; thread-safe.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/manifest.h"
#include "common/plan.h"

namespace flatshard::server {

class Buffer;

// One state_dict key of a version. Tied parameters (aliases within a unit, PlanUnit::shared,
// and across units, checkpoint::TiedAliases) are entries of their own with the offset of the
// parameter they alias: readers see every key, the bytes exist once.
struct WeightsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // bytes from the segment's start, a multiple of kWeightsAlignment
  int64_t bytes = 0;
  // Where its elements come from (for the fill): plan unit, element offset in the unit's
  // flat buffer, elements; unit -1 for aliases (nothing to copy).
  int32_t unit = -1;
  int64_t flat_offset = 0;
  int64_t numel = 0;
};

// Tensors start at multiples of this (CUDA and vector loads want it; 256 as the CUDA
// allocator does).
inline constexpr int64_t kWeightsAlignment = 256;

struct WeightsLayout {
  std::vector<WeightsEntry> entries;  // units in plan order, flat order, then aliases
  int64_t bytes = 0;                  // the segment's size
};

// The layout of `plan`'s parameters, cast to `dtype` when set. INVALID_ARGUMENT for a
// `dtype` that is not floating point (naming it) or a cast of a non-floating unit.
absl::StatusOr<WeightsLayout> LayOutWeights(const Plan& plan, const Manifest& manifest,
                                            std::optional<DType> dtype);

// Fills `dst` (layout.bytes bytes) from the committed shards: `by_rank[i][u]` is global rank
// `ranks[i]`'s shard of unit u (shard_numel elements of the unit's dtype, host memory; null
// where absent). Every shard rank of every unit must be held by some rank (FAILED_PRECONDITION
// naming the unit and shard rank otherwise). Runs on up to `threads` threads.
absl::Status FillWeights(const Plan& plan, const WeightsLayout& layout,
                         const std::vector<int32_t>& ranks,
                         const std::vector<std::vector<std::shared_ptr<Buffer>>>& by_rank,
                         void* dst, int threads);

// Converts `n` elements of `from` at `src` to `to` at `dst` (floating types; memcpy when
// equal). REQUIRES: IsFloatingPoint of both.
void ConvertElements(DType from, const void* src, DType to, void* dst, int64_t n);

}  // namespace flatshard::server
