// Mixed precision in the module owner (GroupManagerHarness: a real ShardStore, the inproc
// backend; host ranks and simulated GPU ranks): a compute_precision summon hands out the
// unit in param_dtype, every element equal to the cast of the float32 shard element; the
// reduce-scatter takes the gradient in reduce_dtype and lands in the float32 gradient shard
// equal to the cast of the reduction done here; units of module_types_to_ignore and every
// other summon stay full precision; writeback and rank0_only compute summons are refused.

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/cast.h"
#include "server/collective/reduce.h"
#include "server/group_manager.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
using testing::IdsOf;
using testing::RunTogether;
using testing::StatusCall;

// The units of TestModel: 0 "" (Net), 1 "enc" (Block), 2 "enc.l1", 3 "enc.l2", 4 "head"
// (Linear).
constexpr int kUnits = 5;

std::string Policy(DType param, DType reduce, const std::string& ignore) {
  return absl::StrCat(R"({"format": "flatshard.policy/1",
 "auto_wrap": {"kind": "module_types", "types": ["Block", "Linear"]},
 "mixed_precision": {"param_dtype": ")",
                      DTypeName(param), R"(", "reduce_dtype": ")", DTypeName(reduce),
                      R"(", "module_types_to_ignore": [)", ignore, "]}}");
}

// What the test's own cast gives for one float32 element, as the 16-bit pattern.
uint16_t Low(DType dtype, float v) {
  return dtype == DType::kBFloat16 ? collective::FloatToBFloat16(v) : collective::FloatToHalf(v);
}
float Widen(DType dtype, uint16_t v) {
  return dtype == DType::kBFloat16 ? collective::BFloat16ToFloat(v) : collective::HalfToFloat(v);
}

// (compute dtype, simulated GPUs: 0 = host ranks).
class MixedPrecisionTest : public testing::GroupManagerHarness,
                           public ::testing::WithParamInterface<std::tuple<DType, int>> {
 protected:
  DType low() const { return std::get<0>(GetParam()); }
  void StartWith(DType reduce, const std::string& ignore = "") {
    model_.policy = Policy(low(), reduce, ignore);
    if (std::get<1>(GetParam()) > 0) AddSimulatedGpus(std::get<1>(GetParam()));
    Start();
  }
  // Writes values no 16-bit dtype holds exactly into every rank's shards; returns each unit's
  // full float32 buffer (padded).
  std::vector<std::vector<float>> FillShards(const std::vector<Caller>& c) {
    std::vector<std::vector<float>> full(kUnits);
    for (size_t rank = 0; rank < c.size(); ++rank) {
      absl::StatusOr<RegisterResult> v = gm_->GetShards(c[rank], "");
      EXPECT_TRUE(v.ok()) << v.status();
      if (!v.ok()) return full;
      for (int u = 0; u < kUnits; ++u) {
        const Buffer& shard = *v->shards[u].shard;
        const int64_t n = testing::FloatCount(shard);
        for (int64_t i = 0; i < n; ++i) {
          const float x = 1.0f + 0.001234f * static_cast<float>(i) + 0.3717f * rank +
                          0.0421f * static_cast<float>(u);
          testing::Floats(shard)[i] = (i % 3 == 1) ? -x * 1000.0f : x;
          full[u].push_back(testing::Floats(shard)[i]);
        }
      }
    }
    return full;
  }
};

TEST_P(MixedPrecisionTest, ComputeSummonIsTheCastOfEveryShardAndTheOthersStayFullPrecision) {
  StartWith(DType::kFloat32, R"("Linear")");  // the Linear units keep float32
  std::vector<Caller> c = JoinAndRegister("g", 2);
  const std::vector<std::vector<float>> full = FillShards(c);
  std::vector<absl::StatusOr<SummonResult>> s =
      SummonAll(c, "", SummonOptions{.writeback = false, .compute_precision = true});
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(s[rank].ok()) << s[rank].status();
    ASSERT_EQ(s[rank]->views.size(), static_cast<size_t>(kUnits));
    for (const SummonedUnit& v : s[rank]->views) {
      const std::vector<float>& want = full[v.unit];
      const bool ignored = v.unit >= 2;  // Linear
      const int64_t item = ignored ? 4 : 2;
      ASSERT_EQ(v.params->bytes(), static_cast<int64_t>(want.size()) * item) << "unit " << v.unit;
      // Simulated device memory is host memory: readable as such.
      for (size_t i = 0; i < want.size(); ++i) {
        if (ignored) {
          ASSERT_EQ(testing::Floats(*v.params)[i], want[i]) << "unit " << v.unit << " at " << i;
        } else {
          const uint16_t got = static_cast<const uint16_t*>(v.params->data())[i];
          ASSERT_EQ(got, Low(low(), want[i]))
              << "rank " << rank << " unit " << v.unit << " element " << i << ": " << want[i];
        }
      }
    }
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  // summon_full_params (no compute_precision): float32, unchanged shards.
  const std::vector<std::vector<float>> read = ReadAll(c);
  ASSERT_EQ(read.size(), static_cast<size_t>(kUnits));
  for (int u = 0; u < kUnits; ++u) EXPECT_EQ(read[u], full[u]) << "unit " << u;
  // A compute summon again (kept buffers reused) still casts the current shards.
  s = SummonAll(c, "enc",
                SummonOptions{.recurse = false, .writeback = false, .compute_precision = true});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  ASSERT_EQ(s[1]->views.size(), 1u);
  EXPECT_EQ(static_cast<const uint16_t*>(s[1]->views[0].params->data())[5], Low(low(), full[1][5]));
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
}

