// Same-host single copies (server/collective/ucx/same_host_copy.h): ProcessCopy against this
// process and a dead child, and UCX backends in one process (one host identity) whose large
// messages travel as a CopyHeader plus one process_vm_readv, checked to the element, with the
// path counted in the backend's stats; a receiver that may not read falls back to UCX.

#include "server/collective/ucx/same_host_copy.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <vector>

#include "common/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/ucx/ucx_backend.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;
using ucx::AckCode;
using ucx::CopyHeader;
using ucx::ProcessCopy;
using ucx::TokenSlot;

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendConformanceTest);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendFailureTest);

CopyHeader HeaderFor(const void* src, size_t bytes, const TokenSlot& slot, pid_t pid = getpid()) {
  CopyHeader h;
  h.pid = static_cast<uint64_t>(pid);
  h.pid_namespace = ucx::PidNamespace();
  h.address = reinterpret_cast<uint64_t>(src);
  h.bytes = bytes;
  h.token_address = slot.address();
  h.token = slot.token();
  return h;
}

ProcessCopy::State RunToEnd(ProcessCopy& copy, int* steps = nullptr) {
  int n = 0;
  while (copy.Step() == ProcessCopy::State::kCopying) ++n;
  if (steps != nullptr) *steps = n + 1;
  return copy.state();
}

TEST(ProcessCopyTest, CopiesInChunksToTheElementWhileTheTokenIsKept) {
  std::vector<uint8_t> src((size_t{10} << 20) + 123), dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  TokenSlot slot;
  ProcessCopy copy(HeaderFor(src.data(), src.size(), slot), dst.data(), size_t{1} << 20, "rank 1");
  int steps = 0;
  ASSERT_EQ(RunToEnd(copy, &steps), ProcessCopy::State::kDone) << copy.status();
  EXPECT_EQ(steps, 11);  // ten whole chunks and the rest: an abort can stop it in between
  EXPECT_EQ(copy.copied(), src.size());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
  EXPECT_EQ(copy.Ack().code, static_cast<uint32_t>(AckCode::kOk));
}

TEST(ProcessCopyTest, BytesOfASenderThatGaveUpAreRefused) {
  std::vector<uint8_t> src(1 << 20, 5), dst(src.size());
  TokenSlot slot;
  ProcessCopy copy(HeaderFor(src.data(), src.size(), slot), dst.data(), size_t{1} << 18, "rank 2");
  ASSERT_EQ(copy.Step(), ProcessCopy::State::kCopying);
  slot.Release();  // the sender's op was aborted: its buffer may be reused from now on
  ASSERT_EQ(RunToEnd(copy), ProcessCopy::State::kFailed);
  EXPECT_EQ(copy.status().code(), absl::StatusCode::kAborted) << copy.status();
  EXPECT_THAT(copy.status().message(), HasSubstr("rank 2"));
  EXPECT_EQ(copy.Ack().code, static_cast<uint32_t>(AckCode::kReleased));
}

