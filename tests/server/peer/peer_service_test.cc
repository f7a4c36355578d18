// PeerService + PeerClient over real gRPC on loopback TCP: one coordinator, PeerClients standing
// in for the daemons of a group.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
#include "flatshard/v1/peer_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/peer/peer_client.h"
#include "server/peer/peer_service_impl.h"

namespace flatshard::server::peer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

constexpr absl::Duration kEventWait = absl::Seconds(5);

PeerOptions FastOptions() {
  PeerOptions o;
  o.heartbeat_interval = absl::Milliseconds(100);
  o.peer_timeout = absl::Seconds(1);
  return o;
}

DaemonIdentity Daemon(const std::string& node, const std::string& id) {
  return DaemonIdentity{node, id, node + ".example:7451", "ucx-" + id};
}

// Records PeerEvents; the test waits for conditions on them.
class RecordingEvents final : public PeerEvents {
 public:
  struct Failure {
    std::string coordinator, group;
    uint64_t epoch;
    absl::Status status;
  };

  void OnTable(const std::string& coordinator, const PeerTable& table) override {
    absl::MutexLock lock(&mu_);
    coordinators_.push_back(coordinator);
    tables_.push_back(table);
  }
  void OnGroupFailed(const std::string& coordinator, const std::string& group, uint64_t epoch,
                     const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    failures_.push_back(Failure{coordinator, group, epoch, status});
  }
  void OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    coordinators_.push_back(coordinator);
    lost_.push_back(status);
  }

  // Waits until at least `n` of each are recorded; false on timeout.
  bool WaitTables(size_t n) {
    return Wait([&] { return tables_.size() >= n; });
  }
  bool WaitFailures(size_t n) {
    return Wait([&] { return failures_.size() >= n; });
  }
  bool WaitLost(size_t n) {
    return Wait([&] { return lost_.size() >= n; });
  }

  std::vector<PeerTable> tables() {
    absl::MutexLock lock(&mu_);
    return tables_;
  }
  std::vector<Failure> failures() {
    absl::MutexLock lock(&mu_);
    return failures_;
  }
  std::vector<absl::Status> lost() {
    absl::MutexLock lock(&mu_);
    return lost_;
  }
  std::vector<std::string> coordinators() {
    absl::MutexLock lock(&mu_);
    return coordinators_;
  }

 private:
  bool Wait(std::function<bool()> pred) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&pred, &std::function<bool()>::operator()),
                                kEventWait);
  }

  absl::Mutex mu_;
  std::vector<PeerTable> tables_;
  std::vector<Failure> failures_;
  std::vector<absl::Status> lost_;
  std::vector<std::string> coordinators_;
};

// One rendezvous in flight.
struct Arrival {
  absl::Notification done;
  absl::StatusOr<PeerTable> result = absl::UnknownError("not answered");
  int calls = 0;

  // The result, after waiting for it (fails the test if it never comes).
  absl::StatusOr<PeerTable> Get() {
    if (!done.WaitForNotificationWithTimeout(absl::Seconds(15))) {
      return absl::InternalError("test: rendezvous never answered");
    }
    return result;
  }
};

std::shared_ptr<Arrival> Join(PeerClient& client, const std::string& coordinator, int world,
                              int rank, const std::string& group = "g",
                              const std::string& token = "t",
                              absl::Duration wait = absl::Seconds(10)) {
  auto a = std::make_shared<Arrival>();
  client.Rendezvous(coordinator, group, token, world, rank, absl::Now() + wait,
                    [a](absl::StatusOr<PeerTable> r) {
                      a->result = std::move(r);
                      if (++a->calls == 1) a->done.Notify();
                    });
  return a;
}

