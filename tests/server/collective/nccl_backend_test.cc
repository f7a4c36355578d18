// The NCCL backend on a real GPU (CTest label gpu; skipped where gpu::ListGpus() fails).
// World size 1 covers every collective's data path and numerics against host references, with
// fingerprints on and off; two GPUs (when present) cover grouped launches across devices and
// the fingerprint mismatch; a world of 2 whose rank 1 never joins covers init that never
// completes, deadlines and Abort. The shared conformance suites run NCCL behind the staging
// communicator on host buffers, one rank per GPU (world 1 on one GPU; the rest skip).

#include "server/collective/nccl/nccl_backend.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/gpu/cuda_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/staging/staging_communicator.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::flatshard::testing::RunRanks;
using ::testing::Combine;
using ::testing::HasSubstr;
using ::testing::Range;
using ::testing::Values;
using ::testing::ValuesIn;

// Device memory on one GPU, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : device_(device), bytes_(bytes) {
    gpu::ScopedCudaDevice on(device);
    EXPECT_TRUE(on.status().ok()) << on.status();
    if (bytes > 0) {
      EXPECT_EQ(cudaMalloc(&data_, bytes), cudaSuccess);
    }
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void Upload(const void* host, size_t bytes, size_t offset = 0) {
    ASSERT_EQ(
        cudaMemcpy(static_cast<uint8_t*>(data_) + offset, host, bytes, cudaMemcpyHostToDevice),
        cudaSuccess);
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> out(bytes_ / sizeof(T));
    EXPECT_EQ(cudaMemcpy(out.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  ConstBuffer In(DType dtype, size_t offset = 0, size_t bytes = SIZE_MAX) const {
    return ConstBuffer{static_cast<uint8_t*>(data_) + offset,
                       bytes == SIZE_MAX ? bytes_ - offset : bytes, dtype, MemoryKind::kCuda};
  }
  MutableBuffer Out(DType dtype) const {
    return MutableBuffer{data_, bytes_, dtype, MemoryKind::kCuda};
  }
  int device() const { return device_; }

 private:
  int device_;
  size_t bytes_;
  void* data_ = nullptr;
};

class NcclBackendTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
    if (!gpus.ok()) GTEST_SKIP() << "no GPU: " << gpus.status();
    gpus_ = static_cast<int>(gpus->size());
    NcclBackendOptions o;
    o.fingerprint = GetParam();
    o.init_timeout = absl::Seconds(60);
    o.finalize_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = CreateNcclBackend(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
    ASSERT_TRUE(backend_->IsViable());
  }

  std::unique_ptr<Communicator> ConnectAllLocal(int world) {
    GroupSpec spec = GroupSpec::AllLocal(absl::StrCat("nccl-test-", world), world);
    for (int r = 0; r < world; ++r) spec.local_devices.push_back(r);
    absl::StatusOr<std::unique_ptr<Communicator>> c = backend_->Connect(spec);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // World 2, only rank 0 here: NCCL init waits for a rank 1 that never comes.
  std::unique_ptr<Communicator> ConnectHalf() {
    GroupSpec spec;
    spec.group_id = "nccl-half";
    spec.world_size = 2;
    spec.local_ranks = {0};
    spec.local_devices = {0};
    absl::StatusOr<std::string> id = MakeNcclUniqueId();
    EXPECT_TRUE(id.ok()) << id.status();
    spec.nccl_unique_id = id.value_or("");
    absl::StatusOr<std::unique_ptr<Communicator>> c = backend_->Connect(spec);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  int gpus_ = 0;
  std::unique_ptr<CollectiveBackend> backend_;
};

// The shared suites (backend_conformance.h) pass host buffers, which NCCL refuses: they run
// NCCL behind the staging communicator, as the daemon does for host buffers of NCCL groups
// (device staging buffers, CUDA copies), one rank per GPU. Where a world needs more GPUs than
// there are (or there is none), connect fails and the suite skips with that reason: one GPU
// runs world 1 of BackendConformanceTest and skips BackendFailureTest (4 ranks).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectStagedNccl(const GroupSpec& group) {
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (!gpus.ok())
    return absl::FailedPreconditionError(absl::StrCat("no GPU: ", gpus.status().ToString()));
  if (group.world_size > static_cast<int>(gpus->size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("world_size ", group.world_size, " needs ", group.world_size,
                     " GPUs (NCCL places one rank per GPU), ", gpus->size(), " visible"));
  }
  static CollectiveBackend* backend = [] {
    absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = CreateNcclBackend();
    return b.ok() ? b->release() : nullptr;
  }();
  if (backend == nullptr) return absl::InternalError("CreateNcclBackend failed");
  static const std::shared_ptr<DeviceCopier> copier = MakeCudaDeviceCopier();
  GroupSpec spec = group;
  spec.local_devices.clear();
  for (int r = 0; r < spec.world_size; ++r) spec.local_devices.push_back(r);
  absl::StatusOr<std::unique_ptr<Communicator>> inner = backend->Connect(spec);
  if (!inner.ok()) return inner.status();
  EXPECT_EQ((*inner)->backend_name(), "nccl");
  std::unique_ptr<Communicator> staged =
      MakeStagingCommunicator(*std::move(inner), MemoryKind::kCuda, spec, copier);
  EXPECT_EQ(staged->backend_name(), "nccl");  // NCCL moves device memory itself
  return staged;
}

const BackendUnderTest kStagedNccl{"nccl", ConnectStagedNccl};

INSTANTIATE_TEST_SUITE_P(Nccl, BackendConformanceTest,
                         Combine(Values(&kStagedNccl), Range(1, 9), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(Nccl, BackendFailureTest, Values(&kStagedNccl), FailureName);

INSTANTIATE_TEST_SUITE_P(Fingerprint, NcclBackendTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("On") : std::string("Off");
                         });

TEST_P(NcclBackendTest, World1AllGatherSeparateAndInPlace) {
  auto comm = ConnectAllLocal(1);
  ASSERT_NE(comm, nullptr);
  constexpr size_t n = 4097;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = ShardValue(0, i);
  DeviceBuffer in(0, n * 4), out(0, n * 4);
  in.Upload(host.data(), n * 4);
  DoneRecorder done;
  comm->AllGather(in.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 1), done.Callback());
  ASSERT_TRUE(done.Wait().ok()) << done.status();
  EXPECT_TRUE(BlockHolds(out.Download<float>().data(), 0, n));
  DoneRecorder in_place;
  comm->AllGather(out.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 2),
                  in_place.Callback());
  ASSERT_TRUE(in_place.Wait().ok()) << in_place.status();
  EXPECT_TRUE(BlockHolds(out.Download<float>().data(), 0, n));
  EXPECT_TRUE(comm->PendingOps().empty());
}

TEST_P(NcclBackendTest, World1ReduceScatterMatchesHostReference) {
  auto comm = ConnectAllLocal(1);
  ASSERT_NE(comm, nullptr);
  uint64_t op_seq = 0;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op)));
      constexpr size_t n = 1000;
      const size_t item = static_cast<size_t>(ItemSize(dtype));
      std::vector<uint8_t> host(n * item);
      for (size_t j = 0; j < n; ++j) StoreAs(dtype, host.data(), j, ReduceInput(0, j));
      DeviceBuffer in(0, n * item), out(0, n * item);
      in.Upload(host.data(), host.size());
      DoneRecorder done;
      comm->ReduceScatter(in.In(dtype), out.Out(dtype), op, Opts(0, ++op_seq), done.Callback());
      ASSERT_TRUE(done.Wait().ok()) << done.status();
      std::vector<uint8_t> got = out.Download<uint8_t>();
      for (size_t j = 0; j < n; ++j) {
        ASSERT_EQ(LoadAs(dtype, got.data(), j), ExpectedReduce(dtype, op, ReduceInput(0, j), 1))
            << "element " << j;
      }
    }
  }
}

