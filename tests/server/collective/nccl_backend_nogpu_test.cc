// The NCCL backend's behaviour that needs no GPU: option parsing through the registry, the
// spec checks Connect makes before touching a device, refusing to connect (FAILED_PRECONDITION)
// on a machine without a usable GPU, unique ids, and the NCCL error mapping. Runs in the
// default (non-gpu) test set; the GPU behaviour is in nccl_backend_test.cc (label gpu).

#include <nccl.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/gpu/cuda_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/backend_registry.h"
#include "server/collective/nccl/nccl_backend.h"
#include "server/collective/nccl/nccl_library.h"

namespace flatshard::collective {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::unique_ptr<CollectiveBackend> NewBackend() {
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = CreateNcclBackend();
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// Two local ranks on GPUs 0 and 1 of a world of 2 (every rank local).
GroupSpec TwoLocalRanks() {
  GroupSpec spec = GroupSpec::AllLocal("g", 2);
  spec.local_devices = {0, 1};
  return spec;
}

bool HaveGpu() { return gpu::ListGpus().ok(); }

TEST(NcclBackendNoGpuTest, RegistryCreatesNcclAndParsesItsParameters) {
  BackendRegistry registry;
  ASSERT_TRUE(RegisterBuiltinBackends(registry).ok());
  ASSERT_TRUE(registry.Has("nccl"));
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b =
      registry.Create("nccl", {{"init_timeout_ms", "500"},
                               {"finalize_timeout_ms", "0"},
                               {"poll_interval_us", "10"},
                               {"fingerprint", "off"}});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "nccl");
  EXPECT_TRUE((*b)->Supports(MemoryKind::kCuda));
  EXPECT_FALSE((*b)->Supports(MemoryKind::kHost));
  EXPECT_FALSE((*b)->Supports(MemoryKind::kHostPinned));
  EXPECT_EQ((*b)->LocalAddress(), "");
}

TEST(NcclBackendNoGpuTest, RegistryRefusesBadParametersNamingTheKnownOnes) {
  BackendRegistry registry;
  ASSERT_TRUE(RegisterBuiltinBackends(registry).ok());
  absl::Status unknown = registry.Create("nccl", {{"rings", "2"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(unknown)) << unknown;
  EXPECT_EQ(unknown.message(),
            "nccl backend: unknown parameter 'rings' (known: init_timeout_ms, "
            "finalize_timeout_ms, poll_interval_us, fingerprint)");
  absl::Status fingerprint = registry.Create("nccl", {{"fingerprint", "yes"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(fingerprint)) << fingerprint;
  EXPECT_EQ(fingerprint.message(), "nccl backend: fingerprint must be 'on' or 'off', got 'yes'");
  absl::Status zero = registry.Create("nccl", {{"init_timeout_ms", "0"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(zero)) << zero;
  EXPECT_THAT(std::string(zero.message()), HasSubstr("init_timeout_ms must be an integer >= 1"));
  absl::Status text = registry.Create("nccl", {{"poll_interval_us", "fast"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(text)) << text;
}

TEST(NcclBackendNoGpuTest, CreateRefusesNonPositiveInitTimeout) {
  NcclBackendOptions o;
  o.init_timeout = absl::ZeroDuration();
  EXPECT_TRUE(absl::IsInvalidArgument(CreateNcclBackend(o).status()));
  o.init_timeout = absl::Seconds(1);
  o.finalize_timeout = absl::Seconds(-1);
  EXPECT_TRUE(absl::IsInvalidArgument(CreateNcclBackend(o).status()));
}

TEST(NcclBackendNoGpuTest, ConnectRefusesTwoRanksOnOneGpu) {
  auto backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  GroupSpec spec = TwoLocalRanks();
  spec.local_devices = {0, 0};
  absl::Status s = backend->Connect(spec).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(s.message(), "group g epoch 0: NCCL cannot place ranks 0 and 1 on the same GPU 0");
}

TEST(NcclBackendNoGpuTest, ConnectRefusesMalformedSpecs) {
  auto backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  {
    GroupSpec spec = TwoLocalRanks();
    spec.local_devices = {0};
    absl::Status s = backend->Connect(spec).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("NCCL needs one GPU per local rank, got 1 local_devices for 2"));
  }
  {
    GroupSpec spec = TwoLocalRanks();
    spec.local_devices = {0, -1};
    absl::Status s = backend->Connect(spec).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 has GPU -1"));
  }
  {
    GroupSpec spec = TwoLocalRanks();
    spec.nccl_unique_id = "short";
    absl::Status s = backend->Connect(spec).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("nccl_unique_id has 5 bytes, want 128"));
  }
  {
    GroupSpec spec = TwoLocalRanks();
    spec.world_size = 0;
    EXPECT_TRUE(absl::IsInvalidArgument(backend->Connect(spec).status()));
  }
  {
    GroupSpec spec = TwoLocalRanks();
    spec.local_ranks.clear();
    spec.local_devices.clear();
    absl::Status s = backend->Connect(spec).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("no local ranks"));
  }
}

TEST(NcclBackendNoGpuTest, RemoteRanksNeedRankZerosUniqueId) {
  auto backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  GroupSpec spec;
  spec.group_id = "g";
  spec.world_size = 4;
  spec.local_ranks = {2, 3};
  spec.local_devices = {0, 1};
  absl::Status s = backend->Connect(spec).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(s.message(),
            "group g epoch 0: only ranks 2, 3 of world_size 4 are local, so NCCL needs the "
            "nccl_unique_id of rank 0's daemon");
}

TEST(NcclBackendNoGpuTest, WithoutAGpuTheBackendIsNotViableAndConnectFails) {
  auto backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->IsViable(), HaveGpu());
  if (HaveGpu()) GTEST_SKIP() << "this machine has a GPU; nccl_backend_test covers Connect";
  GroupSpec spec = GroupSpec::AllLocal("g", 1);
  spec.local_devices = {0};
  absl::Status s = backend->Connect(spec).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              StartsWith("group g epoch 0: the NCCL backend needs a GPU: no usable GPU"));
  // The same with a unique id from another daemon.
  absl::StatusOr<std::string> id = MakeNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  spec.world_size = 2;
  spec.nccl_unique_id = *id;
  EXPECT_TRUE(absl::IsFailedPrecondition(backend->Connect(spec).status()));
}

TEST(NcclBackendNoGpuTest, UniqueIdsNeedNoGpuAndDiffer) {
  // ncclGetUniqueId only picks a bootstrap interface (loopback at least), no device.
  absl::StatusOr<std::string> a = MakeNcclUniqueId();
  absl::StatusOr<std::string> b = MakeNcclUniqueId();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->size(), 128u);
  EXPECT_EQ(b->size(), 128u);
  EXPECT_NE(*a, *b);
}

// libnccl is opened at run time: where it cannot be (package_cuda_hidden runs this with it
// hidden from the loader, and with FLATSHARD_NCCL_LIBRARY naming a library that is not NCCL),
// the backend, unique ids and NCCL's error strings say why instead of failing to load.
TEST(NcclBackendNoGpuTest, WithoutLibncclCreateAndUniqueIdsFailNamingIt) {
  const absl::Status nccl = NcclAvailable();
  if (nccl.ok()) GTEST_SKIP() << "libnccl loads here";
  EXPECT_TRUE(absl::IsFailedPrecondition(nccl)) << nccl;
  EXPECT_THAT(std::string(nccl.message()), HasSubstr("NCCL"));
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = CreateNcclBackend();
  EXPECT_EQ(b.status(), nccl);
  EXPECT_EQ(MakeNcclUniqueId().status(), nccl);
  ncclUniqueId id;
  EXPECT_EQ(ncclGetUniqueId(&id), ncclSystemError);
  EXPECT_EQ(std::string(ncclGetLastError(nullptr)), nccl.message());
}

TEST(NcclBackendNoGpuTest, NcclStatusMapsResultsToCanonicalCodes) {
  EXPECT_TRUE(NcclStatus(0, "ncclAllGather").ok());
  EXPECT_TRUE(NcclStatus(7, "ncclGroupEnd").ok()) << "ncclInProgress is progress, not an error";
  absl::Status remote = NcclStatus(6, "ncclAllGather of rank 1", "peer 10.0.0.2 closed");
  EXPECT_TRUE(absl::IsUnavailable(remote)) << remote;
  EXPECT_THAT(std::string(remote.message()), StartsWith("ncclAllGather of rank 1: "));
  EXPECT_THAT(std::string(remote.message()), HasSubstr(": peer 10.0.0.2 closed"));
  EXPECT_TRUE(absl::IsUnavailable(NcclStatus(2, "x")));  // ncclSystemError
  EXPECT_TRUE(absl::IsInvalidArgument(NcclStatus(4, "x")));
  EXPECT_TRUE(absl::IsInvalidArgument(NcclStatus(5, "x")));
  EXPECT_TRUE(absl::IsInternal(NcclStatus(1, "x")));  // ncclUnhandledCudaError
  EXPECT_TRUE(absl::IsInternal(NcclStatus(3, "x")));
  // Without a last error the message is just what failed and NCCL's text for the result.
  EXPECT_EQ(NcclStatus(3, "x").message(),
            absl::StrCat("x: ", ncclGetErrorString(ncclInternalError)));
}

}  // namespace
}  // namespace flatshard::collective
