#include "client/cuda_events.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_gpu.h"

namespace flatshard::client::internal {
namespace {

using ::testing::ElementsAre;
using testing::FakeCudaEventApi;
using testing::FakeGpuLog;
using ::testing::HasSubstr;

void* const kStream = reinterpret_cast<void*>(0x5000);

IpcEvent DaemonEvent(uint64_t id, const std::string& handle_text,
                     const std::string& uuid = "GPU-fake-0") {
  return IpcEvent{id, FakeCudaEventApi::Handle(handle_text), uuid};
}

class StreamEventsTest : public ::testing::Test {
 protected:
  std::shared_ptr<FakeGpuLog> log_ = std::make_shared<FakeGpuLog>();
  std::unique_ptr<StreamEvents> events_ =
      std::make_unique<StreamEvents>(std::make_unique<FakeCudaEventApi>(log_));
};

TEST_F(StreamEventsTest, CreatesOneEventPerDeviceAndRecordsItPerCall) {
  absl::StatusOr<IpcEvent> a = events_->RecordWritten(1, kStream);
  absl::StatusOr<IpcEvent> b = events_->RecordWritten(1, kStream);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_NE(a->id, 0u);
  EXPECT_EQ(a->id, b->id);
  EXPECT_EQ(a->ipc_handle, b->ipc_handle);
  EXPECT_EQ(a->ipc_handle.size(), 64u);
  EXPECT_EQ(a->device_uuid, "GPU-fake-1");
  absl::StatusOr<IpcEvent> other = events_->RecordWritten(0, kStream);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->id, a->id);  // ids are unique per process
  EXPECT_EQ(events_->created_events(), 2);
  EXPECT_THAT(log_->Calls(),
              ElementsAre("DeviceUuid(1)", "Create(1)=1", "Record(1, stream 20480, 1)",
                          "Record(1, stream 20480, 1)", "DeviceUuid(0)", "Create(0)=2",
                          "Record(2, stream 20480, 0)"));
  events_.reset();  // destroys its own events
  EXPECT_THAT(log_->Calls(), ::testing::IsSupersetOf({"Destroy(1, 1)", "Destroy(2, 0)"}));
}

TEST_F(StreamEventsTest, OpensADaemonEventOncePerIdAndWaitsEveryTime) {
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(events_->WaitReady(DaemonEvent(7, "d7"), kStream).ok());
  }
  EXPECT_EQ(events_->opened_events(), 1);
  EXPECT_THAT(log_->Calls(), ElementsAre("DeviceForUuid(GPU-fake-0)", "OpenEvent(d7, 0)=1",
                                         "Wait(stream 20480, 1, 0)", "Wait(stream 20480, 1, 0)",
                                         "Wait(stream 20480, 1, 0)"));
}

TEST_F(StreamEventsTest, AnIdWithANewHandleReplacesTheCachedEvent) {
  ASSERT_TRUE(events_->WaitReady(DaemonEvent(7, "d7"), kStream).ok());
  ASSERT_TRUE(events_->WaitReady(DaemonEvent(7, "d7-new"), kStream).ok());
  ASSERT_TRUE(events_->WaitReady(DaemonEvent(7, "d7-new"), kStream).ok());
  EXPECT_EQ(events_->opened_events(), 2);
  const std::vector<std::string> calls = log_->Calls();
  EXPECT_THAT(calls, ElementsAre("DeviceForUuid(GPU-fake-0)", "OpenEvent(d7, 0)=1",
                                 "Wait(stream 20480, 1, 0)", "DeviceForUuid(GPU-fake-0)",
                                 "OpenEvent(d7-new, 0)=2", "Destroy(1, 0)",
                                 "Wait(stream 20480, 2, 0)", "Wait(stream 20480, 2, 0)"));
}

TEST_F(StreamEventsTest, ForgetOpenedReopensButKeepsOwnEvents) {
  ASSERT_TRUE(events_->RecordWritten(0, kStream).ok());
  ASSERT_TRUE(events_->WaitReady(DaemonEvent(3, "d3"), kStream).ok());
  events_->ForgetOpened();
  ASSERT_TRUE(events_->WaitReady(DaemonEvent(3, "d3"), kStream).ok());
  ASSERT_TRUE(events_->RecordWritten(0, kStream).ok());
  EXPECT_EQ(events_->opened_events(), 2);
  EXPECT_EQ(events_->created_events(), 1);
}

TEST_F(StreamEventsTest, NoEventIdMeansNoCudaCall) {
  EXPECT_TRUE(events_->WaitReady(IpcEvent{}, kStream).ok());
  EXPECT_EQ(log_->total_calls(), 0);
}

TEST_F(StreamEventsTest, ErrorsNameTheEventAndGpu) {
  absl::Status s = events_->WaitReady(IpcEvent{9, "short", "GPU-fake-0"}, kStream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("ready event 9 on GPU GPU-fake-0"));
  EXPECT_THAT(s.message(), HasSubstr("wrong size: 5 bytes, want 64"));

  s = events_->WaitReady(DaemonEvent(9, "d9", "GPU-elsewhere"), kStream);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("ready event 9 on GPU GPU-elsewhere"));
  EXPECT_EQ(events_->opened_events(), 0);

  absl::StatusOr<IpcEvent> w = events_->RecordWritten(5, kStream);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr("the trainer's event on device 5"));
  EXPECT_EQ(events_->created_events(), 0);
}

// The real CUDA runtime here (no GPU, or built without CUDA): clean errors, no crash.
TEST(RealStreamEventsTest, FailsCleanlyWithoutAUsableGpu) {
  StreamEvents events;
  absl::Status s = events.WaitReady(
      IpcEvent{1, std::string(64, '\1'), "GPU-00000000-0000-0000-0000-000000000000"}, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.code(),
              ::testing::AnyOf(absl::StatusCode::kFailedPrecondition, absl::StatusCode::kNotFound));
  EXPECT_THAT(s.message(), HasSubstr("ready event 1 on GPU GPU-00000000"));
}

}  // namespace
}  // namespace flatshard::client::internal
