// View building (ModuleLayout + ViewBuilder -> ParamViews) from a hand-made plan over a real
// shared-memory segment.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/segment_cache.h"
#include "common/plan.h"
#include "common/shm_segment.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::client::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

PlanParam Param(std::string fqn, std::vector<int64_t> shape, int64_t numel, int64_t offset) {
  PlanParam p;
  p.fqn = std::move(fqn);
  p.shape = std::move(shape);
  p.numel = numel;
  p.offset = offset;
  return p;
}

// Unit 0 (float32, root): a.weight [2,3] at 0, b.bias [3] at 6, c.weight tied to a.weight.
// Unit 1 (bfloat16, "h"): h.w [4] at 0, h.v (scalar) at 8 (aligned as use_orig_params pads).
Plan TwoUnitPlan() {
  Plan plan;
  plan.world_size = 2;
  plan.shard_world_size = 2;
  PlanUnit u0;
  u0.index = 0;
  u0.module = "";
  u0.dtype = DType::kFloat32;
  u0.params = {Param("a.weight", {2, 3}, 6, 0), Param("b.bias", {3}, 3, 6)};
  u0.shared = {{"c.weight", "a.weight"}};
  u0.numel = 9;
  u0.padded_numel = 10;
  u0.shard_numel = 5;
  PlanUnit u1;
  u1.index = 1;
  u1.module = "h";
  u1.dtype = DType::kBFloat16;
  u1.params = {Param("h.w", {4}, 4, 0), Param("h.v", {}, 1, 8)};
  u1.numel = 9;
  u1.padded_numel = 10;
  u1.shard_numel = 5;
  plan.units = {u0, u1};
  return plan;
}

class ParamViewsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ShmSegment> s = ShmSegment::Create(MakeSegmentName("fsviewtest"), 4096);
    ASSERT_TRUE(s.ok()) << s.status();
    segment_ = *std::move(s);
    absl::StatusOr<std::shared_ptr<const ModuleLayout>> layout =
        ModuleLayout::Create(std::make_shared<const Plan>(TwoUnitPlan()));
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
  }

  // Unit buffers at these offsets of the segment, as a daemon's MemoryHandles would say.
  MappedRange Range(uint64_t offset, uint64_t bytes, bool writable = true) {
    SegmentRange r;
    r.segment = segment_.name();
    r.segment_bytes = segment_.size();
    r.offset = offset;
    r.bytes = bytes;
    absl::StatusOr<MappedRange> m = cache_.Map(r, writable);
    EXPECT_TRUE(m.ok()) << m.status();
    return *m;
  }

  char* Base(uint64_t offset) { return static_cast<char*>(segment_.data()) + offset; }

  ShmSegment segment_;
  SegmentCache cache_;
  std::shared_ptr<const ModuleLayout> layout_;
};

TEST_F(ParamViewsTest, ViewsSitAtTheirParamOffsetsWithShapesAndDtypes) {
  ViewBuilder builder(layout_);
  const MappedRange unit0 = Range(128, 40);
  const MappedRange unit1 = Range(512, 20);
  ASSERT_TRUE(builder.AddUnit(0, unit0).ok());
  ASSERT_TRUE(builder.AddUnit(1, unit1).ok());
  const ParamViews views = builder.Build();
  ASSERT_EQ(views.size(), 5u);

  const ParamView* a = views.Find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->data, unit0.data);
  EXPECT_THAT(a->shape, ElementsAre(2, 3));
  EXPECT_EQ(a->numel, 6);
  EXPECT_EQ(a->dtype, DType::kFloat32);
  EXPECT_EQ(a->fqn, "a.weight");
  EXPECT_EQ(a->unit, 0);
  EXPECT_TRUE(a->writable);

  const ParamView* b = views.Find("b.bias");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(static_cast<char*>(b->data) - static_cast<char*>(unit0.data), 6 * 4);
  EXPECT_THAT(b->shape, ElementsAre(3));

  const ParamView* hv = views.Find("h.v");
  ASSERT_NE(hv, nullptr);
  EXPECT_EQ(static_cast<char*>(hv->data) - static_cast<char*>(unit1.data), 8 * 2);  // bf16
  EXPECT_TRUE(hv->shape.empty());
  EXPECT_EQ(hv->numel, 1);
  EXPECT_EQ(hv->dtype, DType::kBFloat16);
  EXPECT_EQ(hv->unit, 1);

  // Writes through a view land at offset + param offset * itemsize of the segment.
  const float value = 2.5f;
  std::memcpy(b->data, &value, sizeof(value));
  float seen = 0;
  std::memcpy(&seen, Base(128 + 6 * 4), sizeof(seen));
  EXPECT_EQ(seen, value);
}

