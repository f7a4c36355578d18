// RankDevices: host placement and copies; device placement and copies through simulated GPUs
// (as flatshardd --simulate_gpus builds them); host waits on a device never run on the
// caller's thread.

#include "server/rank_devices.h"

#include <unistd.h>
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/gpu/simulated_stream.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/gpu/device_context.h"
#include "server/shard_store.h"
#include "tests/testing/files.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

std::string Prefix(absl::string_view what) { return absl::StrCat("fsrdt", what, getpid()); }

// A GPU whose host waits block until the test lets them go (Release), and fail when asked to.
// Copies are memcpy (its "device memory" is host memory).
class GatedDevice : public gpu::DeviceContext {
 public:
  explicit GatedDevice(int ordinal) : DeviceContext(Gpu(ordinal), nullptr) {}

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    absl::MutexLock lock(&mu_);
    sync_threads_.push_back(std::this_thread::get_id());
    mu_.Await(absl::Condition(&released_));
    return sync_error_;
  }
  absl::StatusOr<gpu::IpcEventRef> RecordReady() override {
    return gpu::IpcEventRef{7, std::string(64, 'r'), "GATED"};
  }
  absl::Status WaitFor(const gpu::IpcEventRef& event) override {
    absl::MutexLock lock(&mu_);
    waited_for_.push_back(event.id);
    return event.id == 13 ? absl::InvalidArgumentError("bad handle") : absl::OkStatus();
  }
  // The trainer's event completes when the test releases the gate; a zero timeout only asks.
  absl::Status WaitOnHost(const gpu::IpcEventRef& event, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (timeout == absl::ZeroDuration()) {
      waited_for_.push_back(event.id);
      if (event.id == 13) return absl::InvalidArgumentError("bad handle");
      return released_ ? sync_error_ : absl::DeadlineExceededError("not yet");
    }
    sync_threads_.push_back(std::this_thread::get_id());
    mu_.Await(absl::Condition(&released_));
    return sync_error_;
  }

  void Release(absl::Status error = absl::OkStatus()) {
    absl::MutexLock lock(&mu_);
    sync_error_ = std::move(error);
    released_ = true;
  }
  std::vector<std::thread::id> sync_threads() {
    absl::MutexLock lock(&mu_);
    return sync_threads_;
  }
  std::vector<uint64_t> waited_for() {
    absl::MutexLock lock(&mu_);
    return waited_for_;
  }

 private:
  static gpu::GpuDevice Gpu(int ordinal) {
    gpu::GpuDevice gpu;
    gpu.ordinal = ordinal;
    gpu.uuid = absl::StrCat("GATED-", ordinal);
    gpu.name = "gated";
    return gpu;
  }

  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status sync_error_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread::id> sync_threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> waited_for_ ABSL_GUARDED_BY(mu_);
};

// The example model planned over `world` ranks.
Plan ExamplePlan(int32_t world) {
  absl::StatusOr<Manifest> manifest =
      ManifestFromJson(testing::ExampleModelFile("gpt_tied", "manifest"));
  absl::StatusOr<Policy> policy = PolicyFromJson(testing::ExampleModelFile("gpt_tied", "policy"));
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_TRUE(policy.ok()) << policy.status();
  absl::StatusOr<Plan> plan = BuildPlan(*manifest, *policy, PlanOptions{.world_size = world});
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

void Fill(Buffer& b, float first) {
  std::vector<float> v(static_cast<size_t>(b.bytes()) / sizeof(float));
  std::iota(v.begin(), v.end(), first);
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
}

std::vector<float> Floats(const Buffer& b) {
  std::vector<float> v(static_cast<size_t>(b.bytes()) / sizeof(float));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(float));
  return v;
}

TEST(RankDevicesHostTest, HostRanksLiveInHostMemory) {
  RankDevices devices({});
  EXPECT_FALSE(devices.has_gpus());
  for (int32_t rank : {0, 1, 7, 1 << 20}) {
    EXPECT_EQ(devices.DeviceOf(rank), nullptr);
    EXPECT_EQ(devices.PlacementOf(rank), Placement::Host());
    EXPECT_EQ(devices.RecordReady(rank).id, 0u);
  }
}

