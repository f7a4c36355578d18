// End-to-end tests of flatshardd: a real daemon process, real gRPC over a real Unix socket,
// real shared-memory segments. Ranks are threads (or forked processes where a client must die).

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "common/proto_convert.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include <grpcpp/grpcpp.h>

namespace flatshard {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> SegmentsWithPrefix(const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix + ".", 0) == 0) out.push_back(e.path());
  }
  return out;
}

// A flatshardd process on a private socket and segment prefix.
class DaemonProcess {
 public:
  DaemonProcess() {
    static int counter = 0;
    tag_ = absl::StrCat("fse2e", getpid(), "x", counter++);
    dir_ = fs::temp_directory_path() / tag_;
    fs::create_directories(dir_);
    socket_ = (dir_ / "flatshardd.sock").string();
    pid_ = fork();
    if (pid_ == 0) {
      const std::string bin = std::string(FS_BINARY_DIR) + "/server/flatshardd";
      const std::string socket_flag = "--socket=" + socket_;
      const std::string prefix_flag = "--segment_prefix=" + tag_;
      execl(bin.c_str(), bin.c_str(), socket_flag.c_str(), prefix_flag.c_str(),
            "--default_wait=10s", static_cast<char*>(nullptr));
      _exit(127);
    }
    channel_ = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
    const bool up = channel_->WaitForConnected(std::chrono::system_clock::now() +
                                               std::chrono::seconds(20));
    EXPECT_TRUE(up) << "flatshardd did not come up on " << socket_;
  }
  ~DaemonProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    for (const auto& s : SegmentsWithPrefix(tag_)) fs::remove(s);
    fs::remove_all(dir_);
  }
  std::unique_ptr<v1::ShardService::Stub> Stub() { return v1::ShardService::NewStub(channel_); }
  // Sends SIGTERM and returns the exit status (or -1 after a 20 s wait).
  int Terminate() {
    kill(pid_, SIGTERM);
    for (int i = 0; i < 2000; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  const std::string& socket() const { return socket_; }
  const std::string& tag() const { return tag_; }

 private:
  std::string tag_;
  fs::path dir_;
  std::string socket_;
  pid_t pid_ = -1;
  std::shared_ptr<grpc::Channel> channel_;
};

struct Joined {
  grpc::Status status;
  v1::JoinGroupResponse response;
};

Joined Join(v1::ShardService::Stub* stub, const std::string& group, int world, int rank,
            const std::string& token = "t0k", int timeout_ms = 10000) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  v1::JoinGroupRequest req;
  req.set_group(group);
  req.set_world_size(world);
  req.set_rank(rank);
  req.set_token(token);
  Joined out;
  out.status = stub->JoinGroup(&ctx, req, &out.response);
  return out;
}

// Joins ranks 0..world-1 concurrently; returns their sessions.
std::vector<uint64_t> JoinAll(DaemonProcess& d, const std::string& group, int world) {
  std::vector<std::future<Joined>> futures;
  for (int r = 0; r < world; ++r) {
    futures.push_back(std::async(std::launch::async, [&d, group, world, r] {
      auto stub = d.Stub();
      return Join(stub.get(), group, world, r);
    }));
  }
  std::vector<uint64_t> sessions;
  for (auto& f : futures) {
    Joined j = f.get();
    EXPECT_TRUE(j.status.ok()) << j.status.error_message();
    sessions.push_back(j.response.session());
  }
  return sessions;
}

v1::Caller MakeCaller(const std::string& group, int rank, uint64_t session,
                      const std::string& token = "t0k") {
  v1::Caller c;
  c.set_group(group);
  c.set_rank(rank);
  c.set_token(token);
  c.set_session(session);
  return c;
}

v1::RegisterModuleRequest RegisterRequest(const v1::Caller& caller, const std::string& model,
                                          const std::string& module = "") {
  const fs::path dir = fs::path(FS_SOURCE_DIR) / "examples" / "models";
  v1::RegisterModuleRequest req;
  *req.mutable_caller() = caller;
  req.set_module(module);
  *req.mutable_manifest() = ToProto(*ManifestFromJson(ReadFile(dir / (model + ".manifest.json"))));
  *req.mutable_policy() = ToProto(*PolicyFromJson(ReadFile(dir / (model + ".policy.json"))));
  req.set_init(v1::INIT_MODE_ZEROS);
  return req;
}