// Polls `pred` (for state that has no event to wait on, like the coordinator's snapshot).
bool Eventually(const std::function<bool()>& pred, absl::Duration timeout = kEventWait) {
  const absl::Time until = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

class PeerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<PeerServiceImpl>(FastOptions());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }

  void TearDown() override { StopServer(); }

  void StopServer() {
    if (server_ == nullptr) return;
    service_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
    server_.reset();
  }

  std::unique_ptr<PeerClient> Client(const std::string& node, const std::string& id,
                                     RecordingEvents* events) {
    return std::make_unique<PeerClient>(Daemon(node, id), FastOptions(), events);
  }

  bool Watching(size_t n) {
    return Eventually([&] { return service_->coordinator().Snapshot().watching.size() == n; });
  }

  std::unique_ptr<PeerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(PeerServiceTest, RendezvousCompletesWithTheTableAndEpoch) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0);
  auto r1 = Join(*b, address_, 2, 1);
  for (auto* r : {r0.get(), r1.get()}) {
    absl::StatusOr<PeerTable> t = r->Get();
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->group, "g");
    EXPECT_GT(t->epoch, 0u);
    EXPECT_THAT(t->rank_daemons, ElementsAre(a->self(), b->self()));
    EXPECT_EQ(r->calls, 1);
  }
  EXPECT_TRUE(Watching(2));             // each opened its Watch stream
  EXPECT_THAT(ea.tables(), IsEmpty());  // tables came by the calls, not pushed
}

// The heartbeat thread can reach a Watch stream between its registration and its start
// (EnsureWatch): its heartbeat must wait for the hello, the stream's first write, instead of
// racing it (two writes in flight crashed the daemon; a heartbeat taking the hello's place
// leaves the coordinator not knowing who watches). Heartbeats every 20 us make the window
// likely on every trial.
TEST_F(PeerServiceTest, HeartbeatsRacingAWatchStreamsStartWaitForItsHello) {
  PeerOptions o = FastOptions();
  o.heartbeat_interval = absl::Microseconds(20);
  std::vector<std::unique_ptr<RecordingEvents>> events;
  std::vector<std::unique_ptr<PeerClient>> clients;
  for (int i = 0; i < 20; ++i) {
    events.push_back(std::make_unique<RecordingEvents>());
    clients.push_back(
        std::make_unique<PeerClient>(Daemon("a", absl::StrCat("a-", i)), o, events.back().get()));
    absl::StatusOr<PeerTable> t =
        Join(*clients.back(), address_, 1, 0, absl::StrCat("g", i))->Get();
    ASSERT_TRUE(t.ok()) << "trial " << i << ": " << t.status();
    ASSERT_TRUE(Watching(clients.size())) << "trial " << i << ": the coordinator has no hello";
  }
  for (const auto& e : events) EXPECT_THAT(e->lost(), IsEmpty());
}

TEST_F(PeerServiceTest, UnevenLayoutOfThreeDaemons) {
  RecordingEvents ea, eb, ec;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto c = Client("c", "c-1", &ec);
  std::vector<std::shared_ptr<Arrival>> arrivals = {
      Join(*c, address_, 4, 3), Join(*a, address_, 4, 0), Join(*c, address_, 4, 2),
      Join(*b, address_, 4, 1)};
  for (auto& r : arrivals) {
    absl::StatusOr<PeerTable> t = r->Get();
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_GT(t->epoch, 0u);
    EXPECT_THAT(t->rank_daemons, ElementsAre(a->self(), b->self(), c->self(), c->self()));
  }
}

TEST_F(PeerServiceTest, MissingRanksFailWithDeadlineExceededNamingThem) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 4, 0, "g", "t", absl::Seconds(1));
  auto r1 = Join(*b, address_, 4, 1, "g", "t", absl::Seconds(1));
  for (auto* r : {r0.get(), r1.get()}) {
    EXPECT_EQ(r->Get().status(), absl::DeadlineExceededError(
                                     "group g: ranks 2, 3 of 4 did not join before the deadline"));
  }
  EXPECT_THAT(service_->coordinator().Snapshot().groups, IsEmpty());  // no trace
}

TEST_F(PeerServiceTest, WrongTokenIsPermissionDenied) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0, "g", "right");
  ASSERT_TRUE(Eventually([&] { return !service_->coordinator().Snapshot().groups.empty(); }));
  auto r1 = Join(*b, address_, 2, 1, "g", "wrong");
  EXPECT_EQ(r1->Get().status(), absl::PermissionDeniedError("group g: wrong token"));
  EXPECT_FALSE(r0->done.HasBeenNotified());
}

TEST_F(PeerServiceTest, WorldSizeDisagreementIsInvalidArgument) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0);
  ASSERT_TRUE(Eventually([&] { return !service_->coordinator().Snapshot().groups.empty(); }));
  absl::Status s = Join(*b, address_, 3, 1)->Get().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("group g has world_size 2, rank 1 joined with world_size 3"));
}