TEST_P(NcclBackendTest, World1BroadcastGatherAndZeroBytes) {
  auto comm = ConnectAllLocal(1);
  ASSERT_NE(comm, nullptr);
  constexpr size_t n = 513;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = ShardValue(0, i);
  DeviceBuffer buf(0, n * 4), out(0, n * 4);
  buf.Upload(host.data(), n * 4);
  DoneRecorder bcast, gather, empty;
  comm->Broadcast(buf.Out(DType::kFloat32), 0, Opts(0, 1), bcast.Callback());
  ASSERT_TRUE(bcast.Wait().ok()) << bcast.status();
  EXPECT_TRUE(BlockHolds(buf.Download<float>().data(), 0, n));
  comm->Gather(buf.In(DType::kFloat32), out.Out(DType::kFloat32), 0, Opts(0, 2), gather.Callback());
  ASSERT_TRUE(gather.Wait().ok()) << gather.status();
  EXPECT_TRUE(BlockHolds(out.Download<float>().data(), 0, n));
  comm->AllGather(ConstBuffer{nullptr, 0, DType::kFloat32},
                  MutableBuffer{nullptr, 0, DType::kFloat32}, Opts(0, 3), empty.Callback());
  EXPECT_TRUE(empty.Wait().ok()) << empty.status();
}