TEST_F(ParamViewsTest, TiedFqnsAliasOnePointer) {
  ViewBuilder builder(layout_);
  ASSERT_TRUE(builder.AddUnit(0, Range(128, 40)).ok());
  const ParamViews views = builder.Build();
  const ParamView* a = views.Find("a.weight");
  const ParamView* c = views.Find("c.weight");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(c, nullptr);
  EXPECT_NE(a, c);              // a view of its own ...
  EXPECT_EQ(c->data, a->data);  // ... over the same bytes
  EXPECT_EQ(c->fqn, "c.weight");
  EXPECT_EQ(c->shape, a->shape);
  EXPECT_EQ(c->numel, a->numel);
}

TEST_F(ParamViewsTest, IteratesUnitByUnitInFlatOrderThenAliases) {
  ViewBuilder builder(layout_);
  const MappedRange unit1 = Range(512, 20);
  const MappedRange unit0 = Range(128, 40);
  ASSERT_TRUE(builder.AddUnit(1, unit1).ok());  // the daemon's order, not the plan's
  ASSERT_TRUE(builder.AddUnit(0, unit0).ok());
  const ParamViews views = builder.Build();
  std::vector<std::string> fqns;
  for (const ParamView& v : views) fqns.push_back(v.fqn);
  EXPECT_THAT(fqns, ElementsAre("h.w", "h.v", "a.weight", "b.bias", "c.weight"));
  EXPECT_EQ(views.Find("a.weight")->data, unit0.data);
  EXPECT_EQ(views.Find("h.w")->data, unit1.data);
  EXPECT_EQ(static_cast<char*>(unit1.data) - static_cast<char*>(unit0.data), 512 - 128);
}

TEST_F(ParamViewsTest, UnitsNotAddedHaveNoViews) {
  ViewBuilder builder(layout_);
  ASSERT_TRUE(builder.AddUnit(1, Range(512, 20)).ok());
  const ParamViews views = builder.Build();
  EXPECT_EQ(views.Find("a.weight"), nullptr);
  EXPECT_EQ(views.Find("c.weight"), nullptr);
  EXPECT_NE(views.Find("h.w"), nullptr);
  EXPECT_EQ(views.Find("no.such"), nullptr);
  EXPECT_EQ(ParamViews().Find("h.w"), nullptr);
  EXPECT_TRUE(ParamViews().empty());
}

TEST_F(ParamViewsTest, ReadOnlyRangesGiveReadOnlyViews) {
  ViewBuilder builder(layout_);
  ASSERT_TRUE(builder.AddUnit(0, Range(128, 40, /*writable=*/false)).ok());
  const ParamViews views = builder.Build();
  EXPECT_FALSE(views.Find("a.weight")->writable);
  EXPECT_FALSE(views.Find("c.weight")->writable);
}

TEST_F(ParamViewsTest, ViewsKeepTheirMappingAliveAfterTheCacheForgetsIt) {
  ViewBuilder builder(layout_);
  ASSERT_TRUE(builder.AddUnit(0, Range(128, 40)).ok());
  const ParamViews views = builder.Build();
  cache_.Clear();
  static_cast<float*>(views.Find("a.weight")->data)[0] = 7.0f;
  float seen = 0;
  std::memcpy(&seen, Base(128), sizeof(seen));
  EXPECT_EQ(seen, 7.0f);
}

