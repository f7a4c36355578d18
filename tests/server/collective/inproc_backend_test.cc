// The inproc backend: the conformance suites for the backend itself, for the backend with
// every op split across helper threads, and for ring_algorithms over InprocTransport; plus
// what only the inproc backend promises (all ranks local, host memory, overlap checks).

#include "server/collective/inproc/inproc_backend.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/ring_algorithms.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {
namespace {

using ::testing::Combine;
using ::testing::HasSubstr;
using ::testing::Range;
using ::testing::Values;
using ::testing::ValuesIn;

CollectiveBackend& SharedInproc() {
  static CollectiveBackend* backend = CreateInprocBackend().value().release();
  return *backend;
}

// Every op goes through the parallel path, in small pieces.
CollectiveBackend& SharedParallelInproc() {
  static CollectiveBackend* backend = [] {
    InprocBackendOptions o;
    o.copy_threads = 2;
    o.parallel_min_bytes = 0;
    o.piece_bytes = 4096;
    return CreateInprocBackend(o).value().release();
  }();
  return *backend;
}

const BackendUnderTest kInproc{"Inproc",
                               [](const GroupSpec& g) { return SharedInproc().Connect(g); }};
const BackendUnderTest kInprocParallel{
    "InprocParallel", [](const GroupSpec& g) { return SharedParallelInproc().Connect(g); }};
const BackendUnderTest kRingOverInprocTransport{
    "RingOverInprocTransport", [](const GroupSpec& g) {
      RingOptions o;
      o.chunk_bytes = 64 << 10;  // several pipeline chunks for the 1 MiB cases
      return NewRingCommunicator(g, std::make_shared<InprocTransport>(g.world_size), o);
    }};

INSTANTIATE_TEST_SUITE_P(Inproc, BackendConformanceTest,
                         Combine(Values(&kInproc), Range(1, 9), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(InprocParallel, BackendConformanceTest,
                         Combine(Values(&kInprocParallel), Values(1, 3, 8),
                                 Values(ShardSize::k4097Elements, ShardSize::kOneMiB)),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(Ring, BackendConformanceTest,
                         Combine(Values(&kRingOverInprocTransport), Range(1, 9),
                                 ValuesIn(AllShardSizes())),
                         ConformanceName);

INSTANTIATE_TEST_SUITE_P(All, BackendFailureTest, Values(&kInproc, &kRingOverInprocTransport),
                         FailureName);

using ::flatshard::testing::DoneRecorder;

TEST(InprocBackendTest, DescribesItself) {
  EXPECT_EQ(SharedInproc().Name(), "inproc");
  EXPECT_TRUE(SharedInproc().IsViable());
  EXPECT_TRUE(SharedInproc().Supports(MemoryKind::kHost));
  EXPECT_TRUE(SharedInproc().Supports(MemoryKind::kHostPinned));
  EXPECT_FALSE(SharedInproc().Supports(MemoryKind::kCuda));
}

TEST(InprocBackendTest, ConnectNeedsEveryRankLocal) {
  GroupSpec spec;
  spec.group_id = "g";
  spec.world_size = 4;
  spec.local_ranks = {0, 2};
  absl::StatusOr<std::unique_ptr<Communicator>> comm = SharedInproc().Connect(spec);
  EXPECT_TRUE(absl::IsFailedPrecondition(comm.status())) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("ranks 1, 3 live elsewhere"));
}

TEST(InprocBackendTest, ConnectRejectsMalformedSpecs) {
  GroupSpec spec = GroupSpec::AllLocal("g", 0);
  EXPECT_TRUE(absl::IsInvalidArgument(SharedInproc().Connect(spec).status()));
  spec = GroupSpec::AllLocal("g", 2);
  spec.local_ranks = {1, 0};
  EXPECT_TRUE(absl::IsInvalidArgument(SharedInproc().Connect(spec).status()));
}

TEST(InprocBackendTest, RefusesCudaBuffers) {
  auto comm = SharedInproc().Connect(GroupSpec::AllLocal("g", 1)).value();
  float in = 1, out = 0;
  DoneRecorder done;
  comm->AllGather(ConstBuffer{&in, 4, DType::kFloat32, MemoryKind::kCuda},
                  MutableBuffer{&out, 4, DType::kFloat32}, Opts(0, 1), done.Callback());
  absl::Status s = done.Wait();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot access cuda memory"));
}

TEST(InprocBackendTest, PartiallyOverlappingOutputsFailEveryRank) {
  auto comm = SharedInproc().Connect(GroupSpec::AllLocal("g", 2)).value();
  std::vector<float> in0(4, 0), in1(4, 1), big(12, -1);
  DoneRecorder done[2];
  // Rank 1's output starts one shard into rank 0's: neither shared nor disjoint.
  comm->AllGather(ConstBuffer{in0.data(), 16, DType::kFloat32},
                  MutableBuffer{big.data(), 32, DType::kFloat32}, Opts(0, 1), done[0].Callback());
  comm->AllGather(ConstBuffer{in1.data(), 16, DType::kFloat32},
                  MutableBuffer{big.data() + 4, 32, DType::kFloat32}, Opts(1, 1),
                  done[1].Callback());
  for (DoneRecorder& d : done) {
    absl::Status s = d.Wait();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("overlap"));
  }
  EXPECT_FALSE(comm->status().ok());
}

TEST(InprocBackendTest, InputInsideAnotherRanksSlotIsRejected) {
  auto comm = SharedInproc().Connect(GroupSpec::AllLocal("g", 2)).value();
  std::vector<float> shared(8, 0);
  DoneRecorder done[2];
  // Rank 1's input sits in slot 0, which rank 0's shard overwrites.
  comm->AllGather(ConstBuffer{shared.data() + 0, 16, DType::kFloat32},
                  MutableBuffer{shared.data(), 32, DType::kFloat32}, Opts(0, 1),
                  done[0].Callback());
  comm->AllGather(ConstBuffer{shared.data() + 1, 16, DType::kFloat32},
                  MutableBuffer{shared.data(), 32, DType::kFloat32}, Opts(1, 1),
                  done[1].Callback());
  for (DoneRecorder& d : done) EXPECT_TRUE(absl::IsInvalidArgument(d.Wait())) << d.status();
}

TEST(InprocBackendTest, ReduceScatterInPlaceOutput) {
  constexpr int kWorld = 3;
  constexpr size_t kShard = 5;
  auto comm = SharedInproc().Connect(GroupSpec::AllLocal("g", kWorld)).value();
  std::vector<std::vector<float>> buf(kWorld, std::vector<float>(kShard * kWorld));
  for (int k = 0; k < kWorld; ++k) {
    for (size_t j = 0; j < buf[k].size(); ++j) buf[k][j] = static_cast<float>(k + j);
  }
  DoneRecorder done[kWorld];
  ::flatshard::testing::RunRanks(kWorld, [&](int r) {
    comm->ReduceScatter(ConstBuffer{buf[r].data(), kShard * kWorld * 4, DType::kFloat32},
                        MutableBuffer{buf[r].data() + r * kShard, kShard * 4, DType::kFloat32},
                        ReduceOp::kSum, Opts(r, 1), done[r].Callback());
    EXPECT_TRUE(done[r].Wait().ok()) << done[r].status();
  });
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < kShard; ++i) {
      // sum over k of (k + r*kShard + i) = 0+1+2 + 3*(r*kShard + i)
      EXPECT_EQ(buf[r][r * kShard + i], 3.0f + 3.0f * (r * kShard + i));
    }
  }
}