TEST_F(PeerServiceTest, RestartedDaemonGivesANewEpochPushedToTheOthers) {
  RecordingEvents ea, eb, eb2;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0);
  ASSERT_TRUE(Join(*b, address_, 2, 1)->Get().ok());
  absl::StatusOr<PeerTable> first = r0->Get();
  ASSERT_TRUE(first.ok()) << first.status();

  // b restarts (same node, new daemon_id) and its trainer rejoins before b-1 is noticed gone.
  auto b2 = Client("b", "b-2", &eb2);
  absl::StatusOr<PeerTable> t = Join(*b2, address_, 2, 1)->Get();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->epoch, first->epoch + 1);

  ASSERT_TRUE(ea.WaitTables(1));
  std::vector<PeerTable> pushed = ea.tables();
  ASSERT_EQ(pushed.size(), 1u);
  EXPECT_EQ(pushed[0].epoch, first->epoch + 1);
  EXPECT_THAT(pushed[0].rank_daemons, ElementsAre(a->self(), b2->self()));
  EXPECT_THAT(ea.coordinators(), ElementsAre(address_));
}

TEST_F(PeerServiceTest, ReportedFailureReachesTheOtherDaemons) {
  RecordingEvents ea, eb, ec;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto c = Client("c", "c-1", &ec);
  auto r0 = Join(*a, address_, 3, 0);
  auto r1 = Join(*b, address_, 3, 1);
  ASSERT_TRUE(Join(*c, address_, 3, 2)->Get().ok());
  absl::StatusOr<PeerTable> table = r0->Get();
  ASSERT_TRUE(table.ok() && r1->Get().ok());
  ASSERT_TRUE(Watching(3));

  const absl::Status boom = absl::AbortedError("group g op_seq=3: fingerprint mismatch");
  a->ReportFailure(address_, "g", "t", table->epoch, boom);
  for (RecordingEvents* e : {&eb, &ec}) {
    ASSERT_TRUE(e->WaitFailures(1));
    std::vector<RecordingEvents::Failure> f = e->failures();
    ASSERT_EQ(f.size(), 1u);
    EXPECT_EQ(f[0].coordinator, address_);
    EXPECT_EQ(f[0].group, "g");
    EXPECT_EQ(f[0].epoch, table->epoch);
    EXPECT_EQ(f[0].status, boom);
  }
  EXPECT_THAT(ea.failures(), IsEmpty());  // not echoed to the reporter
  EXPECT_TRUE(Eventually([&] { return service_->coordinator().Snapshot().groups[0].dirty; }));
}

TEST_F(PeerServiceTest, DeadDaemonIsReportedToTheOthersWithin5s) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 3, 0);
  auto r1 = Join(*b, address_, 3, 1);
  ASSERT_TRUE(Join(*b, address_, 3, 2)->Get().ok());
  absl::StatusOr<PeerTable> table = r0->Get();
  ASSERT_TRUE(table.ok() && r1->Get().ok());
  ASSERT_TRUE(Watching(2));

  const absl::Time died = absl::Now();
  b.reset();  // its Watch stream goes with it
  ASSERT_TRUE(ea.WaitFailures(1));
  EXPECT_LT(absl::Now() - died, absl::Seconds(5));
  std::vector<RecordingEvents::Failure> f = ea.failures();
  EXPECT_EQ(f[0].group, "g");
  EXPECT_EQ(f[0].epoch, table->epoch);
  EXPECT_EQ(f[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(f[0].status.message()),
              StartsWith("group g: daemon b (b.example:7451) hosting ranks 1, 2 is gone: "));
  GroupSnapshot g = service_->coordinator().Snapshot().groups.at(0);
  EXPECT_TRUE(g.dirty);
  EXPECT_FALSE(g.members[1].has_value());
  EXPECT_THAT(eb.lost(), IsEmpty());  // destruction is quiet
}

