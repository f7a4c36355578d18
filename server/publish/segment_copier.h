#pragma once
// The copy that fills a published version (README "Publishing weights"): a list of element
// ranges, each copied (or cast) from a committed shard into the version's segment, cut into
// chunks that a few threads share, so one large tensor is copied by every thread and not by
// one. Casts from and to float32 have loops of their own that the compiler vectorizes
// (float32 -> bfloat16 runs at about memory speed); other casts go through double.
// Pure functions of their arguments; thread-safe.

#include <cstdint>
#include <vector>

#include "common/dtype.h"

namespace flatshard::server {

// `n` elements of `from` at `src` to `to` at `dst`.
struct CopyRange {
  const void* src = nullptr;
  DType from = DType::kFloat32;
  void* dst = nullptr;
  DType to = DType::kFloat32;
  int64_t n = 0;
};

// Pieces of at most this many source bytes are what the threads take turns on.
inline constexpr int64_t kCopyChunkBytes = int64_t{8} << 20;

// Copies every range on up to `threads` threads (the caller's included), each range cut
// into chunks of at most `chunk_bytes` bytes. REQUIRES: floating `from` and `to` where they
// differ; ranges that do not overlap.
void CopyRanges(const std::vector<CopyRange>& ranges, int threads,
                int64_t chunk_bytes = kCopyChunkBytes);

// Converts `n` elements (memcpy when `from` == `to`, with streamed stores when `stream`: part
// of a large transfer, common/bulk_copy.h). REQUIRES: IsFloatingPoint of both where they
// differ.
void ConvertRange(DType from, const void* src, DType to, void* dst, int64_t n, bool stream = false);

}  // namespace flatshard::server