TEST_F(ParamViewsTest, RefusesUnknownDuplicateAndShortUnits) {
  ViewBuilder builder(layout_);
  absl::Status unknown = builder.AddUnit(5, Range(128, 40));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(unknown.message(), HasSubstr("unit 5"));

  ASSERT_TRUE(builder.AddUnit(0, Range(128, 40)).ok());
  EXPECT_EQ(builder.AddUnit(0, Range(128, 40)).code(), absl::StatusCode::kInternal);

  // Unit 1's views reach element 9 of bf16: 18 bytes. 17 is one short.
  absl::Status shorter = builder.AddUnit(1, Range(512, 17));
  EXPECT_EQ(shorter.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(shorter.message(), HasSubstr("18"));
  EXPECT_TRUE(builder.AddUnit(1, Range(512, 18)).ok());
}

TEST(ModuleLayoutTest, PrecomputesByteOffsetsAndExtents) {
  absl::StatusOr<std::shared_ptr<const ModuleLayout>> layout =
      ModuleLayout::Create(std::make_shared<const Plan>(TwoUnitPlan()));
  ASSERT_TRUE(layout.ok()) << layout.status();
  const UnitTemplate* u1 = (*layout)->FindUnit(1);
  ASSERT_NE(u1, nullptr);
  EXPECT_EQ(u1->item_size, 2);
  EXPECT_EQ(u1->extent_bytes, 18);
  ASSERT_EQ(u1->views.size(), 2u);
  EXPECT_EQ(u1->views[1].byte_offset, 16);
  const UnitTemplate* u0 = (*layout)->FindUnit(0);
  ASSERT_NE(u0, nullptr);
  EXPECT_EQ(u0->extent_bytes, 36);
  EXPECT_EQ((*layout)->FindUnit(2), nullptr);
  ASSERT_NE((*layout)->FindFqn("c.weight"), nullptr);
  EXPECT_EQ((*layout)->FindFqn("c.weight")->first, 0);
  EXPECT_EQ((*layout)->FindFqn("c.weight")->second, 2);
}

// Mixed precision: the compute (reduce) layout has each unit in its compute (reduce) dtype,
// the same views at byte offsets of that dtype; a plan without them is its own.
TEST(ModuleLayoutTest, ComputeAndReduceLayoutsUseTheUnitsMixedPrecisionDTypes) {
  Plan plan = TwoUnitPlan();
  plan.units[0].compute_dtype = DType::kBFloat16;
  plan.units[0].reduce_dtype = DType::kFloat16;
  absl::StatusOr<std::shared_ptr<const ModuleLayout>> layout =
      ModuleLayout::Create(std::make_shared<const Plan>(plan));
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ((*layout)->FindUnit(0)->dtype, DType::kFloat32);  // the shards' own
  const std::shared_ptr<const ModuleLayout> compute = ModuleLayout::Compute(*layout);
  const std::shared_ptr<const ModuleLayout> reduce = ModuleLayout::Reduce(*layout);
  ASSERT_NE(compute, *layout);
  EXPECT_EQ(compute->FindUnit(0)->dtype, DType::kBFloat16);
  EXPECT_EQ(compute->FindUnit(0)->item_size, 2);
  EXPECT_EQ(compute->FindUnit(0)->views[1].byte_offset, 12);  // b.bias at element 6
  EXPECT_EQ(compute->FindUnit(0)->extent_bytes, 18);
  EXPECT_EQ(compute->FindUnit(1)->dtype, DType::kBFloat16);  // unit 1 has none: its dtype
  EXPECT_EQ(reduce->FindUnit(0)->dtype, DType::kFloat16);
  EXPECT_EQ(ModuleLayout::Compute(compute), compute);  // a variant has no variants
  absl::StatusOr<std::shared_ptr<const ModuleLayout>> plain =
      ModuleLayout::Create(std::make_shared<const Plan>(TwoUnitPlan()));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(ModuleLayout::Compute(*plain), *plain);
  EXPECT_EQ(ModuleLayout::Reduce(*plain), *plain);
}

TEST(ModuleLayoutTest, RefusesInconsistentPlans) {
  const auto refused = [](Plan plan, absl::string_view why) {
    absl::StatusOr<std::shared_ptr<const ModuleLayout>> layout =
        ModuleLayout::Create(std::make_shared<const Plan>(std::move(plan)));
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_THAT(layout.status().message(), HasSubstr(why));
  };
  Plan p = TwoUnitPlan();
  p.units[1].index = 0;
  refused(p, "appears twice");

  p = TwoUnitPlan();
  p.units[1].params[0].fqn = "a.weight";
  refused(p, "already in plan unit 0");

  p = TwoUnitPlan();
  p.units[0].shared[0].same_as = "h.w";  // in another unit
  refused(p, "not in the unit");

  p = TwoUnitPlan();
  p.units[0].params[1].offset = 8;  // [8, 11) past padded_numel 10
  refused(p, "outside");

  p = TwoUnitPlan();
  p.units[0].padded_numel = 5;  // < numel
  refused(p, "bad sizes");

  EXPECT_EQ(ModuleLayout::Create(nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckRangeHoldsTest, ComparesBytesWithElementsTimesItemSize) {
  MappedRange r;
  r.bytes = 40;
  EXPECT_TRUE(CheckRangeHolds(r, 10, DType::kFloat32, "x").ok());
  EXPECT_TRUE(CheckRangeHolds(r, 20, DType::kBFloat16, "x").ok());
  absl::Status s = CheckRangeHolds(r, 11, DType::kFloat32, "unit 3 shard");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("unit 3 shard"));
  EXPECT_EQ(CheckRangeHolds(r, INT64_MAX, DType::kFloat64, "x").code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace flatshard::client::internal
