// GroupManager (GroupManagerHarness) on a GPU daemon whose device waits block until the test
// releases them: a Summon, EndSummon, FinishReduceScatter or Commit carrying the trainer's
// `written` event returns to its caller (a gRPC reactor thread in the daemon) at once, the manager
// stays responsive meanwhile (its mutex is not held across the wait), and the call completes once
// the device got past the event.

#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/gpu/device_context.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::Async;

// A simulated GPU (host shared memory, memcpy copies) whose host waits on its stream block
// while the gate is closed.
class GatedGpu : public gpu::DeviceContext {
 public:
  explicit GatedGpu(std::shared_ptr<gpu::DevicePool> pool)
      : DeviceContext(Gpu(), std::move(pool)) {}

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    absl::MutexLock lock(&mu_);
    ++syncs_;
    mu_.Await(absl::Condition(&open_));
    return absl::OkStatus();
  }
  absl::StatusOr<gpu::IpcEventRef> RecordReady() override {
    return gpu::IpcEventRef{1, std::string(gpu::kIpcHandleBytes, 'r'), "GATED-0"};
  }
  absl::Status WaitFor(const gpu::IpcEventRef&) override { return absl::OkStatus(); }
  // The trainer's event completes when the gate opens; a zero timeout only asks.
  absl::Status WaitOnHost(const gpu::IpcEventRef&, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (timeout == absl::ZeroDuration()) {
      return open_ ? absl::OkStatus() : absl::DeadlineExceededError("not yet");
    }
    ++syncs_;
    mu_.Await(absl::Condition(&open_));
    return absl::OkStatus();
  }

  void SetOpen(bool open) {
    absl::MutexLock lock(&mu_);
    open_ = open;
  }
  int syncs() {
    absl::MutexLock lock(&mu_);
    return syncs_;
  }

 private:
  static gpu::GpuDevice Gpu() {
    gpu::GpuDevice gpu;
    gpu.ordinal = 0;
    gpu.uuid = "GATED-0";
    gpu.name = "gated simulated GPU";
    return gpu;
  }

  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  int syncs_ ABSL_GUARDED_BY(mu_) = 0;
};

class GroupManagerDevicesTest : public testing::GroupManagerHarness {
 protected:
  GroupManagerDevicesTest() {
    model_ = testing::ExampleModel("gpt_tied");
    AddSimulatedGpus(1);
    gpu_ = std::make_shared<GatedGpu>(simulated_gpus_[0]->pool());
    gpus_ = {gpu_};
    Start();
  }
  ~GroupManagerDevicesTest() override {
    gpu_->SetOpen(true);
    Stop();
  }

  // Joins ranks [0, world) and registers the example model (zeros) on each.
  std::vector<Caller> JoinAndRegisterRanks(int world) {
    std::vector<RegisterResult> regs;
    std::vector<Caller> c = JoinAndRegister("g", world, &regs);
    for (RegisterResult& r : regs) {
      if (!r.shards.empty()) shards_.push_back(std::move(r.shards));
    }
    return c;
  }

  // True when `call` returns within 2 s while the gate is closed (it did not wait for the
  // device on the caller's thread). Otherwise the gate is opened so that it can finish.
  bool ReturnsAtOnce(absl::AnyInvocable<void()> call) {
    absl::Notification returned;
    std::thread t([&] {
      call();
      returned.Notify();
    });
    const bool ok = returned.WaitForNotificationWithTimeout(absl::Seconds(2));
    if (!ok) gpu_->SetOpen(true);
    t.join();
    return ok;
  }

  // True when the manager answers another call within a second (its mutex is free).
  bool Responsive() {
    absl::Notification answered;
    std::thread t([&] {
      (void)gm_->GetStats();
      (void)gm_->ListGroups();
      answered.Notify();
    });
    const bool ok = answered.WaitForNotificationWithTimeout(absl::Seconds(1));
    t.join();
    return ok;
  }

  static gpu::IpcEventRef Written(uint64_t id) {
    return gpu::IpcEventRef{id, std::string(gpu::kIpcHandleBytes, 'w'), "GATED-0"};
  }

  std::shared_ptr<GatedGpu> gpu_;
  std::vector<std::vector<UnitShard>> shards_;
};