TEST(RankDevicesHostTest, WaitsAndBlockingWorkRunInlineOnHostRanks) {
  RankDevices devices({});
  // A host rank has no device to wait for, whatever event the trainer sent.
  bool called = false;
  const std::thread::id caller = std::this_thread::get_id();
  devices.AfterTrainerWrites(3, gpu::IpcEventRef{42, "x", "y"}, [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(std::this_thread::get_id(), caller);
    called = true;
  });
  EXPECT_TRUE(called) << "a host rank's wait must complete before the call returns";
  std::thread::id ran_on;
  absl::Status got = absl::UnknownError("not called");
  devices.RunBlocking(
      1,
      [&] {
        ran_on = std::this_thread::get_id();
        return absl::DataLossError("from work");
      },
      [&](absl::Status s) { got = std::move(s); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(got.code(), absl::StatusCode::kDataLoss);
}

TEST(RankDevicesHostTest, CopiesOnHostRanks) {
  ShardStore store(ShardStoreOptions{.segment_prefix = Prefix("h")});
  RankDevices devices({});
  const Plan plan = ExamplePlan(2);
  const PlanUnit& unit = plan.units[0];
  const int64_t item = ItemSize(unit.dtype);
  ASSERT_EQ(item, static_cast<int64_t>(sizeof(float)));
  auto full = *store.Allocate(BufferKind::kUnsharded, unit.padded_numel * item, "full", -1,
                              Placement::Host());
  Fill(*full, 1.0f);
  for (int32_t r = 0; r < 2; ++r) {
    auto shard = *store.Allocate(BufferKind::kShard, unit.shard_numel * item, "shard", -1,
                                 Placement::Host());
    Fill(*shard, -1000.0f);
    ASSERT_TRUE(devices.CopyOwnRange(r, plan, unit, r, *full, *shard).ok());
    // The unpadded part of rank r's range comes from `full`; its padding stays untouched.
    const std::vector<float> got = Floats(*shard);
    const std::vector<float> all = Floats(*full);
    const int64_t begin = r * unit.shard_numel;
    for (int64_t i = 0; i < unit.shard_numel; ++i) {
      if (begin + i < unit.numel) {
        ASSERT_EQ(got[i], all[begin + i]) << "rank " << r << " element " << i;
      } else {
        ASSERT_EQ(got[i], -1000.0f + static_cast<float>(i)) << "padding of rank " << r;
      }
    }
  }

  // ApplyReducedGrad: replaced, then accumulated.
  auto grad =
      *store.Allocate(BufferKind::kGradShard, 4 * sizeof(float), "grad", -1, Placement::Host());
  std::vector<float> reduced = {1, 2, 3, 4};
  collective::ConstBuffer in{reduced.data(), reduced.size() * sizeof(float), DType::kFloat32};
  ASSERT_TRUE(devices.ApplyReducedGrad(0, in, *grad, DType::kFloat32, false).ok());
  EXPECT_THAT(Floats(*grad), ::testing::ElementsAre(1, 2, 3, 4));
  ASSERT_TRUE(devices.ApplyReducedGrad(0, in, *grad, DType::kFloat32, true).ok());
  EXPECT_THAT(Floats(*grad), ::testing::ElementsAre(2, 4, 6, 8));

  // CopyEach: index by index, nulls skipped, a size mismatch refused naming the rank.
  auto a = *store.Allocate(BufferKind::kShard, 8, "a", -1, Placement::Host());
  auto b = *store.Allocate(BufferKind::kShard, 8, "b", -1, Placement::Host());
  auto c = *store.Allocate(BufferKind::kShard, 16, "c", -1, Placement::Host());
  std::memcpy(a->data(), "abcdefgh", 8);
  ASSERT_TRUE(devices.CopyEach(5, {a.get(), nullptr}, {b.get(), c.get()}).ok());
  EXPECT_EQ(std::memcmp(b->data(), "abcdefgh", 8), 0);
  absl::Status mismatch = devices.CopyEach(5, {a.get()}, {c.get()});
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(mismatch.message(), HasSubstr("rank 5"));
}

class RankDevicesSimulatedTest : public ::testing::Test {
 protected:
  RankDevicesSimulatedTest() {
    ShardStoreOptions options{.segment_prefix = Prefix("s")};
    options.pin_host_memory = false;
    for (int i = 0; i < 2; ++i) {
      auto d = gpu::DeviceContext::CreateSimulated(i, gpu::DevicePoolOptions{}, Prefix("g"));
      EXPECT_TRUE(d.ok()) << d.status();
      gpus_.push_back(*std::move(d));
      options.device_pools.push_back(gpus_.back()->pool());
    }
    store_ = std::make_unique<ShardStore>(options);
  }

  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  std::unique_ptr<ShardStore> store_;
};

TEST_F(RankDevicesSimulatedTest, RanksAreSpreadOverTheGpus) {
  RankDevices devices(gpus_);
  EXPECT_TRUE(devices.has_gpus());
  EXPECT_EQ(devices.DeviceOf(0), gpus_[0].get());
  EXPECT_EQ(devices.DeviceOf(1), gpus_[1].get());
  EXPECT_EQ(devices.DeviceOf(2), gpus_[0].get());
  EXPECT_EQ(devices.PlacementOf(3), Placement::Device(1));
  EXPECT_EQ(devices.PlacementOf(4), Placement::Device(0));
  EXPECT_NE(devices.RecordReady(1).id, 0u);
}

TEST_F(RankDevicesSimulatedTest, DeviceCopiesRunOffTheCallersThread) {
  RankDevices devices(gpus_);
  const Plan plan = ExamplePlan(2);
  const PlanUnit& unit = plan.units[0];
  const int64_t item = ItemSize(unit.dtype);
  auto full = *store_->Allocate(BufferKind::kUnsharded, unit.padded_numel * item, "full", -1,
                                devices.PlacementOf(1));
  auto shard = *store_->Allocate(BufferKind::kShard, unit.shard_numel * item, "shard", -1,
                                 devices.PlacementOf(1));
  ASSERT_TRUE(full->on_device());
  ASSERT_EQ(full->placement().device, 1);
  Fill(*full, 5.0f);
  absl::Notification done;
  std::thread::id ran_on;
  absl::Status got;
  devices.RunBlocking(
      1,
      [&] {
        ran_on = std::this_thread::get_id();
        return devices.CopyOwnRange(1, plan, unit, 1, *full, *shard);
      },
      [&](absl::Status s) {
        got = std::move(s);
        done.Notify();
      });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(got.ok()) << got;
  EXPECT_NE(ran_on, std::this_thread::get_id());
  const std::vector<float> all = Floats(*full);
  const std::vector<float> mine = Floats(*shard);
  const int64_t own = std::min(unit.shard_numel, unit.numel - unit.shard_numel);
  ASSERT_GT(own, 0);
  for (int64_t i = 0; i < own; ++i) ASSERT_EQ(mine[i], all[unit.shard_numel + i]);

  // A simulated GPU refuses a malformed trainer event; the error names the rank.
  absl::Status bad = absl::UnknownError("not called");
  devices.AfterTrainerWrites(0, gpu::IpcEventRef{9, "short", "SIM-GPU-0"},
                             [&](absl::Status s) { bad = std::move(s); });
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("rank 0"));
}

// Device-side ordering on a simulated GPU (asynchronous stream): the copy waits on the
// daemon's stream for the trainer's writes still queued on the trainer's (delayed) stream, no
// host wait, and the ready event recorded after it completes once the copy ran.
TEST_F(RankDevicesSimulatedTest, DeviceOrderedCopyWaitsForTheTrainersQueuedWrites) {
  RankDevices devices(gpus_, /*device_ordering=*/true);
  ASSERT_TRUE(devices.device_ordering());
  auto shard = *store_->Allocate(BufferKind::kShard, 4096, "shard", -1, devices.PlacementOf(0));
  auto view = *store_->Allocate(BufferKind::kUnsharded, 4096, "view", -1, devices.PlacementOf(0));
  Fill(*shard, 1.0f);
  // The trainer: a write of 2.0 queued on its stream (held back), then its event.
  gpu::SimulatedStream trainer("trainer");
  trainer.set_delay(absl::Milliseconds(50));
  std::vector<float> twos(1024, 2.0f);
  trainer.EnqueueCopy(shard->data(), twos.data(), 4096);
  std::shared_ptr<gpu::SimulatedEvent> written = *gpu::SimulatedEvent::Create(Prefix("e"));
  trainer.EnqueueRecord(written);
  ASSERT_TRUE(devices.OrderOnDevice(0, gpu::IpcEventRef{3, written->handle(), "SIM-GPU-0"}).ok());
  ASSERT_TRUE(devices.CopyAsync(0, view->data(), shard->data(), 4096).ok());
  const gpu::IpcEventRef ready = devices.RecordReady(0);
  std::shared_ptr<gpu::SimulatedEvent> opened = *gpu::SimulatedEvent::Open(ready.ipc_handle);
  ASSERT_TRUE(opened->WaitOnHost(opened->recorded(), absl::Minutes(1), "ready").ok());
  for (float f : Floats(*view)) ASSERT_EQ(f, 2.0f);
  ASSERT_TRUE(devices.CheckStream(0).ok());
  ASSERT_TRUE(trainer.Synchronize(absl::Minutes(1)).ok());
}

// An error of device-ordered work after its answer (here: the stream's wait for a trainer's
// event that does not complete in time) is not lost: the rank's next operations fail with it,
// and waiters on the ready event recorded after it fail instead of hanging.
TEST_F(RankDevicesSimulatedTest, AnErrorAfterTheAnswerFailsTheNextOperation) {
  gpus_[1]->set_sync_timeout(absl::Milliseconds(20));
  RankDevices devices(gpus_, /*device_ordering=*/true);
  gpu::SimulatedStream trainer("trainer");
  trainer.set_delay(absl::Hours(1));  // never reached: cut short when `trainer` goes
  std::shared_ptr<gpu::SimulatedEvent> written = *gpu::SimulatedEvent::Create(Prefix("e"));
  trainer.EnqueueRecord(written);
  auto a = *store_->Allocate(BufferKind::kShard, 64, "a", -1, devices.PlacementOf(1));
  auto b = *store_->Allocate(BufferKind::kShard, 64, "b", -1, devices.PlacementOf(1));
  ASSERT_TRUE(devices.OrderOnDevice(1, gpu::IpcEventRef{4, written->handle(), "SIM-GPU-1"}).ok());
  ASSERT_TRUE(devices.CopyAsync(1, b->data(), a->data(), 64).ok());
  const gpu::IpcEventRef ready = devices.RecordReady(1);
  std::shared_ptr<gpu::SimulatedEvent> opened = *gpu::SimulatedEvent::Open(ready.ipc_handle);
  absl::Status waited = opened->WaitOnHost(opened->recorded(), absl::Minutes(1), "ready");
  EXPECT_EQ(waited.code(), absl::StatusCode::kInternal) << waited;
  absl::Status next = devices.CheckStream(1);
  EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(next.message(), HasSubstr("rank 1: work on GPU 1"));
  EXPECT_THAT(next.message(), HasSubstr("answered already failed"));
  EXPECT_THAT(next.message(), HasSubstr("did not complete within"));
  absl::Status after = absl::UnknownError("not called");
  devices.AfterTrainerWrites(1, gpu::IpcEventRef{5, written->handle(), "SIM-GPU-1"},
                             [&](absl::Status s) { after = std::move(s); });
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(devices.OrderOnDevice(1, gpu::IpcEventRef{}).code(),
            absl::StatusCode::kFailedPrecondition);
  // The other GPU is untouched.
  EXPECT_TRUE(devices.CheckStream(0).ok());
}

TEST(RankDevicesGatedTest, TheHostWaitForATrainerNeverBlocksTheCaller) {
  auto gated = std::make_shared<GatedDevice>(0);
  RankDevices devices({gated});
  absl::Notification done;
  absl::Status got = absl::UnknownError("not called");
  devices.AfterTrainerWrites(2, gpu::IpcEventRef{5, "h", "GATED"}, [&](absl::Status s) {
    got = std::move(s);
    done.Notify();
  });
  // The call returned although the device has not got past the event.
  EXPECT_FALSE(done.HasBeenNotified());
  EXPECT_THAT(gated->waited_for(), ::testing::ElementsAre(5));
  gated->Release(absl::DeadlineExceededError("not done within 2m"));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(got.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.message(), HasSubstr("rank 2"));
  EXPECT_THAT(got.message(), HasSubstr("event 5"));
  ASSERT_EQ(gated->sync_threads().size(), 1u);
  EXPECT_NE(gated->sync_threads()[0], std::this_thread::get_id());

  // No event: nothing to wait for, inline. A stream-side refusal: inline, naming the rank.
  bool inline_done = false;
  devices.AfterTrainerWrites(0, {}, [&](absl::Status s) { inline_done = s.ok(); });
  EXPECT_TRUE(inline_done);
  absl::Status refused;
  devices.AfterTrainerWrites(1, gpu::IpcEventRef{13, "h", "GATED"},
                             [&](absl::Status s) { refused = std::move(s); });
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("rank 1"));
}

TEST(RankDevicesGatedTest, StopRunsQueuedWorkThenRunsInline) {
  auto gated = std::make_shared<GatedDevice>(0);
  auto devices =
      std::make_unique<RankDevices>(std::vector<std::shared_ptr<gpu::DeviceContext>>{gated});
  std::atomic<int> completed{0};
  for (int i = 0; i < 3; ++i) {
    devices->AfterTrainerWrites(0, gpu::IpcEventRef{static_cast<uint64_t>(100 + i), "h", "G"},
                                [&](absl::Status s) {
                                  EXPECT_TRUE(s.ok()) << s;
                                  ++completed;
                                });
  }
  EXPECT_EQ(completed.load(), 0);
  std::thread stopper([&] { devices->Stop(); });
  gated->Release();
  stopper.join();
  EXPECT_EQ(completed.load(), 3) << "every queued wait's callback runs exactly once";
  // After Stop, blocking work runs on the caller.
  std::thread::id ran_on;
  devices->RunBlocking(
      0,
      [&] {
        ran_on = std::this_thread::get_id();
        return absl::OkStatus();
      },
      [&](absl::Status s) { EXPECT_TRUE(s.ok()); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  devices.reset();
}

}  // namespace
}  // namespace flatshard::server