// A daemon that hangs without closing its stream: only missed heartbeats reveal it.
TEST_F(PeerServiceTest, SilentDaemonIsDeclaredDeadAfterPeerTimeout) {
  RecordingEvents ea;
  auto a = Client("a", "a-1", &ea);
  auto r0 = Join(*a, address_, 2, 0);

  auto stub =
      v1::PeerService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->Watch(&watch_ctx);
  v1::WatchRequest hello;
  hello.mutable_daemon()->set_node("mute");
  hello.mutable_daemon()->set_daemon_id("mute-1");
  hello.mutable_daemon()->set_peer_address("mute.example:7451");
  ASSERT_TRUE(stream->Write(hello));
  grpc::ClientContext call_ctx;
  v1::RendezvousRequest req;
  req.set_group("g");
  req.set_token("t");
  req.set_world_size(2);
  req.set_rank(1);
  *req.mutable_daemon() = hello.daemon();
  v1::RendezvousResponse resp;
  ASSERT_TRUE(stub->Rendezvous(&call_ctx, req, &resp).ok());
  ASSERT_TRUE(r0->Get().ok());

  // No heartbeats from "mute" from now on.
  ASSERT_TRUE(ea.WaitFailures(1));
  EXPECT_EQ(ea.failures()[0].status,
            absl::UnavailableError("group g: daemon mute (mute.example:7451) hosting rank 1 is "
                                   "gone: no heartbeat for 1s"));
  // The coordinator ends the silent daemon's stream itself.
  v1::WatchEvent ignored;
  while (stream->Read(&ignored)) {
  }
  grpc::Status end = stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(end.error_message(), HasSubstr("daemon mute declared dead: no heartbeat for 1s"));
}

// Holds every Depart call until Release(): a handler that keeps a gRPC callback thread busy,
// as a trainer's call that allocates a GiB there does (issue 27).
class BusyService final : public v1::PeerService::CallbackService {
 public:
  grpc::ServerUnaryReactor* Depart(grpc::CallbackServerContext* ctx, const v1::DepartRequest*,
                                   v1::DepartResponse*) override {
    ++started_;
    release_.WaitForNotification();
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  int started() const { return started_.load(); }
  void Release() { release_.Notify(); }

 private:
  std::atomic<int> started_{0};
  absl::Notification release_;
};

// Every gRPC callback thread of the process busy for 3 peer timeouts: Watch stream heartbeats
// cannot move, but the pings (synchronous on the coordinator, a thread of their own on the
// daemon) keep both daemons and the coordinator alive to each other.
TEST_F(PeerServiceTest, BusyCallbackThreadsDoNotMakeLiveDaemonsDead) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0);
  ASSERT_TRUE(Join(*b, address_, 2, 1)->Get().ok());
  ASSERT_TRUE(r0->Get().ok());
  ASSERT_TRUE(Watching(2));

  BusyService busy;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&busy);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::PeerService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  // More calls than gRPC has callback threads (at most 16): the extra ones queue.
  constexpr int kCalls = 32;
  struct Call {
    grpc::ClientContext ctx;
    v1::DepartRequest request;
    v1::DepartResponse response;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::atomic<int> answered{0};
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<Call>());
    Call& c = *calls.back();
    stub->async()->Depart(&c.ctx, &c.request, &c.response, [&](grpc::Status) { ++answered; });
  }
  ASSERT_TRUE(Eventually([&] { return busy.started() > 0; }));
  // The stall under test, not a synchronization: 3 peer timeouts of it.
  absl::SleepFor(3 * FastOptions().peer_timeout);
  const int held = busy.started();
  const std::vector<absl::Status> lost_a = ea.lost(), lost_b = eb.lost();
  const size_t watching = service_->coordinator().Snapshot().watching.size();
  busy.Release();
  ASSERT_TRUE(Eventually([&] { return answered.load() == kCalls; }, absl::Seconds(30)));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server->Wait();

  EXPECT_LT(held, kCalls) << "the callback threads were not all busy";
  EXPECT_THAT(lost_a, IsEmpty());
  EXPECT_THAT(lost_b, IsEmpty());
  EXPECT_EQ(watching, 2u);
  EXPECT_THAT(ea.failures(), IsEmpty());
  EXPECT_THAT(eb.failures(), IsEmpty());
}

TEST_F(PeerServiceTest, CoordinatorShutdownIsNoticedWithin5s) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0);
  ASSERT_TRUE(Join(*b, address_, 2, 1)->Get().ok());
  ASSERT_TRUE(Watching(2));

  const absl::Time stopped = absl::Now();
  StopServer();
  for (RecordingEvents* e : {&ea, &eb}) {
    ASSERT_TRUE(e->WaitLost(1));
    EXPECT_LT(absl::Now() - stopped, absl::Seconds(5));
    absl::Status s = e->lost()[0];
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(s.message()),
                StartsWith(absl::StrCat("coordinator ", address_, " unreachable: ")));
  }
}