struct Registered {
  grpc::Status status;
  v1::RegisterModuleResponse response;
};

// Sends every request concurrently (one per rank) and waits for all answers.
std::vector<Registered> RegisterAll(DaemonProcess& d,
                                    const std::vector<v1::RegisterModuleRequest>& requests) {
  std::vector<std::future<Registered>> futures;
  for (size_t r = 0; r < requests.size(); ++r) {
    futures.push_back(std::async(std::launch::async, [&d, &requests, r] {
      auto stub = d.Stub();
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      Registered out;
      out.status = stub->RegisterModule(&ctx, requests[r], &out.response);
      return out;
    }));
  }
  std::vector<Registered> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

TEST(DaemonE2ETest, JoinWaitsForEveryRank) {
  DaemonProcess d;
  std::vector<uint64_t> sessions = JoinAll(d, "g", 3);
  ASSERT_EQ(sessions.size(), 3u);
  EXPECT_NE(sessions[0], sessions[1]);
  EXPECT_NE(sessions[1], sessions[2]);
}

TEST(DaemonE2ETest, JoinDeadlineNamesMissingRanks) {
  DaemonProcess d;
  auto stub = d.Stub();
  Joined j = Join(stub.get(), "g", 4, 1, "t0k", 300);
  EXPECT_EQ(j.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(j.status.error_message(), HasSubstr("ranks 0, 2, 3 of 4 did not join"));
  // The failed join left no trace: the rank can join again.
  std::vector<uint64_t> sessions = JoinAll(d, "g", 4);
  EXPECT_EQ(sessions.size(), 4u);
}

TEST(DaemonE2ETest, BadJoinsAreRefusedAndChangeNothing) {
  DaemonProcess d;
  auto stub = d.Stub();
  auto first = std::async(std::launch::async, [&] { return Join(stub.get(), "g", 2, 0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Joined wrong_token = Join(stub.get(), "g", 2, 1, "nope");
  EXPECT_EQ(wrong_token.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  Joined wrong_world = Join(stub.get(), "g", 3, 1);
  EXPECT_EQ(wrong_world.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(wrong_world.status.error_message(), HasSubstr("has world_size 2"));
  Joined bad_rank = Join(stub.get(), "g", 2, 2);
  EXPECT_EQ(bad_rank.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad_rank.status.error_message(), HasSubstr("rank 2 is out of range [0, 2)"));
  Joined ok = Join(stub.get(), "g", 2, 1);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_TRUE(first.get().status.ok());
  Joined twice = Join(stub.get(), "g", 2, 1);
  EXPECT_EQ(twice.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

TEST(DaemonE2ETest, RegisterPlansLikeThePlannerAndAllocatesPrivateShards) {
  DaemonProcess d;
  std::vector<uint64_t> s = JoinAll(d, "g", 2);
  std::vector<v1::RegisterModuleRequest> reqs = {RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied"),
                                                 RegisterRequest(MakeCaller("g", 1, s[1]), "gpt_tied")};
  std::vector<Registered> out = RegisterAll(d, reqs);
  ASSERT_TRUE(out[0].status.ok()) << out[0].status.error_message();
  ASSERT_TRUE(out[1].status.ok()) << out[1].status.error_message();

  const fs::path dir = fs::path(FS_SOURCE_DIR) / "examples" / "models";
  PlanOptions options;
  options.world_size = 2;
  Plan local = *BuildPlan(*ManifestFromJson(ReadFile(dir / "gpt_tied.manifest.json")),
                          *PolicyFromJson(ReadFile(dir / "gpt_tied.policy.json")), options);
  absl::StatusOr<Plan> remote = FromProto(out[0].response.plan());
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ(*remote, local);
  ASSERT_EQ(out[0].response.shards_size(), static_cast<int>(local.units.size()));
  for (int u = 0; u < out[0].response.shards_size(); ++u) {
    const v1::MemoryHandle& h0 = out[0].response.shards(u).shard();
    const v1::MemoryHandle& h1 = out[1].response.shards(u).shard();
    EXPECT_NE(h0.segment(), h1.segment()) << "ranks must not share shard memory";
    EXPECT_EQ(h0.bytes(), static_cast<uint64_t>(local.units[u].shard_numel * 4));
    struct stat st;
    ASSERT_EQ(stat(("/dev/shm" + h0.segment()).c_str(), &st), 0) << h0.segment();
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_FALSE(out[0].response.shards(u).has_grad());
  }
}

TEST(DaemonE2ETest, MismatchedModelsFailEveryRankNamingTheUnit) {
  DaemonProcess d;
  std::vector<uint64_t> s = JoinAll(d, "g", 2);
  std::vector<v1::RegisterModuleRequest> reqs = {RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied"),
                                                 RegisterRequest(MakeCaller("g", 1, s[1]), "gpt_tied")};
  // Rank 1 wraps every module: its units differ from rank 0's.
  reqs[1].mutable_policy()->mutable_auto_wrap()->set_kind(v1::AUTO_WRAP_KIND_ALWAYS);
  std::vector<Registered> out = RegisterAll(d, reqs);
  for (const Registered& r : out) {
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(r.status.error_message(),
                HasSubstr("ranks registered different models for module \"\" (the root): first "
                          "difference at unit 0: rank 0 has"));
  }
  // A manifest the daemon refuses fails the other rank at once too, naming the rank.
  reqs[1] = RegisterRequest(MakeCaller("g", 1, s[1]), "gpt_tied");
  reqs[1].mutable_manifest()->mutable_modules(1)->mutable_params(0)->set_shape(0, 65);
  out = RegisterAll(d, reqs);
  EXPECT_EQ(out[0].status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(out[0].status.error_message(), HasSubstr("rank 1's registration of module"));
  EXPECT_THAT(out[1].status.error_message(), HasSubstr("conflicting declarations of tied"));
  // Nothing was registered: the same model from both ranks now succeeds.
  reqs[1] = RegisterRequest(MakeCaller("g", 1, s[1]), "gpt_tied");
  out = RegisterAll(d, reqs);
  EXPECT_TRUE(out[0].status.ok() && out[1].status.ok()) << out[0].status.error_message();
  // Registering again, or a nested path, is refused.
  out = RegisterAll(d, reqs);
  EXPECT_EQ(out[0].status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  reqs[0].set_module("h.0");
  out = RegisterAll(d, {reqs[0]});
  EXPECT_EQ(out[0].status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(out[0].status.error_message(), HasSubstr("already has flatshard applied"));
}

TEST(DaemonE2ETest, BadCallersAreRefused) {
  DaemonProcess d;
  std::vector<uint64_t> s = JoinAll(d, "g", 1);
  auto stub = d.Stub();
  struct Case {
    v1::Caller caller;
    grpc::StatusCode code;
    std::string text;
  };
  std::vector<Case> cases = {
      {MakeCaller("nope", 0, s[0]), grpc::StatusCode::NOT_FOUND, "unknown group nope"},
      {MakeCaller("g", 0, s[0], "bad"), grpc::StatusCode::PERMISSION_DENIED, "wrong token"},
      {MakeCaller("g", 0, s[0] + 100), grpc::StatusCode::FAILED_PRECONDITION, "not the rank's current session"},
      {MakeCaller("g", 5, s[0]), grpc::StatusCode::INVALID_ARGUMENT, "rank 5 is out of range"},
  };
  for (const Case& c : cases) {
    grpc::ClientContext ctx;
    v1::GetShardViewsRequest req;
    *req.mutable_caller() = c.caller;
    v1::GetShardViewsResponse resp;
    grpc::Status st = stub->GetShardViews(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), c.code) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(c.text));
  }
  grpc::ClientContext ctx;
  v1::GetShardViewsRequest req;
  *req.mutable_caller() = MakeCaller("g", 0, s[0]);
  req.set_registered_module("enc");
  v1::GetShardViewsResponse resp;
  grpc::Status st = stub->GetShardViews(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("module \"enc\" is not registered"));
}

TEST(DaemonE2ETest, KilledClientFreesItsRankAndShardsOutliveIt) {
  DaemonProcess d;
  std::vector<uint64_t> s = JoinAll(d, "g", 1);
  std::vector<Registered> out =
      RegisterAll(d, {RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied")});
  ASSERT_TRUE(out[0].status.ok()) << out[0].status.error_message();
  const std::string shard_segment = out[0].response.shards(0).shard().segment();
  // Leave, then a child process joins rank 0, holds its lease and is killed with SIGKILL.
  {
    auto stub = d.Stub();
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    *req.mutable_caller() = MakeCaller("g", 0, s[0]);
    v1::LeaveResponse resp;
    ASSERT_TRUE(stub->Leave(&ctx, req, &resp).ok());
  }
  // The client runs in a fresh process (gRPC must not be used across fork): this test binary,
  // running only LeaseHolderChild.HoldLease.
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  if (child == 0) {
    close(ready[0]);
    const std::string socket_env = "FS_E2E_SOCKET=" + d.socket();
    const std::string fd_env = absl::StrCat("FS_E2E_READY_FD=", ready[1]);
    putenv(const_cast<char*>(socket_env.c_str()));
    putenv(const_cast<char*>(fd_env.c_str()));
    execl("/proc/self/exe", "daemon_e2e_test", "--gtest_filter=LeaseHolderChild.HoldLease",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1) << "the lease-holding child did not start";
  auto stub = d.Stub();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(Join(stub.get(), "g", 1, 0, "t0k", 200).status.error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  // The lease ends with the connection; the rank is free again within 2 s.
  Joined again;
  for (int i = 0; i < 40; ++i) {
    again = Join(stub.get(), "g", 1, 0, "t0k", 1000);
    if (again.status.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_THAT(again.response.registered_modules(), ::testing::ElementsAre(""));
  grpc::ClientContext ctx;
  v1::GetShardViewsRequest req;
  *req.mutable_caller() = MakeCaller("g", 0, again.response.session());
  v1::GetShardViewsResponse resp;
  ASSERT_TRUE(stub->GetShardViews(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.shards(0).shard().segment(), shard_segment) << "re-attached to the same shard";
}

// Runs only as the child of KilledClientFreesItsRankAndShardsOutliveIt: joins rank 0 of group
// "g", opens its lease, reports through the pipe, and waits to be killed.
TEST(LeaseHolderChild, HoldLease) {
  const char* socket = getenv("FS_E2E_SOCKET");
  const char* fd = getenv("FS_E2E_READY_FD");
  if (socket == nullptr || fd == nullptr) GTEST_SKIP() << "runs only as a child process";
  auto channel = grpc::CreateChannel(std::string("unix:") + socket, grpc::InsecureChannelCredentials());
  auto stub = v1::ShardService::NewStub(channel);
  Joined j = Join(stub.get(), "g", 1, 0);
  if (!j.status.ok()) _exit(2);
  grpc::ClientContext ctx;
  auto lease = stub->Lease(&ctx);
  v1::LeaseRequest first;
  *first.mutable_caller() = MakeCaller("g", 0, j.response.session());
  if (!lease->Write(first)) _exit(3);
  char c = 1;
  if (write(atoi(fd), &c, 1) != 1) _exit(4);
  pause();
  _exit(0);
}

TEST(DaemonE2ETest, SigtermRemovesSocketAndSegments) {
  DaemonProcess d;
  std::vector<uint64_t> s = JoinAll(d, "g", 1);
  std::vector<Registered> out =
      RegisterAll(d, {RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied")});
  ASSERT_TRUE(out[0].status.ok());
  EXPECT_FALSE(SegmentsWithPrefix(d.tag()).empty());
  // A join that waits for a missing rank is failed, not left hanging, by the shutdown.
  auto stub = d.Stub();
  auto waiting = std::async(std::launch::async, [&] { return Join(stub.get(), "h", 2, 0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(d.Terminate(), 0);
  Joined j = waiting.get();
  EXPECT_FALSE(j.status.ok());
  EXPECT_FALSE(fs::exists(d.socket()));
  EXPECT_TRUE(SegmentsWithPrefix(d.tag()).empty());
}

}  // namespace
}  // namespace flatshard