TEST_F(GroupManagerDevicesTest, CallsWithATrainerEventNeverWaitOnTheCallersThread) {
  std::vector<Caller> c = JoinAndRegisterRanks(1);
  ASSERT_EQ(c.size(), 1u);
  ASSERT_EQ(shards_.size(), 1u);
  ASSERT_TRUE(shards_[0][0].shard->on_device());
  // The trainer "wrote" its shards: every element of unit 0 is 3.
  {
    const auto& shard = shards_[0][0].shard;
    std::vector<float> threes(static_cast<size_t>(shard->bytes()) / sizeof(float), 3.0f);
    std::memcpy(shard->data(), threes.data(), threes.size() * sizeof(float));
  }

  // Summon.
  gpu_->SetOpen(false);
  Async<absl::StatusOr<SummonResult>> summon;
  SummonOptions options;
  options.writeback = true;
  ASSERT_TRUE(ReturnsAtOnce([&] {
    gm_->Summon(c[0], "", "", options, Deadline(), summon.Callback(), Written(11));
  })) << "the summon waited for the device on the caller's thread";
  EXPECT_FALSE(summon.Done());
  EXPECT_TRUE(Responsive()) << "the manager's lock is held while a summon waits for a device";
  gpu_->SetOpen(true);
  absl::StatusOr<SummonResult>& s = summon.Wait();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_FALSE(s->views.empty());
  const auto& view = s->views[0].params;
  ASSERT_NE(view, nullptr);
  EXPECT_TRUE(view->on_device());
  // World 1: the view is a copy of the shard (made on the device's worker), padding aside.
  EXPECT_EQ(static_cast<const float*>(view->data())[0], 3.0f);
  EXPECT_GT(gpu_->syncs(), 0);

  // The trainer edits the view; the writeback End waits for its event off the caller's thread.
  static_cast<float*>(view->data())[0] = 7.0f;
  gpu_->SetOpen(false);
  Async<absl::Status> end;
  ASSERT_TRUE(ReturnsAtOnce(
      [&] { gm_->EndSummon(c[0], s->summon, Deadline(), end.Callback(), Written(12)); }));
  EXPECT_FALSE(end.Done());
  EXPECT_TRUE(Responsive());
  gpu_->SetOpen(true);
  ASSERT_TRUE(end.Wait().ok()) << end.Wait();
  EXPECT_EQ(static_cast<const float*>(shards_[0][0].shard->data())[0], 7.0f)
      << "the writeback reached the shard";

  // Commit.
  gpu_->SetOpen(false);
  Async<absl::StatusOr<uint64_t>> commit;
  ASSERT_TRUE(
      ReturnsAtOnce([&] { gm_->Commit(c[0], "", Deadline(), commit.Callback(), Written(13)); }));
  EXPECT_FALSE(commit.Done());
  EXPECT_TRUE(Responsive());
  gpu_->SetOpen(true);
  absl::StatusOr<uint64_t>& generation = commit.Wait();
  ASSERT_TRUE(generation.ok()) << generation.status();
  EXPECT_EQ(*generation, 2u) << "the writeback End committed generation 1, this Commit 2";
}

TEST_F(GroupManagerDevicesTest, ReduceScatterWaitsForTheGradientOffTheCallersThread) {
  std::vector<Caller> c = JoinAndRegisterRanks(2);
  ASSERT_EQ(c.size(), 2u);
  std::vector<std::shared_ptr<Buffer>> full;
  for (const Caller& caller : c) {
    absl::StatusOr<std::shared_ptr<Buffer>> b = gm_->BeginReduceScatter(caller, "", 0);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE((*b)->on_device());
    std::vector<float> ones(static_cast<size_t>((*b)->bytes()) / sizeof(float),
                            1.0f + static_cast<float>(caller.rank));
    std::memcpy((*b)->data(), ones.data(), ones.size() * sizeof(float));
    full.push_back(*b);
  }
  gpu_->SetOpen(false);
  std::vector<std::unique_ptr<Async<absl::Status>>> finishes;
  for (const Caller& caller : c) {
    finishes.push_back(std::make_unique<Async<absl::Status>>());
    ASSERT_TRUE(ReturnsAtOnce([&] {
      gm_->FinishReduceScatter(caller, "", 0, ReduceOp::kSum, false, Deadline(),
                               finishes.back()->Callback(), Written(20 + caller.rank));
    }));
    EXPECT_FALSE(finishes.back()->Done());
  }
  EXPECT_TRUE(Responsive());
  gpu_->SetOpen(true);
  for (auto& f : finishes) ASSERT_TRUE(f->Wait().ok()) << f->Wait();
  // Each rank's gradient shard holds the sum of both ranks' gradients: 1 + 2.
  absl::StatusOr<RegisterResult> mine = gm_->GetShards(c[1], "");
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_NE(mine->shards[0].grad, nullptr);
  EXPECT_EQ(static_cast<const float*>(mine->shards[0].grad->data())[0], 3.0f);
}

}  // namespace
}  // namespace flatshard::server