TEST(InprocBackendTest, MismatchOfRootOrDtypeIsNamed) {
  auto comm = SharedInproc().Connect(GroupSpec::AllLocal("g", 2)).value();
  std::vector<uint16_t> a(4), b(4);
  DoneRecorder done[2];
  comm->Broadcast(MutableBuffer{a.data(), 8, DType::kBFloat16}, 0, Opts(0, 1, -1),
                  done[0].Callback());
  comm->Broadcast(MutableBuffer{b.data(), 8, DType::kFloat16}, 1, Opts(1, 1, -1),
                  done[1].Callback());
  EXPECT_EQ(done[0].Wait().message(),
            "collective mismatch at op_seq 1: rank 0 called Broadcast(8 bytes, bfloat16, root "
            "0) but rank 1 called Broadcast(8 bytes, float16, root 1)");
  EXPECT_EQ(done[1].Wait(), done[0].status());
}

TEST(InprocBackendTest, DeadlineMessageReportsTheTimeout) {
  auto comm = SharedInproc().Connect(GroupSpec::AllLocal("g", 2)).value();
  float in = 0, out[2];
  DoneRecorder done;
  comm->AllGather(ConstBuffer{&in, 4, DType::kFloat32}, MutableBuffer{out, 8, DType::kFloat32},
                  Opts(0, 9, 3, absl::Milliseconds(50)), done.Callback());
  absl::Status s = done.Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::MatchesRegex("op_seq 9 AllGather\\(unit 3, 4 bytes, float32\\): rank 1 "
                                      "did not arrive within [0-9]+ms"));
}

TEST(InprocBackendTest, CommunicatorsOfOneBackendAreIndependent) {
  auto a = SharedInproc().Connect(GroupSpec::AllLocal("a", 1)).value();
  auto b = SharedInproc().Connect(GroupSpec::AllLocal("b", 1)).value();
  a->Abort(absl::AbortedError("a only"));
  float in = 2, out = 0;
  DoneRecorder done;
  b->AllGather(ConstBuffer{&in, 4, DType::kFloat32}, MutableBuffer{&out, 4, DType::kFloat32},
               Opts(0, 1), done.Callback());
  EXPECT_TRUE(done.Wait().ok());
  EXPECT_EQ(out, 2);
}

}  // namespace
}  // namespace flatshard::collective::testing
