#include "server/publish/segment_copier.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <thread>

#include "common/bulk_copy.h"
#include "server/collective/reduce.h"

namespace flatshard::server {
namespace {

// collective::FloatToBFloat16, inlined here so that the loop vectorizes (round to nearest
// even; NaN stays a quiet NaN).
inline uint16_t ToBFloat16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

double Load(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kFloat64:
      return static_cast<const double*>(p)[i];
    case DType::kFloat16:
      return collective::HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    default:  // kBFloat16
      return collective::BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

void Store(DType t, void* p, int64_t i, double v) {
  switch (t) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = collective::FloatToHalf(static_cast<float>(v));
      break;
    default:
      static_cast<uint16_t*>(p)[i] = collective::FloatToBFloat16(static_cast<float>(v));
  }
}

}  // namespace

void ConvertRange(DType from, const void* src, DType to, void* dst, int64_t n, bool stream) {
  if (from == to) {
    BulkCopy(dst, src, static_cast<size_t>(n * ItemSize(from)), stream);
    return;
  }
  if (from == DType::kFloat32 && to == DType::kBFloat16) {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = ToBFloat16(s[i]);
    return;
  }
  if (from == DType::kBFloat16 && to == DType::kFloat32) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = std::bit_cast<float>(static_cast<uint32_t>(s[i]) << 16);
    return;
  }
  if (from == DType::kFloat32 && to == DType::kFloat16) {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = collective::FloatToHalf(s[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) Store(to, dst, i, Load(from, src, i));
}

void CopyRanges(const std::vector<CopyRange>& ranges, int threads, int64_t chunk_bytes) {
  struct Chunk {
    const CopyRange* range;
    int64_t first;  // element
    int64_t n;
  };
  std::vector<Chunk> chunks;
  size_t total = 0;
  for (const CopyRange& r : ranges) {
    total += static_cast<size_t>(r.n * ItemSize(r.to));
    const int64_t per = std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, ItemSize(r.from)));
    for (int64_t first = 0; first < r.n; first += per) {
      chunks.push_back(Chunk{&r, first, std::min(per, r.n - first)});
    }
  }
  const bool stream = BulkShouldStream(total);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next++; k < chunks.size(); k = next++) {
      const Chunk& c = chunks[k];
      const CopyRange& r = *c.range;
      ConvertRange(r.from, static_cast<const char*>(r.src) + c.first * ItemSize(r.from), r.to,
                   static_cast<char*>(r.dst) + c.first * ItemSize(r.to), c.n, stream);
    }
  };
  const int extra =
      static_cast<int>(std::min<size_t>(chunks.size(), static_cast<size_t>(std::max(1, threads)))) -
      1;
  std::vector<std::thread> pool;
  for (int t = 0; t < extra; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace flatshard::server