TEST(ProcessCopyTest, UnreadableAddressFailsNamingPeerAndBytes) {
  std::vector<uint8_t> dst(8192);
  TokenSlot slot;
  CopyHeader h = HeaderFor(nullptr, dst.size(), slot);
  h.address = 4096;  // never mapped
  ProcessCopy copy(h, dst.data(), 4096, "rank 3 (daemon pid 1)");
  ASSERT_EQ(RunToEnd(copy), ProcessCopy::State::kFailed);
  EXPECT_EQ(copy.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(copy.status().message(), HasSubstr("rank 3 (daemon pid 1)"));
  EXPECT_THAT(copy.status().message(), HasSubstr("after 0 of 8192 bytes"));
  EXPECT_EQ(copy.Ack().code, static_cast<uint32_t>(AckCode::kFailed));
  EXPECT_EQ(copy.Ack().error, EFAULT);
}

TEST(ProcessCopyTest, DeadSenderFailsWithEsrchNotTheProcess) {
  std::vector<uint8_t> src(1 << 20, 9), dst(src.size());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);  // reaped: the pid names nobody now
  TokenSlot slot;
  ProcessCopy copy(HeaderFor(src.data(), src.size(), slot, child), dst.data(), 1 << 18, "rank 1");
  ASSERT_EQ(RunToEnd(copy), ProcessCopy::State::kFailed);
  EXPECT_EQ(copy.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(copy.status().message(), HasSubstr("the peer daemon exited"));
}

TEST(ProcessCopyTest, AnotherPidNamespaceIsDeniedBeforeAnyRead) {
  std::vector<uint8_t> src(1 << 16, 1), dst(src.size(), 0);
  TokenSlot slot;
  CopyHeader h = HeaderFor(src.data(), src.size(), slot);
  h.pid_namespace ^= 1;
  ProcessCopy copy(h, dst.data(), 4096, "rank 1");
  EXPECT_EQ(copy.state(), ProcessCopy::State::kDenied);
  EXPECT_EQ(copy.Step(), ProcessCopy::State::kDenied);
  EXPECT_EQ(copy.copied(), 0u);
  EXPECT_EQ(dst[0], 0);
  EXPECT_EQ(copy.Ack().code, static_cast<uint32_t>(AckCode::kDenied));
}

// --- Through the UCX backend ------------------------------------------------------------------

// Both "daemons" live in this process (one host identity): copies read this process.
std::unique_ptr<CollectiveBackend> NewBackend(const UcxBackendOptions& options) {
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = CreateUcxBackend(options);
  FS_CHECK(b.ok()) << b.status();
  return *std::move(b);
}

UcxBackendStats StatsOf(CollectiveBackend& b) {
  absl::StatusOr<UcxBackendStats> s = dynamic_cast<UcxBackend&>(b).Stats();
  FS_CHECK(s.ok()) << s.status();
  return *s;
}

struct Outcome {
  UcxBackendStats stats[2];
};

// Two backends ("daemons") of one rank each: a 2 x `shard_bytes` all-gather and a
// reduce-scatter of 2 x `shard_bytes`, both checked to the element.
Outcome RunTwoDaemons(const UcxBackendOptions& o0, const UcxBackendOptions& o1,
                      size_t shard_bytes) {
  std::unique_ptr<CollectiveBackend> daemons[2] = {NewBackend(o0), NewBackend(o1)};
  std::vector<std::unique_ptr<Communicator>> comms(2);
  for (int d = 0; d < 2; ++d) {
    GroupSpec spec;
    spec.group_id = "copy";
    spec.epoch = 1;
    spec.world_size = 2;
    spec.local_ranks = {d};
    spec.rank_addresses = {daemons[0]->LocalAddress(), daemons[1]->LocalAddress()};
    absl::StatusOr<std::unique_ptr<Communicator>> c = daemons[d]->Connect(spec);
    FS_CHECK(c.ok()) << c.status();
    comms[d] = *std::move(c);
  }
  const size_t n = shard_bytes / 4;
  std::vector<std::vector<float>> in(2, std::vector<float>(n)), out(2, std::vector<float>(2 * n));
  std::vector<std::vector<float>> rs_in(2, std::vector<float>(2 * n)),
      rs_out(2, std::vector<float>(n));
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < n; ++i) in[r][i] = ShardValue(r, i);
    for (size_t i = 0; i < 2 * n; ++i) rs_in[r][i] = static_cast<float>((i % 4096) + r);
  }
  RunRanks(2, [&](int r) {
    DoneRecorder ag, rs;
    comms[r]->AllGather(ConstBuffer{in[r].data(), n * 4, DType::kFloat32},
                        MutableBuffer{out[r].data(), 2 * n * 4, DType::kFloat32}, Opts(r, 1),
                        ag.Callback());
    EXPECT_TRUE(ag.Wait().ok()) << ag.Wait();
    comms[r]->ReduceScatter(ConstBuffer{rs_in[r].data(), 2 * n * 4, DType::kFloat32},
                            MutableBuffer{rs_out[r].data(), n * 4, DType::kFloat32}, ReduceOp::kSum,
                            Opts(r, 2), rs.Callback());
    EXPECT_TRUE(rs.Wait().ok()) << rs.Wait();
  });
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(BlockHolds(out[r].data() + k * n, k, n));
    for (size_t i = 0; i < n; ++i) {
      const float want = 2.0f * static_cast<float>((r * n + i) % 4096) + 1.0f;
      if (rs_out[r][i] != want) {
        ADD_FAILURE() << "rank " << r << " reduce-scatter element " << i << ": " << rs_out[r][i]
                      << " != " << want;
        break;
      }
    }
  }
  Outcome result;
  for (int d = 0; d < 2; ++d) result.stats[d] = StatsOf(*daemons[d]);
  return result;
}

// Messages each daemon receives for one all-gather and one reduce-scatter of `shard_bytes` per
// rank between two daemons: the all-gather's one, and the pipelined reduce-scatter's one per
// chunk (UcxBackendOptions::pipeline_chunk_bytes).
uint64_t MessagesPerDaemon(size_t shard_bytes) {
  const size_t chunk = UcxBackendOptions().pipeline_chunk_bytes;
  return 1 + (shard_bytes + chunk - 1) / chunk;
}

TEST(SameHostCopyBackendTest, LargeMessagesGoByOneCopyToTheElement) {
  const size_t shard_bytes = size_t{8} << 20;
  const Outcome o = RunTwoDaemons({}, {}, shard_bytes);
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(o.stats[d].same_host_copies, MessagesPerDaemon(shard_bytes)) << "daemon " << d;
    EXPECT_EQ(o.stats[d].same_host_copy_denied, 0u);
    EXPECT_EQ(o.stats[d].same_host_copy_failed, 0u);
  }
}

TEST(SameHostCopyBackendTest, SmallMessagesAndTheOffSwitchStayOnUcx) {
  Outcome o = RunTwoDaemons({}, {}, size_t{64} << 10);  // below the 256 KiB threshold
  for (int d = 0; d < 2; ++d) EXPECT_EQ(o.stats[d].same_host_copies, 0u);
  UcxBackendOptions off;
  off.same_host_copy_min_bytes = 0;
  o = RunTwoDaemons(off, off, size_t{8} << 20);
  for (int d = 0; d < 2; ++d) EXPECT_EQ(o.stats[d].same_host_copies, 0u);
  // Daemons need not agree: daemon 1 still sends by copy, daemon 0 takes it.
  o = RunTwoDaemons({}, off, size_t{8} << 20);
  EXPECT_EQ(o.stats[0].same_host_copies, 0u);
  EXPECT_EQ(o.stats[1].same_host_copies, MessagesPerDaemon(size_t{8} << 20));
}

TEST(SameHostCopyBackendTest, ADeniedReceiverGetsTheBytesOverUcx) {
  UcxBackendOptions deny;
  deny.testing_deny_same_host_copy = true;
  const Outcome o = RunTwoDaemons(deny, {}, size_t{8} << 20);
  // Daemon 1 learns from the first denial and sends the rest over UCX straight away.
  EXPECT_EQ(o.stats[0].same_host_copies, 0u);
  EXPECT_EQ(o.stats[0].same_host_copy_denied, 1u);
  EXPECT_EQ(o.stats[1].same_host_copies, MessagesPerDaemon(size_t{8} << 20));
}

}  // namespace
}  // namespace flatshard::collective::testing
