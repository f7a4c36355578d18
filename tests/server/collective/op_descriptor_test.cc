// Descriptors: spelling, argument checks, error texts, the wire form.

#include "server/collective/op_descriptor.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::collective {
namespace {

using ::testing::HasSubstr;

TEST(OpDescriptorTest, FormatsEveryKind) {
  float buf[8];
  EXPECT_EQ(FormatOp(AllGatherCall(ConstBuffer{buf, 16, DType::kFloat32},
                                   MutableBuffer{buf, 32, DType::kFloat32}, 3)
                         .desc),
            "AllGather(unit 3, 16 bytes, float32)");
  EXPECT_EQ(FormatOp(ReduceScatterCall(ConstBuffer{buf, 16, DType::kBFloat16},
                                       MutableBuffer{buf, 8, DType::kBFloat16}, ReduceOp::kAvg, 0)
                         .desc),
            "ReduceScatter(unit 0, 8 bytes, bfloat16, avg)");
  EXPECT_EQ(FormatOp(BroadcastCall(MutableBuffer{buf, 4, DType::kUInt8}, 2, -1).desc),
            "Broadcast(4 bytes, uint8, root 2)");
  EXPECT_EQ(FormatOp(GatherCall(ConstBuffer{buf, 4, DType::kFloat64}, MutableBuffer{}, 0, 9).desc),
            "Gather(unit 9, 4 bytes, float64, root 0)");
  EXPECT_EQ(FormatRanks({1}), "rank 1");
  EXPECT_EQ(FormatRanks({1, 3}), "ranks 1, 3");
}

TEST(OpDescriptorTest, ValidatesShapesAndTypes) {
  float buf[16];
  auto check = [](const OpCall& c, int rank) { return ValidateCall(c, rank, 4, 7, true); };
  EXPECT_TRUE(check(AllGatherCall(ConstBuffer{buf, 8, DType::kFloat32},
                                  MutableBuffer{buf, 32, DType::kFloat32}, 1),
                    0)
                  .ok());
  absl::Status s = check(AllGatherCall(ConstBuffer{buf, 8, DType::kFloat32},
                                       MutableBuffer{buf, 30, DType::kFloat32}, 1),
                         2);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_EQ(s.message(),
            "rank 2 op_seq 7 AllGather(unit 1, 8 bytes, float32): output has 30 bytes, want 8 x "
            "4 ranks");
  EXPECT_THAT(
      std::string(check(ReduceScatterCall(ConstBuffer{buf, 16, DType::kInt32},
                                          MutableBuffer{buf, 4, DType::kInt32}, ReduceOp::kSum, 1),
                        0)
                      .message()),
      HasSubstr("reductions need float32"));
  EXPECT_THAT(std::string(check(ReduceScatterCall(ConstBuffer{buf, 12, DType::kFloat64},
                                                  MutableBuffer{buf, 3, DType::kFloat64},
                                                  ReduceOp::kSum, 1),
                                0)
                              .message()),
              HasSubstr("not a multiple of 8"));
  EXPECT_THAT(std::string(check(BroadcastCall(MutableBuffer{buf, 4}, 4, 1), 0).message()),
              HasSubstr("root must be in [0, 4)"));
  // Gather: only root needs an output.
  EXPECT_TRUE(
      check(GatherCall(ConstBuffer{buf, 4, DType::kFloat32}, MutableBuffer{}, 0, 1), 1).ok());
  EXPECT_FALSE(
      check(GatherCall(ConstBuffer{buf, 4, DType::kFloat32}, MutableBuffer{}, 0, 1), 0).ok());
  EXPECT_THAT(std::string(check(AllGatherCall(ConstBuffer{nullptr, 4, DType::kFloat32},
                                              MutableBuffer{buf, 16, DType::kFloat32}, 1),
                                0)
                              .message()),
              HasSubstr("input is null"));
  EXPECT_TRUE(check(AllGatherCall(ConstBuffer{}, MutableBuffer{}, 1), 0).ok());  // zero bytes
  EXPECT_THAT(std::string(check(AllGatherCall(ConstBuffer{buf, 4, DType::kFloat32},
                                              MutableBuffer{buf, 16, DType::kFloat16}, 1),
                                0)
                              .message()),
              HasSubstr("output dtype float16 differs"));
}

TEST(OpDescriptorTest, ErrorTexts) {
  OpDescriptor ag;
  ag.unit = 3;
  ag.bytes = 4096;
  ag.dtype = DType::kFloat32;
  OpDescriptor rs = ag;
  rs.kind = CollectiveKind::kReduceScatter;
  absl::Status m = MismatchError(12, 2, rs, 0, ag);  // ordered by rank
  EXPECT_TRUE(absl::IsAborted(m));
  EXPECT_EQ(m.message(),
            "collective mismatch at op_seq 12: rank 0 called AllGather(unit 3, 4096 bytes, "
            "float32) but rank 2 called ReduceScatter(unit 3, 4096 bytes, float32, sum)");
  absl::Status d = MissingRanksError(12, ag, {1, 3}, absl::Seconds(5) - absl::Microseconds(13));
  EXPECT_TRUE(absl::IsDeadlineExceeded(d));
  EXPECT_EQ(d.message(),
            "op_seq 12 AllGather(unit 3, 4096 bytes, float32): ranks 1, 3 did not arrive within "
            "5s");
}

TEST(OpDescriptorTest, WireFormRoundTrips) {
  OpDescriptor d;
  d.kind = CollectiveKind::kGather;
  d.unit = 77;
  d.bytes = 1 << 20;
  d.dtype = DType::kBFloat16;
  d.root = 5;
  WireDescriptor w = EncodeDescriptor(9, d);
  EXPECT_EQ(w.op_seq, 9u);
  std::optional<OpDescriptor> back = DecodeDescriptor(w);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, d);
  EXPECT_FALSE(DecodeDescriptor(WireDescriptor{}).has_value());
  w.kind = 200;
  EXPECT_FALSE(DecodeDescriptor(w).has_value());
}

TEST(OpDescriptorTest, GroupSpecChecks) {
  EXPECT_TRUE(CheckGroupSpec(GroupSpec::AllLocal("g", 3)).ok());
  GroupSpec bad = GroupSpec::AllLocal("g", 3);
  bad.local_ranks = {0, 0};
  EXPECT_TRUE(absl::IsInvalidArgument(CheckGroupSpec(bad)));
  bad.local_ranks = {3};
  EXPECT_TRUE(absl::IsInvalidArgument(CheckGroupSpec(bad)));
  GroupSpec partial = GroupSpec::AllLocal("g", 4);
  partial.local_ranks = {1, 2};
  EXPECT_TRUE(CheckRank(2, partial).ok());
  EXPECT_THAT(std::string(CheckRank(0, partial).message()), HasSubstr("not hosted here"));
  EXPECT_THAT(std::string(CheckRank(4, partial).message()), HasSubstr("outside group g"));
}

}  // namespace
}  // namespace flatshard::collective
