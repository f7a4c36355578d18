// Tests for common/flat_layout against semantics.md §2: torch.chunk sharding without
// use_orig_params, 16-byte alignment and world-size padding with it, NO_SHARD, overflow.

#include "common/flat_layout.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

FlatLayout MustCreate(std::vector<int64_t> numels, const FlatLayoutOptions& options) {
  absl::StatusOr<FlatLayout> l = FlatLayout::Create(numels, options);
  EXPECT_TRUE(l.ok()) << l.status();
  return l.ok() ? *l : FlatLayout{};
}

FlatLayoutOptions Sharded(int world, DType dtype = DType::kFloat32, bool align = false) {
  FlatLayoutOptions o;
  o.dtype = dtype;
  o.align = align;
  o.pad_world_size = world;
  o.shard_world_size = world;
  return o;
}

TEST(FlatLayoutTest, ChunkRulesForEveryNumelAndWorldSize) {
  for (int64_t numel = 0; numel <= 40; ++numel) {
    for (int w = 1; w <= 8; ++w) {
      SCOPED_TRACE("numel " + std::to_string(numel) + " world " + std::to_string(w));
      // One param of `numel`, and the same total split over three params.
      for (const std::vector<int64_t>& numels :
           {std::vector<int64_t>{numel},
            std::vector<int64_t>{numel / 3, numel - numel / 3 - numel / 4, numel / 4}}) {
        FlatLayout l = MustCreate(numels, Sharded(w));
        const int64_t shard = (numel + w - 1) / w;
        EXPECT_EQ(l.numel(), numel);
        EXPECT_EQ(l.data_end(), numel);
        EXPECT_EQ(l.shard_numel(), shard);
        EXPECT_EQ(l.padded_numel(), shard * w);
        EXPECT_EQ(l.padding_numel(), shard * w - numel);
        EXPECT_EQ(l.shard_world_size(), w);
        // Params back to back.
        int64_t offset = 0;
        ASSERT_EQ(l.offsets().size(), numels.size());
        for (size_t i = 0; i < numels.size(); ++i) {
          EXPECT_EQ(l.offsets()[i], offset);
          offset += numels[i];
        }
        // Shard ranges tile [0, padded) exactly once, in rank order.
        std::vector<int> covered(static_cast<size_t>(l.padded_numel()), 0);
        int64_t next = 0;
        for (int r = 0; r < w; ++r) {
          ElementRange range = l.ShardRange(r);
          EXPECT_EQ(range.begin, next);
          EXPECT_EQ(range.size(), shard);
          next = range.end;
          for (int64_t e = range.begin; e < range.end; ++e) ++covered[static_cast<size_t>(e)];
          // The unpadded range is the intersection with [0, numel).
          ElementRange unpadded = l.UnpaddedShardRange(r);
          const int64_t begin = std::min(range.begin, numel);
          const int64_t end = std::min(range.end, numel);
          EXPECT_EQ(unpadded.empty(), end <= begin);
          if (end > begin) {
            EXPECT_EQ(unpadded, (ElementRange{begin, end}));
          } else {
            EXPECT_EQ(unpadded.size(), 0);
          }
        }
        EXPECT_EQ(next, l.padded_numel());
        for (int c : covered) EXPECT_EQ(c, 1);
      }
    }
  }
}

TEST(FlatLayoutTest, HighRanksOfSmallUnitsHaveEmptyUnpaddedShards) {
  // numel 5 over 4 ranks: shard 2, padded 8; rank 2 holds [4, 6) of which only element 4 is
  // data; rank 3 holds [6, 8), pure padding.
  FlatLayout l = MustCreate({5}, Sharded(4));
  EXPECT_EQ(l.shard_numel(), 2);
  EXPECT_EQ(l.padded_numel(), 8);
  EXPECT_EQ(l.UnpaddedShardRange(0), (ElementRange{0, 2}));
  EXPECT_EQ(l.UnpaddedShardRange(1), (ElementRange{2, 4}));
  EXPECT_EQ(l.UnpaddedShardRange(2), (ElementRange{4, 5}));
  EXPECT_TRUE(l.UnpaddedShardRange(3).empty());
  EXPECT_EQ(l.UnpaddedShardRange(3).size(), 0);
  EXPECT_EQ(l.ShardRange(3), (ElementRange{6, 8}));

  // numel 1 over 8 ranks: only rank 0 holds data.
  l = MustCreate({1}, Sharded(8));
  EXPECT_EQ(l.shard_numel(), 1);
  EXPECT_EQ(l.padded_numel(), 8);
  EXPECT_EQ(l.UnpaddedShardRange(0), (ElementRange{0, 1}));
  for (int r = 1; r < 8; ++r) {
    EXPECT_TRUE(l.UnpaddedShardRange(r).empty()) << r;
    EXPECT_EQ(l.UnpaddedShardRange(r).size(), 0) << r;
  }
}