TEST_P(NcclBackendTest, HostBuffersFailStickyWithInvalidArgument) {
  auto comm = ConnectAllLocal(1);
  ASSERT_NE(comm, nullptr);
  std::vector<float> in(16), out(16);
  DoneRecorder done, later;
  comm->AllGather(ConstBuffer{in.data(), 64, DType::kFloat32},
                  MutableBuffer{out.data(), 64, DType::kFloat32}, Opts(0, 1), done.Callback());
  absl::Status s = done.Wait();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("rank 0 op_seq 1 AllGather(unit 3, 64 bytes, float32): the NCCL backend "
                        "needs cuda memory, but the input is host"));
  DeviceBuffer d(0, 64);
  comm->AllGather(d.In(DType::kFloat32), d.Out(DType::kFloat32), Opts(0, 2), later.Callback());
  EXPECT_EQ(later.Wait(), s);
}

TEST_P(NcclBackendTest, TwoGpusAllGatherAndReduceScatterInOneGroupedLaunch) {
  if (gpus_ < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto comm = ConnectAllLocal(2);
  ASSERT_NE(comm, nullptr);
  constexpr size_t n = 1 << 16;
  std::vector<std::unique_ptr<DeviceBuffer>> in, out;
  for (int r = 0; r < 2; ++r) {
    std::vector<float> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = ShardValue(r, i);
    in.push_back(std::make_unique<DeviceBuffer>(r, n * 4));
    out.push_back(std::make_unique<DeviceBuffer>(r, 2 * n * 4));
    in[r]->Upload(host.data(), n * 4);
  }
  DoneRecorder done[2];
  RunRanks(2, [&](int r) {
    comm->AllGather(in[r]->In(DType::kFloat32), out[r]->Out(DType::kFloat32), Opts(r, 1),
                    done[r].Callback());
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(done[r].Wait().ok()) << done[r].status();
    std::vector<float> got = out[r]->Download<float>();
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(BlockHolds(got.data() + k * n, k, n)) << "rank " << r;
  }
  // ReduceScatter: rank r's output is the sum of both ranks' block r.
  DoneRecorder rs[2];
  std::vector<std::unique_ptr<DeviceBuffer>> shard;
  for (int r = 0; r < 2; ++r) shard.push_back(std::make_unique<DeviceBuffer>(r, n * 4));
  RunRanks(2, [&](int r) {
    comm->ReduceScatter(out[r]->In(DType::kFloat32), shard[r]->Out(DType::kFloat32), ReduceOp::kSum,
                        Opts(r, 2), rs[r].Callback());
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(rs[r].Wait().ok()) << rs[r].status();
    std::vector<float> got = shard[r]->Download<float>();
    for (size_t i = 0; i < n; i += 997) ASSERT_EQ(got[i], 2 * ShardValue(r, i)) << i;
  }
}

TEST_P(NcclBackendTest, TwoGpusRefuseABufferOnAnotherRanksGpu) {
  if (gpus_ < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto comm = ConnectAllLocal(2);
  ASSERT_NE(comm, nullptr);
  DeviceBuffer b0(0, 64);
  DoneRecorder done[2];
  comm->Broadcast(b0.Out(DType::kFloat32), 0, Opts(0, 1), done[0].Callback());
  comm->Broadcast(b0.Out(DType::kFloat32), 0, Opts(1, 1), done[1].Callback());
  for (DoneRecorder& d : done) EXPECT_TRUE(absl::IsInvalidArgument(d.Wait())) << d.status();
  EXPECT_THAT(std::string(done[0].status().message()), HasSubstr("GPU 0 but rank 1 runs on GPU 1"));
}

TEST_P(NcclBackendTest, TwoGpusMismatchFailsBothRanksWithAborted) {
  if (gpus_ < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto comm = ConnectAllLocal(2);
  ASSERT_NE(comm, nullptr);
  DeviceBuffer in0(0, 64), out0(0, 128), in1(1, 64), out1(1, 128);
  DoneRecorder done[2];
  comm->AllGather(in0.In(DType::kFloat32), out0.Out(DType::kFloat32), Opts(0, 1),
                  done[0].Callback());
  comm->AllGather(in1.In(DType::kFloat32), out1.Out(DType::kFloat32), Opts(1, 1, 4),
                  done[1].Callback());
  for (DoneRecorder& d : done) {
    absl::Status s = d.Wait();
    EXPECT_TRUE(absl::IsAborted(s)) << s;
    EXPECT_EQ(s.message(),
              "collective mismatch at op_seq 1: rank 0 called AllGather(unit 3, 64 bytes, "
              "float32) but rank 1 called AllGather(unit 4, 64 bytes, float32)");
  }
}

TEST_P(NcclBackendTest, InitThatNeverCompletesFailsTheOpAtItsDeadline) {
  auto comm = ConnectHalf();
  ASSERT_NE(comm, nullptr);
  DeviceBuffer in(0, 64), out(0, 128);
  DoneRecorder done, later;
  comm->AllGather(in.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 1, 3, absl::Seconds(1)),
                  done.Callback());
  std::vector<PendingOpInfo> pending = comm->PendingOps();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_THAT(pending[0].arrived_ranks, ::testing::ElementsAre(0));
  absl::Status s = done.Wait(absl::Seconds(30));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("NCCL AllGather op_seq 1 (unit 3, 'test') did not complete within 1s"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("communicator aborted"));
  comm->AllGather(in.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 2), later.Callback());
  EXPECT_EQ(later.Wait(), s);
  const absl::Time start = absl::Now();
  comm.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_P(NcclBackendTest, AbortFailsPendingAndLaterOps) {
  auto comm = ConnectHalf();
  ASSERT_NE(comm, nullptr);
  DeviceBuffer in(0, 64), out(0, 128);
  DoneRecorder done, later;
  comm->AllGather(in.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 1), done.Callback());
  const absl::Status reason = absl::UnavailableError("peer daemon node-b is down");
  comm->Abort(reason);
  EXPECT_EQ(done.Wait(), reason);
  comm->AllGather(in.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 2), later.Callback());
  EXPECT_EQ(later.Wait(), reason);
  EXPECT_EQ(comm->status(), reason);
  const absl::Time start = absl::Now();
  comm.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_P(NcclBackendTest, DestroyingDuringInitFailsPendingOpsPromptly) {
  auto comm = ConnectHalf();
  ASSERT_NE(comm, nullptr);
  DeviceBuffer in(0, 64), out(0, 128);
  DoneRecorder done;
  comm->AllGather(in.In(DType::kFloat32), out.Out(DType::kFloat32), Opts(0, 1), done.Callback());
  const absl::Time start = absl::Now();
  comm.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(absl::IsAborted(done.Wait())) << done.status();
  EXPECT_EQ(done.calls(), 1);
}

}  // namespace
}  // namespace flatshard::collective::testing
