#include "common/bulk_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace flatshard {

void BulkCopy(void* dst, const void* src, size_t bytes, bool stream) {
#if defined(__x86_64__)
  // Streaming pays only beyond a few cache lines; the head up to the destination's 16-byte
  // alignment and the tail under one 64-byte block go through memcpy.
  constexpr size_t kBlock = 64;
  if (stream && bytes >= 4 * kBlock) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    size_t left = bytes - head;
    for (; left >= kBlock; left -= kBlock, d += kBlock, s += kBlock) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    std::memcpy(d, s, left);
    // Non-temporal stores are weakly ordered: a reader told "done" after the return (another
    // thread, another process through shared memory) must see every byte.
    _mm_sfence();
    return;
  }
#else
  (void)stream;
#endif
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace flatshard
