// ring_algorithms over InprocTransport: what the conformance suites do not cover (odd chunk
// sizes, fingerprints off, construction errors, a transport failure mid-op).

#include "server/collective/ring_algorithms.h"

#include <memory>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_transport.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {

// Only the helpers of backend_conformance.h are used here; inproc_backend_test.cc runs its
// suites over this communicator.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendConformanceTest);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendFailureTest);

namespace {

TEST(RingAlgorithmsTest, RejectsATransportOfAnotherWorldSize) {
  auto t = std::make_shared<InprocTransport>(3);
  EXPECT_TRUE(
      absl::IsInvalidArgument(NewRingCommunicator(GroupSpec::AllLocal("g", 4), t).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(NewRingCommunicator(GroupSpec::AllLocal("g", 4), nullptr).status()));
}

TEST(RingAlgorithmsTest, BroadcastWithChunksThatDoNotDivideTheBuffer) {
  constexpr int kWorld = 5;
  RingOptions o;
  o.chunk_bytes = 3;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", kWorld),
                                  std::make_shared<InprocTransport>(kWorld), o)
                  .value();
  std::vector<std::vector<uint8_t>> buf(kWorld, std::vector<uint8_t>(17, 0));
  std::iota(buf[2].begin(), buf[2].end(), 1);
  RunRanks(kWorld, [&](int r) {
    DoneRecorder done;
    comm->Broadcast(MutableBuffer{buf[r].data(), 17}, 2, Opts(r, 1), done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(buf[r], buf[2]) << "rank " << r;
}

TEST(RingAlgorithmsTest, WithoutFingerprintsASizeMismatchStillFailsEveryRank) {
  RingOptions o;
  o.check_fingerprints = false;
  auto comm =
      NewRingCommunicator(GroupSpec::AllLocal("g", 2), std::make_shared<InprocTransport>(2), o)
          .value();
  std::vector<float> a(2), b(4), out_a(4), out_b(8);
  DoneRecorder done[2];
  comm->AllGather(ConstBuffer{a.data(), 8, DType::kFloat32},
                  MutableBuffer{out_a.data(), 16, DType::kFloat32}, Opts(0, 1), done[0].Callback());
  comm->AllGather(ConstBuffer{b.data(), 16, DType::kFloat32},
                  MutableBuffer{out_b.data(), 32, DType::kFloat32}, Opts(1, 1), done[1].Callback());
  EXPECT_TRUE(absl::IsInvalidArgument(done[0].Wait())) << done[0].status();
  EXPECT_THAT(std::string(done[0].status().message()), ::testing::HasSubstr("size mismatch"));
  EXPECT_EQ(done[1].Wait(), done[0].status());
}

TEST(RingAlgorithmsTest, ATransportFailureMidOpIsSticky) {
  auto transport = std::make_shared<InprocTransport>(3);
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", 3), transport).value();
  std::vector<float> in(1), out(3);
  DoneRecorder done[2];
  comm->AllGather(ConstBuffer{in.data(), 4, DType::kFloat32},
                  MutableBuffer{out.data(), 12, DType::kFloat32}, Opts(0, 1), done[0].Callback());
  transport->Abort(absl::UnavailableError("link down"));
  EXPECT_EQ(done[0].Wait(), absl::UnavailableError("link down"));
  EXPECT_EQ(comm->status(), absl::UnavailableError("link down"));
  comm->AllGather(ConstBuffer{in.data(), 4, DType::kFloat32},
                  MutableBuffer{out.data(), 12, DType::kFloat32}, Opts(1, 1), done[1].Callback());
  EXPECT_EQ(done[1].Wait(), absl::UnavailableError("link down"));
}

TEST(RingAlgorithmsTest, PendingOpsCountFingerprintsAsArrivals) {
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", 3), std::make_shared<InprocTransport>(3))
                  .value();
  std::vector<float> in(1), out(3);
  comm->AllGather(ConstBuffer{in.data(), 4, DType::kFloat32},
                  MutableBuffer{out.data(), 12, DType::kFloat32}, Opts(1, 4), [](absl::Status) {});
  std::vector<PendingOpInfo> p = comm->PendingOps();
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].op_seq, 4u);
  EXPECT_THAT(p[0].arrived_ranks, ::testing::ElementsAre(1));
  EXPECT_THAT(p[0].missing_ranks, ::testing::ElementsAre(0, 2));
  EXPECT_FALSE(p[0].running);
}

}  // namespace
}  // namespace flatshard::collective::testing