TEST_P(MixedPrecisionTest, ComputePrecisionWithWritebackOrRank0OnlyIsRefused) {
  StartWith(DType::kFloat32);
  std::vector<Caller> c = JoinAndRegister("g", 2);
  for (const SummonOptions& o :
       {SummonOptions{.writeback = true, .compute_precision = true},
        SummonOptions{.writeback = false, .rank0_only = true, .compute_precision = true}}) {
    std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "enc", o);
    for (const absl::StatusOr<SummonResult>& r : s) {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr("compute_precision"));
      EXPECT_THAT(r.status().message(), HasSubstr(o.writeback ? "writeback" : "rank0_only"));
    }
  }
  // Nothing stayed summoned: a plain summon works.
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "enc", SummonOptions{});
  ASSERT_TRUE(s[0].ok() && s[1].ok()) << s[0].status() << s[1].status();
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
}

// The reduce-scatter in reduce_dtype: the trainer's gradient comes in it, the inproc backend
// adds every rank's (in float32), averages and rounds once to reduce_dtype, and the float32
// gradient shard holds that value widened; accumulate adds it in float32.
TEST_P(MixedPrecisionTest, ReduceScatterRunsInReduceDTypeIntoTheFloat32GradientShard) {
  const DType rd = low();
  StartWith(rd);
  std::vector<Caller> c = JoinAndRegister("g", 2);
  constexpr int32_t kUnit = 1;  // enc: bias[6] (and padding)
  std::vector<std::vector<uint16_t>> given(2);
  auto reduce_all = [&](bool accumulate) {
    std::vector<StatusCall> calls(2);
    RunTogether(2, [&](int r) {
      absl::StatusOr<std::shared_ptr<Buffer>> full = gm_->BeginReduceScatter(c[r], "", kUnit);
      if (!full.ok()) {
        calls[r].Callback()(full.status());
        return;
      }
      uint16_t* g = static_cast<uint16_t*>((*full)->data());
      const int64_t n = (*full)->bytes() / 2;
      given[r].assign(n, 0);
      for (int64_t k = 0; k < n; ++k) {
        given[r][k] = Low(rd, 0.1f * static_cast<float>(k + 1) + 0.0123f * static_cast<float>(r));
        g[k] = given[r][k];
      }
      gm_->FinishReduceScatter(c[r], "", kUnit, ReduceOp::kAvg, accumulate, Deadline(),
                               calls[r].Callback());
    });
    for (StatusCall& x : calls) ASSERT_TRUE(x.Wait().ok()) << x.Wait();
  };
  reduce_all(false);
  std::vector<float> first;  // per rank, its shard's expected values
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    const Buffer& grad = *v->shards[kUnit].grad;
    const int64_t n = testing::FloatCount(grad);              // float32: the shards' dtype
    ASSERT_EQ(n * 2, static_cast<int64_t>(given[0].size()));  // two shards
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = r * n + i;
      const float sum = Widen(rd, given[0][k]) + Widen(rd, given[1][k]);
      const float want = Widen(rd, Low(rd, sum / 2.0f));
      ASSERT_EQ(testing::Floats(grad)[i], want) << "rank " << r << " element " << i;
      first.push_back(want);
    }
  }
  reduce_all(true);  // accumulate: + the same again, added in float32
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    const Buffer& grad = *v->shards[kUnit].grad;
    const int64_t n = testing::FloatCount(grad);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(testing::Floats(grad)[i], first[r * n + i] + first[r * n + i]) << "element " << i;
    }
  }
}

// bfloat16 / float16 params; host ranks, then 2 simulated GPUs (the casts run through the
// device context).
INSTANTIATE_TEST_SUITE_P(DTypesAndDevices, MixedPrecisionTest,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(0, 2)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, int>>& info) {
                           return absl::StrCat(
                               DTypeName(std::get<0>(info.param)),
                               std::get<1>(info.param) ? "_simulated_gpus" : "_host");
                         });

// The cast kernel itself against per-element conversions (and float32 passes through).
TEST(CastIntoTest, EveryPairEqualsTheElementwiseConversion) {
  const std::vector<float> src = {0.0f,      -0.0f,    1.0f,  1.00390625f, 3.14159265f,
                                  -65504.0f, 70000.0f, 1e-8f, 6.1e-5f,     -2.5e38f};
  std::vector<uint16_t> b(src.size()), h(src.size());
  collective::CastInto(DType::kFloat32, src.data(), DType::kBFloat16, b.data(), src.size());
  collective::CastInto(DType::kFloat32, src.data(), DType::kFloat16, h.data(), src.size());
  std::vector<float> back(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(b[i], collective::FloatToBFloat16(src[i])) << i;
    EXPECT_EQ(h[i], collective::FloatToHalf(src[i])) << i;
  }
  collective::CastInto(DType::kBFloat16, b.data(), DType::kFloat32, back.data(), b.size());
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(back[i], collective::BFloat16ToFloat(b[i]));
  std::vector<uint16_t> hb(src.size());  // float16 -> bfloat16 goes through float32
  collective::CastInto(DType::kFloat16, h.data(), DType::kBFloat16, hb.data(), h.size());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(hb[i], collective::FloatToBFloat16(collective::HalfToFloat(h[i]))) << i;
  }
}

}  // namespace
}  // namespace flatshard::server