TEST_F(PeerServiceTest, UnwatchClosesTheStreamQuietly) {
  RecordingEvents ea, eb;
  auto a = Client("a", "a-1", &ea);
  auto b = Client("b", "b-1", &eb);
  auto r0 = Join(*a, address_, 2, 0);
  ASSERT_TRUE(Join(*b, address_, 2, 1)->Get().ok());
  ASSERT_TRUE(r0->Get().ok());
  ASSERT_TRUE(Watching(2));
  a->Depart(address_, "g", "t", 0);
  ASSERT_TRUE(Eventually(
      [&] { return !service_->coordinator().Snapshot().groups.at(0).members[0].has_value(); }));
  a->Unwatch(address_);
  ASSERT_TRUE(Watching(1));
  EXPECT_THAT(eb.failures(), IsEmpty());  // a hosted nothing any more: no death to report
  StopServer();
  ASSERT_TRUE(eb.WaitLost(1));
  EXPECT_THAT(ea.lost(), IsEmpty());
}

TEST_F(PeerServiceTest, UnreachableCoordinatorIsUnavailableNamingIt) {
  RecordingEvents ea;
  auto a = Client("a", "a-1", &ea);
  const std::string nowhere = "127.0.0.1:1";
  absl::Status s = Join(*a, nowhere, 2, 0)->Get().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("coordinator 127.0.0.1:1 unreachable: "));
  ASSERT_TRUE(ea.WaitLost(1));  // the Watch stream it opened failed too
  EXPECT_THAT(std::string(ea.lost()[0].message()),
              StartsWith("coordinator 127.0.0.1:1 unreachable: "));
}

TEST_F(PeerServiceTest, DestroyingTheClientFailsPendingRendezvousBeforeItReturns) {
  RecordingEvents ea;
  auto a = Client("a", "a-1", &ea);
  auto r0 = Join(*a, address_, 2, 0);
  ASSERT_TRUE(Eventually([&] { return !service_->coordinator().Snapshot().groups.empty(); }));
  a.reset();
  ASSERT_TRUE(r0->done.HasBeenNotified());
  EXPECT_EQ(r0->result.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r0->calls, 1);
  EXPECT_THAT(ea.lost(), IsEmpty());
}

// The daemon may drop its PeerClient from one of the client's own callbacks.
TEST_F(PeerServiceTest, ClientDestroyedFromItsOwnCallbacksDoesNotWaitForThem) {
  RecordingEvents ea;
  auto a = Client("a", "a-1", &ea);
  absl::Notification destroyed;
  absl::Duration took;
  a->Rendezvous("127.0.0.1:1", "g", "t", 2, 0, absl::Now() + absl::Seconds(5),
                [&](absl::StatusOr<PeerTable> r) {
                  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
                  const absl::Time start = absl::Now();
                  a.reset();
                  took = absl::Now() - start;
                  destroyed.Notify();
                });
  ASSERT_TRUE(destroyed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_LT(took, absl::Seconds(2));
}

// A coordinator that accepts Watch streams and then says nothing.
class MuteCoordinator final : public v1::PeerService::CallbackService {
  class Reactor final : public grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent> {
   public:
    Reactor() { StartRead(&request_); }
    void OnReadDone(bool ok) override {
      if (ok) {
        StartRead(&request_);
      } else {
        Finish(grpc::Status::OK);
      }
    }
    void OnCancel() override {}
    void OnDone() override { delete this; }

   private:
    v1::WatchRequest request_;
  };

 public:
  grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent>* Watch(
      grpc::CallbackServerContext*) override {
    return new Reactor();
  }
};

TEST(PeerClientTest, SilentCoordinatorIsLostAfterPeerTimeout) {
  MuteCoordinator mute;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&mute);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  {
    RecordingEvents ea;
    PeerClient a(Daemon("a", "a-1"), FastOptions(), &ea);
    absl::Status s = Join(a, address, 2, 0)->Get().status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
    const absl::Time opened = absl::Now();
    ASSERT_TRUE(ea.WaitLost(1));
    EXPECT_GE(absl::Now() - opened, absl::Milliseconds(800));  // not before peer_timeout
    EXPECT_THAT(std::string(ea.lost()[0].message()),
                StartsWith(absl::StrCat("coordinator ", address, " unreachable: no message for")));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server->Wait();
}

}  // namespace
}  // namespace flatshard::server::peer
