// WeightsServiceImpl (server/service/weights_service_impl.h) over real gRPC (loopback TCP),
// with a real Publisher and ShardStore: the end of an OpenWeights stream, by the reader's
// cancel or by the publisher's Shutdown, releases its lease on the request workers, never on
// the thread that ended the stream, because the release may free the version (an munmap of
// up to GiBs). The only worker is held by the test, so the release waits in its queue while
// the stream's end has fully run: no timing, each wait below is for an event that must come.

#include "server/service/weights_service_impl.h"

#include <unistd.h>

#include <chrono>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "flatshard/v1/weights_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/publish/publisher.h"
#include "server/service/request_workers.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBytes = int64_t{1} << 20;

class WeightsServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ShardStoreOptions store_options;
    store_options.segment_prefix = absl::StrCat("fswst", ::getpid());
    store_ = std::make_unique<ShardStore>(store_options);
    PublisherOptions publisher_options;
    publisher_options.store = store_.get();
    publisher_ = std::make_unique<Publisher>(publisher_options);
    workers_ = std::make_unique<RequestWorkers>(1);
    service_ = std::make_unique<WeightsServiceImpl>(publisher_.get(), workers_.get(),
                                                    /*access=*/nullptr, absl::Seconds(30));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::WeightsService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    // Version 1 of "gpt" of remote callers (uid -1: every caller's without access control).
    absl::StatusOr<std::shared_ptr<Buffer>> buffer =
        store_->Allocate(BufferKind::kStaging, kBytes, "weights gpt 1");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    CopiedVersion copy;
    copy.info.name = "gpt";
    copy.info.owner_uid = -1;
    copy.info.version = 1;
    copy.info.bytes = kBytes;
    copy.buffer = *std::move(buffer);
    copy.layout.bytes = kBytes;
    ASSERT_TRUE(publisher_->AddCopy(std::move(copy)).ok());
  }

  void TearDown() override {
    if (!unhold_.HasBeenNotified()) unhold_.Notify();
    StopServer();
    workers_.reset();
    publisher_.reset();
    store_->Shutdown();
  }

  // As Daemon::Shutdown: returns once every call's reactor is done (OnDone ran).
  void StopServer() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(60));
    server_->Wait();
    server_.reset();
  }

  // Holds the only worker until unhold_: whatever is posted after this waits in the queue.
  void HoldTheWorker() {
    workers_->Post("test: hold", [this] { unhold_.WaitForNotification(); });
  }

  // A lease on the version, its descriptor read; then the version is dropped, so that the
  // lease holds its last reference and the release frees its segment.
  void OpenAndDrop() {
    v1::OpenWeightsRequest request;
    request.mutable_selector()->set_name("gpt");
    request.mutable_selector()->set_owner_uid(-1);
    reader_ = stub_->OpenWeights(&ctx_, request);
    v1::OpenWeightsResponse descriptor;
    ASSERT_TRUE(reader_->Read(&descriptor));
    EXPECT_EQ(descriptor.version().readers(), 1);
    EXPECT_EQ(descriptor.segment_bytes(), static_cast<uint64_t>(kBytes));
    WeightsSelector all;
    all.name = "gpt";
    absl::StatusOr<int> dropped = publisher_->Drop(all, -1);
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    EXPECT_EQ(*dropped, 1);
    EXPECT_EQ(store_->Usage().buffers, 1) << "the lease holds the dropped version";
  }

  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<Publisher> publisher_;
  std::unique_ptr<RequestWorkers> workers_;
  std::unique_ptr<WeightsServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::WeightsService::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::OpenWeightsResponse>> reader_;
  absl::Notification unhold_;
};

TEST_F(WeightsServiceTest, AReaderClosingItsStreamReleasesTheLeaseOnAWorker) {
  OpenAndDrop();
  HoldTheWorker();
  ctx_.TryCancel();
  EXPECT_EQ(reader_->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The stream's end ran on a gRPC thread; its release did not: the version is still mapped.
  StopServer();
  EXPECT_EQ(store_->Usage().buffers, 1);
  unhold_.Notify();
  workers_.reset();  // runs the queued release (Daemon::Shutdown: before the store stops)
  EXPECT_EQ(store_->Usage().buffers, 0);
}

TEST_F(WeightsServiceTest, TheDaemonStoppingEndsTheStreamAndTheWorkerReleasesTheLease) {
  OpenAndDrop();
  HoldTheWorker();
  publisher_->Shutdown();  // Daemon::Shutdown's first step for the weights
  v1::OpenWeightsResponse more;
  EXPECT_FALSE(reader_->Read(&more));
  const grpc::Status ended = reader_->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.error_message(), HasSubstr("shutting down"));
  // The stream ended (from Shutdown's thread) before the release ran.
  EXPECT_EQ(store_->Usage().buffers, 1);
  StopServer();
  unhold_.Notify();
  workers_.reset();
  EXPECT_EQ(store_->Usage().buffers, 0);
}

TEST_F(WeightsServiceTest, ALeaseOnAVersionStillKeptFreesNothing) {
  v1::OpenWeightsRequest request;
  request.mutable_selector()->set_name("gpt");
  request.mutable_selector()->set_owner_uid(-1);
  reader_ = stub_->OpenWeights(&ctx_, request);
  v1::OpenWeightsResponse descriptor;
  ASSERT_TRUE(reader_->Read(&descriptor));
  ctx_.TryCancel();
  (void)reader_->Finish();
  StopServer();
  workers_.reset();                       // the release ran
  EXPECT_EQ(store_->Usage().buffers, 1);  // --weights_keep keeps it
  EXPECT_EQ(publisher_->List(-1, "gpt").at(0).readers, 0);
}

}  // namespace
}  // namespace flatshard::server
