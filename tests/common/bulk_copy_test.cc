#include "common/bulk_copy.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace flatshard {
namespace {

// Every byte of dst equals memcpy's result: the copied range from src, the rest untouched.
void ExpectCopies(size_t bytes, size_t src_offset, size_t dst_offset, bool stream) {
  std::vector<uint8_t> src(bytes + 64), dst(bytes + 64, 0xEE);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  BulkCopy(dst.data() + dst_offset, src.data() + src_offset, bytes, stream);
  for (size_t i = 0; i < dst.size(); ++i) {
    const bool inside = i >= dst_offset && i < dst_offset + bytes;
    const uint8_t want = inside ? src[i - dst_offset + src_offset] : 0xEE;
    ASSERT_EQ(dst[i], want) << "byte " << i << " of a copy of " << bytes << " bytes (src +"
                            << src_offset << ", dst +" << dst_offset << ", stream " << stream
                            << ")";
  }
}

TEST(BulkCopyTest, CopiesEveryByteAtAnyAlignmentAndSize) {
  // Around the streaming loop's edges: under 4 blocks (memcpy), a head to align the
  // destination, whole 64-byte blocks, and a tail.
  for (bool stream : {false, true}) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{15}, size_t{255}, size_t{256}, size_t{257},
                         size_t{1000}, size_t{4096}, size_t{(1 << 20) + 13}}) {
      for (size_t src_offset : {0, 1, 8, 17}) {
        for (size_t dst_offset : {0, 3, 16, 31}) {
          ExpectCopies(bytes, src_offset, dst_offset, stream);
        }
      }
    }
  }
}

TEST(BulkCopyTest, StreamsTransfersFromTheThreshold) {
  EXPECT_FALSE(BulkShouldStream(kBulkStreamMinBytes - 1));
  EXPECT_TRUE(BulkShouldStream(kBulkStreamMinBytes));
}

}  // namespace
}  // namespace flatshard
