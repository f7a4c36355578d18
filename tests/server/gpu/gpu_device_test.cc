// Needs a GPU (CTest label gpu); every test skips when ListGpus() fails. Covers
// MakeCudaSlabAllocator + DevicePool, DeviceContext (copies both ways, ready event, waiting for
// an interprocess event of another process) and MakeCudaDeviceCopier.

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "common/gpu/cuda_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_backend.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/gpu/device_context.h"
#include "server/gpu/device_pool.h"
#include "tests/testing/rank_group.h"

namespace flatshard::gpu {
namespace {

using ::testing::HasSubstr;

// The first GPU, or skips the test.
#define FS_GPU_OR_SKIP(gpu)                                      \
  absl::StatusOr<std::vector<GpuDevice>> gpus_ = ListGpus();     \
  if (!gpus_.ok()) GTEST_SKIP() << "no GPU: " << gpus_.status(); \
  const GpuDevice gpu = gpus_->front()

TEST(GpuDeviceTest, CudaSlabAllocatorBlocksAreZeroedAndExportable) {
  FS_GPU_OR_SKIP(gpu);
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  DeviceContext& c = **ctx;
  EXPECT_EQ(c.device(), gpu.ordinal);
  EXPECT_EQ(c.uuid(), gpu.uuid);
  EXPECT_NE(c.stream(), nullptr);
  auto block = c.pool()->Allocate(1 << 20, "test");
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ((*block)->ipc_handle().size(), kIpcHandleBytes);
  EXPECT_EQ((*block)->device_uuid(), gpu.uuid);
  std::vector<uint8_t> host(1 << 20, 0xff);
  ASSERT_TRUE(c.Copy(host.data(), (*block)->data(), host.size()).ok());
  for (uint8_t b : host) ASSERT_EQ(b, 0);
  EXPECT_GE(c.pool()->Usage().reserved_bytes, 1 << 20);
}

TEST(GpuDeviceTest, CopiesBothWaysAndDeviceToDevice) {
  FS_GPU_OR_SKIP(gpu);
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  DeviceContext& c = **ctx;
  constexpr size_t kBytes = (4 << 20) + 3;
  auto a = c.pool()->Allocate(kBytes, "a");
  auto b = c.pool()->Allocate(kBytes, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  ASSERT_TRUE(c.Copy((*a)->data(), src.data(), kBytes).ok());    // pageable host -> device
  ASSERT_TRUE(c.Copy((*b)->data(), (*a)->data(), kBytes).ok());  // device -> device
  ASSERT_TRUE(PinHostMemory(dst.data(), kBytes).ok());
  ASSERT_TRUE(c.Copy(dst.data(), (*b)->data(), kBytes).ok());  // device -> pinned host
  UnpinHostMemory(dst.data());
  EXPECT_EQ(src, dst);
  EXPECT_TRUE(c.Synchronize().ok());
}

TEST(GpuDeviceTest, ReadyEventIsOneInterprocessEventRecordedAgainAndAgain) {
  FS_GPU_OR_SKIP(gpu);
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  absl::StatusOr<IpcEventRef> first = (*ctx)->RecordReady();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_NE(first->id, 0u);
  EXPECT_EQ(first->ipc_handle.size(), kIpcHandleBytes);
  EXPECT_EQ(first->device_uuid, gpu.uuid);
  absl::StatusOr<IpcEventRef> second = (*ctx)->RecordReady();
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->id, first->id);
  EXPECT_EQ(second->ipc_handle, first->ipc_handle);
  EXPECT_TRUE((*ctx)->Synchronize().ok());
}

TEST(GpuDeviceTest, WaitForRejectsMalformedEventsNamingTheField) {
  FS_GPU_OR_SKIP(gpu);
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  absl::Status none = (*ctx)->WaitFor(IpcEventRef{});
  EXPECT_TRUE(absl::IsInvalidArgument(none)) << none;
  IpcEventRef short_handle{7, "abc", gpu.uuid};
  absl::Status s = (*ctx)->WaitFor(short_handle);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("ipc_handle has 3 bytes"));
}

TEST(GpuDeviceTest, CudaDeviceCopierRoundTripsThroughPinnedAndDeviceStaging) {
  FS_GPU_OR_SKIP(gpu);
  using collective::MemoryKind;
  std::shared_ptr<collective::DeviceCopier> copier = collective::MakeCudaDeviceCopier();
  constexpr size_t kBytes = 1 << 20;
  auto pinned = copier->AllocateStaging(MemoryKind::kHostPinned, gpu.ordinal, kBytes);
  auto device = copier->AllocateStaging(MemoryKind::kCuda, gpu.ordinal, kBytes);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_TRUE(device.ok()) << device.status();
  std::vector<uint8_t> src(kBytes), back(kBytes, 0);
  std::iota(src.begin(), src.end(), 0);
  ASSERT_TRUE(copier
                  ->Copy(pinned->get(), MemoryKind::kHostPinned, src.data(), MemoryKind::kHost,
                         kBytes, gpu.ordinal)
                  .ok());
  ASSERT_TRUE(copier
                  ->Copy(device->get(), MemoryKind::kCuda, pinned->get(), MemoryKind::kHostPinned,
                         kBytes, gpu.ordinal)
                  .ok());
  ASSERT_TRUE(copier
                  ->Copy(back.data(), MemoryKind::kHost, device->get(), MemoryKind::kCuda, kBytes,
                         gpu.ordinal)
                  .ok());
  EXPECT_EQ(src, back);
}

TEST(GpuDeviceTest, StagingCommunicatorAllGathersDeviceBuffersOverInproc) {
  FS_GPU_OR_SKIP(gpu);
  using namespace collective;  // NOLINT: test brevity
  constexpr int kWorld = 2;
  constexpr size_t kShard = 4096;
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  GroupSpec spec = GroupSpec::AllLocal("gpu-staging", kWorld);
  spec.local_devices = {gpu.ordinal, gpu.ordinal};
  auto backend = CreateInprocBackend();
  ASSERT_TRUE(backend.ok());
  auto inner = (*backend)->Connect(spec);
  ASSERT_TRUE(inner.ok());
  std::unique_ptr<Communicator> comm =
      MakeStagingCommunicator(*std::move(inner), MemoryKind::kHost, spec, MakeCudaDeviceCopier());
  std::vector<std::shared_ptr<DeviceBlock>> in, out;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<uint8_t> shard(kShard, static_cast<uint8_t>(r + 1));
    auto i = (*ctx)->pool()->Allocate(kShard, "in");
    auto o = (*ctx)->pool()->Allocate(kShard * kWorld, "out");
    ASSERT_TRUE(i.ok() && o.ok());
    ASSERT_TRUE((*ctx)->Copy((*i)->data(), shard.data(), kShard).ok());
    in.push_back(*i);
    out.push_back(*o);
  }
  std::vector<::flatshard::testing::DoneRecorder> done(kWorld);
  ::flatshard::testing::RunRanks(kWorld, [&](int r) {
    OpOptions o;
    o.rank = r;
    o.op_seq = 1;
    o.deadline = absl::Now() + absl::Seconds(30);
    comm->AllGather(
        ConstBuffer{in[r]->data(), kShard, DType::kUInt8, MemoryKind::kCuda},
        MutableBuffer{out[r]->data(), kShard * kWorld, DType::kUInt8, MemoryKind::kCuda}, o,
        done[r].Callback());
    EXPECT_TRUE(done[r].Wait().ok()) << done[r].status();
  });
  for (int r = 0; r < kWorld; ++r) {
    std::vector<uint8_t> host(kShard * kWorld);
    ASSERT_TRUE((*ctx)->Copy(host.data(), out[r]->data(), host.size()).ok());
    for (size_t i = 0; i < host.size(); ++i) {
      ASSERT_EQ(host[i], i / kShard + 1) << "rank " << r << " byte " << i;
    }
  }
}

TEST(GpuDeviceTest, WithoutAGpuEverythingFailsWithFailedPrecondition) {
  if (ListGpus().ok()) GTEST_SKIP() << "a GPU is present";
  GpuDevice gpu;
  gpu.ordinal = 0;
  absl::StatusOr<std::unique_ptr<DeviceContext>> ctx = DeviceContext::Create(gpu, {});
  EXPECT_TRUE(absl::IsFailedPrecondition(ctx.status())) << ctx.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(MakeCudaSlabAllocator(0).status()));
}

}  // namespace
}  // namespace flatshard::gpu
