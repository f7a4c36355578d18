// LayOutWeights, FillWeights and ConvertElements (server/publish/weights_layout.h) against
// hand-made plans and real ShardStore buffers.

#include "server/publish/weights_layout.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/reduce.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

// One unit of two float32 params (5 and 6 elements: 11, padded to 12) sharded over `world`
// ranks (FULL_SHARD), and a second unit of one param of 3 elements.
Plan TwoUnits(int32_t world) {
  Plan plan;
  plan.world_size = world;
  plan.shard_world_size = world;
  PlanUnit a;
  a.index = 0;
  a.params = {{"a.w", {5}, 5, 0}, {"a.b", {2, 3}, 6, 5}};
  a.shared = {{"a.w_alias", "a.w"}};
  a.numel = 11;
  a.padded_numel = (11 + world - 1) / world * world;
  a.shard_numel = a.padded_numel / world;
  PlanUnit b;
  b.index = 1;
  b.params = {{"b.w", {3}, 3, 0}};
  b.numel = 3;
  b.padded_numel = (3 + world - 1) / world * world;
  b.shard_numel = b.padded_numel / world;
  plan.units = {a, b};
  return plan;
}

// Every rank's shard of every unit: element e of unit u's flat buffer is 100 * u + e.
std::vector<std::vector<std::shared_ptr<Buffer>>> Shards(ShardStore& store, const Plan& plan) {
  std::vector<std::vector<std::shared_ptr<Buffer>>> out(plan.world_size);
  for (int32_t r = 0; r < plan.world_size; ++r) {
    for (const PlanUnit& u : plan.units) {
      absl::StatusOr<std::shared_ptr<Buffer>> b =
          store.Allocate(BufferKind::kShard, u.shard_numel * 4, "test");
      EXPECT_TRUE(b.ok()) << b.status();
      float* p = static_cast<float*>((*b)->data());
      for (int64_t i = 0; i < u.shard_numel; ++i) {
        p[i] = static_cast<float>(100 * u.index + r * u.shard_numel + i);
      }
      out[r].push_back(*b);
    }
  }
  return out;
}

TEST(WeightsLayoutTest, EveryParamWholeAlignedWithAliasesSharingBytes) {
  const Plan plan = TwoUnits(3);
  absl::StatusOr<WeightsLayout> layout = LayOutWeights(plan, Manifest(), std::nullopt);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->entries.size(), 4u);
  EXPECT_EQ(layout->entries[0].name, "a.w");
  EXPECT_EQ(layout->entries[1].name, "a.b");
  EXPECT_EQ(layout->entries[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(layout->entries[2].name, "b.w");
  EXPECT_EQ(layout->entries[3].name, "a.w_alias");
  EXPECT_EQ(layout->entries[3].offset, layout->entries[0].offset);
  for (const WeightsEntry& e : layout->entries) EXPECT_EQ(e.offset % kWeightsAlignment, 0);
  EXPECT_EQ(layout->bytes, 3 * kWeightsAlignment);
}

TEST(WeightsLayoutTest, FillsAcrossShardBoundariesAndDropsPadding) {
  for (int32_t world : {1, 2, 3, 4}) {
    SCOPED_TRACE(world);
    const Plan plan = TwoUnits(world);
    ShardStore store({});
    auto shards = Shards(store, plan);
    std::vector<int32_t> ranks;
    for (int32_t r = 0; r < world; ++r) ranks.push_back(r);
    absl::StatusOr<WeightsLayout> layout = LayOutWeights(plan, Manifest(), std::nullopt);
    ASSERT_TRUE(layout.ok());
    std::vector<char> out(layout->bytes);
    ASSERT_TRUE(FillWeights(plan, *layout, ranks, shards, out.data(), 2).ok());
    for (const WeightsEntry& e : layout->entries) {
      const float* p = reinterpret_cast<const float*>(out.data() + e.offset);
      const int32_t unit = e.name[0] == 'a' ? 0 : 1;
      const int64_t first = e.name == "a.b" ? 5 : 0;
      for (int64_t j = 0; j < e.bytes / 4; ++j) {
        EXPECT_EQ(p[j], static_cast<float>(100 * unit + first + j)) << e.name << "[" << j << "]";
      }
    }
  }
}

TEST(WeightsLayoutTest, AMissingShardRankIsNamed) {
  const Plan plan = TwoUnits(2);
  ShardStore store({});
  auto shards = Shards(store, plan);
  shards.pop_back();  // only rank 0 here
  absl::StatusOr<WeightsLayout> layout = LayOutWeights(plan, Manifest(), std::nullopt);
  ASSERT_TRUE(layout.ok());
  std::vector<char> out(layout->bytes);
  absl::Status s = FillWeights(plan, *layout, {0}, shards, out.data(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("shard 1"));
}

TEST(WeightsLayoutTest, CastsFloatingTypesAndRefusesOthers) {
  const Plan plan = TwoUnits(2);
  absl::StatusOr<WeightsLayout> bad = LayOutWeights(plan, Manifest(), DType::kInt32);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("int32"));
  absl::StatusOr<WeightsLayout> half = LayOutWeights(plan, Manifest(), DType::kFloat16);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->entries[0].dtype, DType::kFloat16);
  EXPECT_EQ(half->entries[0].bytes, 10);

  const float src[4] = {1.5f, -2.25f, 65504.0f, 0.0f};
  uint16_t h[4], b[4];
  ConvertElements(DType::kFloat32, src, DType::kFloat16, h, 4);
  ConvertElements(DType::kFloat32, src, DType::kBFloat16, b, 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(h[i], collective::FloatToHalf(src[i]));
    EXPECT_EQ(b[i], collective::FloatToBFloat16(src[i]));
  }
  float back[4];
  ConvertElements(DType::kFloat16, h, DType::kFloat32, back, 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(back[i], src[i]);
  double wide[4];
  ConvertElements(DType::kBFloat16, b, DType::kFloat64, wide, 4);
  EXPECT_EQ(wide[1], -2.25);
}

}  // namespace
}  // namespace flatshard::server