TEST(FlatLayoutTest, EmptyUnitHasNoElements) {
  FlatLayout l = MustCreate({}, Sharded(4));
  EXPECT_EQ(l.numel(), 0);
  EXPECT_EQ(l.padded_numel(), 0);
  EXPECT_EQ(l.shard_numel(), 0);
  EXPECT_TRUE(l.offsets().empty());
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(l.UnpaddedShardRange(r).empty());
}

TEST(FlatLayoutTest, Float32AlignsToFourElements) {
  // 3 -> pad 1 -> 5 -> pad 3 -> 1; data ends at 13, padded to a multiple of 4 -> 16.
  FlatLayout l = MustCreate({3, 5, 1}, Sharded(4, DType::kFloat32, /*align=*/true));
  EXPECT_THAT(l.offsets(), ElementsAre(0, 4, 12));
  EXPECT_EQ(l.numel(), 9);
  EXPECT_EQ(l.data_end(), 13);
  EXPECT_EQ(l.padded_numel(), 16);
  EXPECT_EQ(l.shard_numel(), 4);
  EXPECT_EQ(l.padding_numel(), 7);
  EXPECT_EQ(l.UnpaddedShardRange(3), (ElementRange{12, 13}));
}

TEST(FlatLayoutTest, HalfPrecisionAlignsToEightElements) {
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    // World size 3: the total is padded to a multiple of 3, not of the alignment.
    FlatLayout l = MustCreate({1, 1}, Sharded(3, d, /*align=*/true));
    EXPECT_THAT(l.offsets(), ElementsAre(0, 8));
    EXPECT_EQ(l.data_end(), 9);
    EXPECT_EQ(l.padded_numel(), 9);
    EXPECT_EQ(l.shard_numel(), 3);
    l = MustCreate({9, 8, 7}, Sharded(2, d, /*align=*/true));
    EXPECT_THAT(l.offsets(), ElementsAre(0, 16, 24));
    EXPECT_EQ(l.data_end(), 31);
    EXPECT_EQ(l.padded_numel(), 32);
    EXPECT_EQ(l.shard_numel(), 16);
  }
}

TEST(FlatLayoutTest, Float64AlignsToTwoElements) {
  FlatLayout l = MustCreate({3, 3, 2}, Sharded(5, DType::kFloat64, /*align=*/true));
  EXPECT_THAT(l.offsets(), ElementsAre(0, 4, 8));
  EXPECT_EQ(l.data_end(), 10);
  EXPECT_EQ(l.padded_numel(), 10);
  EXPECT_EQ(l.shard_numel(), 2);
}

TEST(FlatLayoutTest, AlignmentInvariantsForManyShapes) {
  const struct {
    DType dtype;
    int64_t align;
  } kDTypes[] = {
      {DType::kFloat32, 4}, {DType::kFloat16, 8}, {DType::kBFloat16, 8}, {DType::kFloat64, 2}};
  const std::vector<std::vector<int64_t>> kNumels = {
      {1}, {4}, {7, 1}, {0, 3}, {3, 0, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {16, 16}, {5, 0, 0, 1}};
  for (const auto& d : kDTypes) {
    for (const auto& numels : kNumels) {
      for (int w = 1; w <= 8; ++w) {
        SCOPED_TRACE(std::string(DTypeName(d.dtype)) + " world " + std::to_string(w));
        FlatLayout l = MustCreate(numels, Sharded(w, d.dtype, /*align=*/true));
        ASSERT_EQ(l.offsets().size(), numels.size());
        EXPECT_EQ(l.offsets()[0], 0);  // no padding before the first param
        int64_t sum = 0, end = 0;
        for (size_t i = 0; i < numels.size(); ++i) {
          EXPECT_EQ(l.offsets()[i] % d.align, 0) << i;
          // Padding before a param is the least that aligns it.
          EXPECT_LT(l.offsets()[i] - end, d.align) << i;
          EXPECT_GE(l.offsets()[i], end) << i;
          end = l.offsets()[i] + numels[i];
          sum += numels[i];
        }
        EXPECT_EQ(l.numel(), sum);
        EXPECT_EQ(l.data_end(), end);
        EXPECT_EQ(l.padded_numel() % w, 0);
        EXPECT_GE(l.padded_numel(), end);
        EXPECT_LT(l.padded_numel() - end, w);  // the least multiple of w
        EXPECT_EQ(l.shard_numel() * w, l.padded_numel());
        for (int r = 0; r < w; ++r) {
          ElementRange u = l.UnpaddedShardRange(r);
          ElementRange s = l.ShardRange(r);
          EXPECT_EQ(u.begin, std::min(s.begin, end));
          EXPECT_EQ(u.end, std::min(s.end, end));
        }
      }
    }
  }
}

TEST(FlatLayoutTest, WithoutAlignNoPaddingBetweenParamsForAnyDType) {
  FlatLayout l = MustCreate({3, 5, 1}, Sharded(4, DType::kFloat16, /*align=*/false));
  EXPECT_THAT(l.offsets(), ElementsAre(0, 3, 8));
  EXPECT_EQ(l.padded_numel(), 12);
  EXPECT_EQ(l.shard_numel(), 3);
}

TEST(FlatLayoutTest, NoShardKeepsTheWholeBufferOnEveryRank) {
  FlatLayoutOptions o;
  o.pad_world_size = 4;
  o.shard_world_size = 1;
  FlatLayout l = MustCreate({3, 5, 1}, o);
  EXPECT_EQ(l.shard_world_size(), 1);
  EXPECT_EQ(l.padded_numel(), 9);
  EXPECT_EQ(l.shard_numel(), 9);
  EXPECT_EQ(l.ShardRange(0), (ElementRange{0, 9}));
  EXPECT_EQ(l.UnpaddedShardRange(0), (ElementRange{0, 9}));
  // use_orig_params=true: still padded to the group's world size.
  o.align = true;
  l = MustCreate({3, 5, 1}, o);
  EXPECT_THAT(l.offsets(), ElementsAre(0, 4, 12));
  EXPECT_EQ(l.data_end(), 13);
  EXPECT_EQ(l.padded_numel(), 16);
  EXPECT_EQ(l.shard_numel(), 16);
  EXPECT_EQ(l.UnpaddedShardRange(0), (ElementRange{0, 13}));
}

TEST(FlatLayoutTest, HybridPadsToTheShardGroup) {
  FlatLayoutOptions o;
  o.align = true;
  o.pad_world_size = 3;
  o.shard_world_size = 3;
  FlatLayout l = MustCreate({5}, o);
  EXPECT_EQ(l.padded_numel(), 6);
  EXPECT_EQ(l.shard_numel(), 2);
}

TEST(FlatLayoutTest, WorldSizeBelowOneIsRefused) {
  FlatLayoutOptions o = Sharded(0);
  absl::StatusOr<FlatLayout> l = FlatLayout::Create(std::vector<int64_t>{4}, o);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.status().message(), "world size must be at least 1, got 0 and 0");
  o = Sharded(2);
  o.shard_world_size = 0;
  l = FlatLayout::Create(std::vector<int64_t>{4}, o);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().message(), "world size must be at least 1, got 2 and 0");
  o = Sharded(-3);
  EXPECT_FALSE(FlatLayout::Create(std::vector<int64_t>{4}, o).ok());
}

void ExpectOverflow(std::vector<int64_t> numels, const FlatLayoutOptions& o) {
  absl::StatusOr<FlatLayout> l = FlatLayout::Create(numels, o);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(l.status().message()), HasSubstr("exceed 2^63 elements"));
}

TEST(FlatLayoutTest, OverflowIsRefused) {
  // Sum overflows.
  ExpectOverflow({kMax, 1}, Sharded(1));
  ExpectOverflow({kMax / 2 + 1, kMax / 2 + 1}, Sharded(1));
  // ceil(kMax / 2) * 2 = 2^63.
  ExpectOverflow({kMax}, Sharded(2));
  // Alignment padding before the second param overflows.
  ExpectOverflow({1, kMax - 3}, Sharded(1, DType::kFloat32, true));
  // World-size padding at the end overflows: 2^63 - 2 padded to a multiple of 4.
  ExpectOverflow({kMax - 1}, Sharded(4, DType::kFloat32, true));
  // And the largest that fit.
  FlatLayout l = MustCreate({kMax}, Sharded(1));
  EXPECT_EQ(l.padded_numel(), kMax);
  l = MustCreate({kMax - 1}, Sharded(2));
  EXPECT_EQ(l.padded_numel(), kMax - 1);
  EXPECT_EQ(l.shard_numel(), kMax / 2);
  l = MustCreate({1, kMax - 4}, Sharded(1, DType::kFloat32, true));
  EXPECT_THAT(l.offsets(), ElementsAre(0, 4));
  EXPECT_EQ(l.data_end(), kMax);
}

}  // namespace
}  // namespace flatshard
