// End-to-end tests of flatshardd: real daemon processes, real gRPC over real Unix sockets,
// real shared-memory segments. Ranks are threads (or forked processes where a client must die).
// Every test but the SIGTERM one runs in each Layout of tests/testing/cluster.h: one daemon
// (a local group), or several daemons on this host standing in for nodes, each rank's stubs
// talking to its own rank's daemon and every join naming daemon 0 as the coordinator.

#include <fcntl.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "common/proto_convert.h"
#include "common/shm_segment.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"

namespace flatshard {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using ::flatshard::testing::Layout;
using ::flatshard::testing::ReadFile;

// The daemons of a Layout (tests/testing/cluster.h) with raw ShardService stubs: Stub(rank)
// talks to rank `rank`'s daemon.
class DaemonProcess : public ::flatshard::testing::Cluster {
 public:
  explicit DaemonProcess(Layout layout, std::vector<std::string> extra_flags = {})
      : ::flatshard::testing::Cluster(layout, Options(std::move(extra_flags))) {
    for (int i = 0; i < daemon_count(); ++i) {
      channels_.push_back(
          grpc::CreateChannel(daemon(i).address(), grpc::InsecureChannelCredentials()));
    }
  }
  std::unique_ptr<v1::ShardService::Stub> Stub(int rank) {
    return v1::ShardService::NewStub(channels_[DaemonOf(rank)]);
  }

 private:
  static ::flatshard::testing::ClusterOptions Options(std::vector<std::string> extra_flags) {
    ::flatshard::testing::ClusterOptions o;
    o.tag_prefix = "fse2e";
    o.extra_flags = std::move(extra_flags);
    return o;
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
};

// Every test suite but the SIGTERM test runs once per layout.
class DaemonE2ETest : public ::testing::TestWithParam<Layout> {};
class DaemonSummonTest : public ::testing::TestWithParam<Layout> {};
class DaemonGradTest : public ::testing::TestWithParam<Layout> {};

struct Joined {
  grpc::Status status;
  v1::JoinGroupResponse response;
};

Joined Join(v1::ShardService::Stub* stub, const std::string& group, int world, int rank,
            const std::string& token = "t0k", int timeout_ms = 10000,
            const std::string& coordinator = "") {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  v1::JoinGroupRequest req;
  req.set_group(group);
  req.set_world_size(world);
  req.set_rank(rank);
  req.set_token(token);
  req.set_coordinator(coordinator);
  Joined out;
  out.status = stub->JoinGroup(&ctx, req, &out.response);
  return out;
}

// Joins `rank` at its own daemon, naming the cluster's coordinator.
Joined JoinAt(DaemonProcess& d, const std::string& group, int world, int rank,
              const std::string& token = "t0k", int timeout_ms = 10000) {
  auto stub = d.Stub(rank);
  return Join(stub.get(), group, world, rank, token, timeout_ms, d.coordinator());
}

// Joins ranks 0..world-1 concurrently; returns their sessions.
std::vector<uint64_t> JoinAll(DaemonProcess& d, const std::string& group, int world) {
  std::vector<std::future<Joined>> futures;
  for (int r = 0; r < world; ++r) {
    futures.push_back(std::async(std::launch::async,
                                 [&d, group, world, r] { return JoinAt(d, group, world, r); }));
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
      auto stub = d.Stub(requests[r].caller().rank());
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

TEST_P(DaemonE2ETest, JoinWaitsForEveryRank) {
  DaemonProcess d(GetParam());
  std::vector<uint64_t> sessions = JoinAll(d, "g", 3);
  ASSERT_EQ(sessions.size(), 3u);
  // Sessions are a daemon's own: distinct among the ranks of one daemon.
  for (int a = 0; a < 3; ++a) {
    EXPECT_NE(sessions[a], 0u) << "rank " << a;
    for (int b = a + 1; b < 3; ++b) {
      if (d.SameDaemon(a, b)) {
        EXPECT_NE(sessions[a], sessions[b]) << "ranks " << a << ", " << b;
      }
    }
  }
}

TEST_P(DaemonE2ETest, JoinDeadlineNamesMissingRanks) {
  DaemonProcess d(GetParam());
  // Across daemons the answer comes from the coordinator: allow for the round trips.
  Joined j = JoinAt(d, "g", 4, 1, "t0k", d.multi() ? 1000 : 300);
  EXPECT_EQ(j.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(j.status.error_message(), HasSubstr("ranks 0, 2, 3 of 4 did not join"));
  // The failed join left no trace: the rank can join again.
  std::vector<uint64_t> sessions = JoinAll(d, "g", 4);
  EXPECT_EQ(sessions.size(), 4u);
}

// In the multi-daemon layouts rank 1 joins another daemon than rank 0: its token and world
// size are checked against the group at the coordinator.
TEST_P(DaemonE2ETest, BadJoinsAreRefusedAndChangeNothing) {
  DaemonProcess d(GetParam());
  auto first = std::async(std::launch::async, [&] { return JoinAt(d, "g", 2, 0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Joined wrong_token = JoinAt(d, "g", 2, 1, "nope");
  EXPECT_EQ(wrong_token.status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << wrong_token.status.error_message();
  Joined wrong_world = JoinAt(d, "g", 3, 1);
  EXPECT_EQ(wrong_world.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << wrong_world.status.error_message();
  EXPECT_THAT(wrong_world.status.error_message(), HasSubstr("has world_size 2"));
  // A huge world_size is refused before anything is sized by it (not a multi-GiB allocation).
  Joined huge = JoinAt(d, "huge", 2147483647, 0);
  EXPECT_EQ(huge.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << huge.status.error_message();
  EXPECT_THAT(huge.status.error_message(), HasSubstr("world_size must be in [1, 1048576]"));
  Joined bad_rank = JoinAt(d, "g", 2, 2);
  EXPECT_EQ(bad_rank.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad_rank.status.error_message(), HasSubstr("rank 2 is out of range [0, 2)"));
  Joined ok = JoinAt(d, "g", 2, 1);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  Joined first_joined = first.get();
  EXPECT_TRUE(first_joined.status.ok()) << first_joined.status.error_message();
  Joined twice = JoinAt(d, "g", 2, 1);
  EXPECT_EQ(twice.status.error_code(), grpc::StatusCode::ALREADY_EXISTS)
      << twice.status.error_message();
}

TEST_P(DaemonE2ETest, RegisterPlansLikeThePlannerAndAllocatesPrivateShards) {
  DaemonProcess d(GetParam());
  std::vector<uint64_t> s = JoinAll(d, "g", 2);
  std::vector<v1::RegisterModuleRequest> reqs = {
      RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied"),
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

TEST_P(DaemonE2ETest, MismatchedModelsFailEveryRankNamingTheUnit) {
  DaemonProcess d(GetParam());
  std::vector<uint64_t> s = JoinAll(d, "g", 2);
  std::vector<v1::RegisterModuleRequest> reqs = {
      RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied"),
      RegisterRequest(MakeCaller("g", 1, s[1]), "gpt_tied")};
  // Rank 1 wraps every module: its units differ from rank 0's.
  reqs[1].mutable_policy()->mutable_auto_wrap()->set_kind(v1::AUTO_WRAP_KIND_ALWAYS);
  std::vector<Registered> out = RegisterAll(d, reqs);
  for (const Registered& r : out) {
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << r.status.error_message();
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

// One rank per daemon (world 1 in Single); every rank's daemon refuses the bad callers.
TEST_P(DaemonE2ETest, BadCallersAreRefused) {
  DaemonProcess d(GetParam());
  const int world = d.spanning_world();
  std::vector<uint64_t> s = JoinAll(d, "g", world);
  ASSERT_EQ(s.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    auto stub = d.Stub(r);
    struct Case {
      v1::Caller caller;
      grpc::StatusCode code;
      std::string text;
    };
    std::vector<Case> cases = {
        {MakeCaller("nope", r, s[r]), grpc::StatusCode::NOT_FOUND, "unknown group nope"},
        {MakeCaller("g", r, s[r], "bad"), grpc::StatusCode::PERMISSION_DENIED, "wrong token"},
        {MakeCaller("g", r, s[r] + 100), grpc::StatusCode::FAILED_PRECONDITION,
         "not the rank's current session"},
        {MakeCaller("g", 5, s[r]), grpc::StatusCode::INVALID_ARGUMENT, "rank 5 is out of range"},
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
    *req.mutable_caller() = MakeCaller("g", r, s[r]);
    req.set_registered_module("enc");
    v1::GetShardViewsResponse resp;
    grpc::Status st = stub->GetShardViews(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(st.error_message(), HasSubstr("module \"enc\" is not registered"));
  }
}

// One rank per daemon (world 1 in Single); the last rank (on the last daemon) is the victim:
// it leaves, a child process joins it again, holds its lease and is killed with SIGKILL.
TEST_P(DaemonE2ETest, KilledClientFreesItsRankAndShardsOutliveIt) {
  DaemonProcess d(GetParam());
  const int world = d.spanning_world();
  const int victim = world - 1;
  std::vector<uint64_t> s = JoinAll(d, "g", world);
  std::vector<v1::RegisterModuleRequest> reqs;
  for (int r = 0; r < world; ++r)
    reqs.push_back(RegisterRequest(MakeCaller("g", r, s[r]), "gpt_tied"));
  std::vector<Registered> out = RegisterAll(d, reqs);
  for (const Registered& r : out) ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const std::string shard_segment = out[victim].response.shards(0).shard().segment();
  {
    auto stub = d.Stub(victim);
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    *req.mutable_caller() = MakeCaller("g", victim, s[victim]);
    v1::LeaveResponse resp;
    grpc::Status left = stub->Leave(&ctx, req, &resp);
    ASSERT_TRUE(left.ok()) << left.error_message();
  }
  // The client runs in a fresh process (gRPC must not be used across fork): this test binary,
  // running only LeaseHolderChild.HoldLease.
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = ::flatshard::testing::SpawnSelf(
      "LeaseHolderChild.HoldLease",
      {"FS_E2E_SOCKET=" + d.SocketFor(victim), absl::StrCat("FS_E2E_READY_FD=", ready[1]),
       absl::StrCat("FS_E2E_WORLD=", world), absl::StrCat("FS_E2E_RANK=", victim),
       "FS_E2E_COORDINATOR=" + d.coordinator()});
  ASSERT_GT(child, 0);
  close(ready[1]);
  char c = 0;
  const bool started = read(ready[0], &c, 1) == 1;
  close(ready[0]);
  if (!started) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    FAIL() << "the lease-holding child did not start";
  }
  auto stub = d.Stub(victim);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Joined held = Join(stub.get(), "g", world, victim, "t0k", 200, d.coordinator());
  EXPECT_EQ(held.status.error_code(), grpc::StatusCode::ALREADY_EXISTS)
      << held.status.error_message();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  // The lease ends with the connection; the rank is free again within 2 s.
  Joined again;
  for (int i = 0; i < 40; ++i) {
    again = Join(stub.get(), "g", world, victim, "t0k", 1000, d.coordinator());
    if (again.status.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_THAT(again.response.registered_modules(), ::testing::ElementsAre(""));
  grpc::ClientContext ctx;
  v1::GetShardViewsRequest req;
  *req.mutable_caller() = MakeCaller("g", victim, again.response.session());
  v1::GetShardViewsResponse resp;
  grpc::Status views = stub->GetShardViews(&ctx, req, &resp);
  ASSERT_TRUE(views.ok()) << views.error_message();
  EXPECT_EQ(resp.shards(0).shard().segment(), shard_segment) << "re-attached to the same shard";
}

// ---- Summon, write back, gradients ----

v1::SummonOptions Options(bool writeback, bool rank0_only = false, bool with_grads = false,
                          bool recurse = true) {
  v1::SummonOptions o;
  o.set_recurse(recurse);
  o.set_writeback(writeback);
  o.set_rank0_only(rank0_only);
  o.set_with_grads(with_grads);
  return o;
}

struct Summoned {
  grpc::Status status;
  v1::SummonResponse response;
};

// Every rank summons `path` of module "" concurrently.
std::vector<Summoned> SummonAll(DaemonProcess& d, const std::vector<v1::Caller>& callers,
                                const v1::SummonOptions& options, const std::string& path = "") {
  std::vector<std::future<Summoned>> futures;
  for (const v1::Caller& c : callers) {
    futures.push_back(std::async(std::launch::async, [&d, c, options, path] {
      auto stub = d.Stub(c.rank());
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::SummonRequest req;
      *req.mutable_caller() = c;
      req.set_path(path);
      *req.mutable_options() = options;
      Summoned out;
      out.status = stub->Summon(&ctx, req, &out.response);
      return out;
    }));
  }
  std::vector<Summoned> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

std::vector<grpc::Status> EndAll(DaemonProcess& d, const std::vector<v1::Caller>& callers,
                                 const std::vector<Summoned>& summons) {
  std::vector<std::future<grpc::Status>> futures;
  for (size_t r = 0; r < callers.size(); ++r) {
    futures.push_back(std::async(std::launch::async, [&d, &callers, &summons, r] {
      auto stub = d.Stub(callers[r].rank());
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::EndSummonRequest req;
      *req.mutable_caller() = callers[r];
      req.set_summon(summons[r].response.summon());
      v1::EndSummonResponse resp;
      return stub->EndSummon(&ctx, req, &resp);
    }));
  }
  std::vector<grpc::Status> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

// Maps a handle and returns its floats.
float* MapFloats(const v1::MemoryHandle& h, std::vector<ShmSegment>* keep) {
  absl::StatusOr<ShmSegment> seg = ShmSegment::Open(h.segment(), h.segment_bytes(), true);
  EXPECT_TRUE(seg.ok()) << seg.status();
  keep->push_back(*std::move(seg));
  return reinterpret_cast<float*>(static_cast<char*>(keep->back().data()) + h.offset());
}

// A group `group` of `world` ranks with examples/models/<model> registered (zeros).
struct Fixture {
  std::vector<v1::Caller> callers;
  Plan plan;
};

Fixture JoinAndRegister(DaemonProcess& d, int world, const std::string& model = "gpt_tied",
                        const std::string& group = "g") {
  Fixture f;
  std::vector<uint64_t> s = JoinAll(d, group, world);
  std::vector<v1::RegisterModuleRequest> reqs;
  for (int r = 0; r < world; ++r) {
    f.callers.push_back(MakeCaller(group, r, s[r]));
    reqs.push_back(RegisterRequest(f.callers.back(), model));
  }
  std::vector<Registered> out = RegisterAll(d, reqs);
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(out[r].status.ok()) << "rank " << r << ": " << out[r].status.error_message();
  }
  // A failed registration leaves the plan empty; the test's next collective then fails.
  if (absl::StatusOr<Plan> plan = FromProto(out[0].response.plan()); plan.ok()) {
    f.plan = *std::move(plan);
  }
  return f;
}

TEST_P(DaemonSummonTest, WritebackPersistsOnlyEachRanksOwnRange) {
  DaemonProcess d(GetParam());
  Fixture f = JoinAndRegister(d, 2);
  std::vector<Summoned> s = SummonAll(d, f.callers, Options(/*writeback=*/true));
  ASSERT_TRUE(s[0].status.ok() && s[1].status.ok()) << s[0].status.error_message();
  ASSERT_EQ(s[0].response.units_size(), static_cast<int>(f.plan.units.size()));
  std::vector<ShmSegment> keep;
  for (int r = 0; r < 2; ++r) {
    for (const v1::UnitView& v : s[r].response.units()) {
      float* p = MapFloats(v.params(), &keep);
      const int64_t n = f.plan.units[v.unit()].padded_numel;
      for (int64_t i = 0; i < n; ++i) p[i] = 1.0f + r;  // rank r writes r+1 everywhere
    }
  }
  EXPECT_NE(s[0].response.units(0).params().segment(), s[1].response.units(0).params().segment());
  for (const grpc::Status& st : EndAll(d, f.callers, s)) EXPECT_TRUE(st.ok()) << st.error_message();

  // A read-only summon: one copy per node, shared by the ranks of a daemon.
  s = SummonAll(d, f.callers, Options(/*writeback=*/false));
  ASSERT_TRUE(s[0].status.ok() && s[1].status.ok()) << s[0].status.error_message();
  if (d.SameDaemon(0, 1)) {
    EXPECT_EQ(s[0].response.units(0).params().segment(), s[1].response.units(0).params().segment());
  } else {
    EXPECT_NE(s[0].response.units(0).params().segment(), s[1].response.units(0).params().segment());
  }
  for (const v1::UnitView& v : s[0].response.units()) {
    const PlanUnit& u = f.plan.units[v.unit()];
    float* p = MapFloats(v.params(), &keep);
    for (int64_t i = 0; i < u.numel; ++i) {
      const float want = i < u.shard_numel ? 1.0f : 2.0f;  // rank 0's range, then rank 1's
      ASSERT_EQ(p[i], want) << "unit " << u.index << " element " << i;
    }
  }
  for (const grpc::Status& st : EndAll(d, f.callers, s)) EXPECT_TRUE(st.ok());
}

// One rank per daemon (world 1 in Single); every rank sees the same refusals.
TEST_P(DaemonSummonTest, SummoningTwiceIsRefusedWithFsdpWording) {
  DaemonProcess d(GetParam());
  const int world = d.spanning_world();
  Fixture f = JoinAndRegister(d, world);
  std::vector<Summoned> s = SummonAll(d, f.callers, Options(false));
  for (const Summoned& x : s) ASSERT_TRUE(x.status.ok()) << x.status.error_message();
  std::vector<Summoned> again = SummonAll(d, f.callers, Options(false), "h.0");
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(again[r].status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << "rank " << r;
    EXPECT_THAT(again[r].status.error_message(),
                HasSubstr("Cannot manually unshard parameters when already unsharding parameters"));
  }
  for (const grpc::Status& st : EndAll(d, f.callers, s)) EXPECT_TRUE(st.ok()) << st.error_message();
  // recurse=false on a path that is not a unit root unshards nothing and says so.
  std::vector<Summoned> none = SummonAll(d, f.callers, Options(false, false, false, false), "h");
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(none[r].status.ok()) << "rank " << r << ": " << none[r].status.error_message();
    EXPECT_EQ(none[r].response.units_size(), 0);
    EXPECT_THAT(none[r].response.note(), HasSubstr("not a unit root"));
  }
  for (const grpc::Status& st : EndAll(d, f.callers, none))
    EXPECT_TRUE(st.ok()) << st.error_message();
  std::vector<Summoned> missing = SummonAll(d, f.callers, Options(false), "h.7");
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(missing[r].status.error_code(), grpc::StatusCode::NOT_FOUND)
        << "rank " << r << ": " << missing[r].status.error_message();
  }
}

TEST_P(DaemonSummonTest, Rank0OnlyWritebackReachesEveryShard) {
  DaemonProcess d(GetParam());
  Fixture f = JoinAndRegister(d, 3);
  std::vector<Summoned> s =
      SummonAll(d, f.callers, Options(/*writeback=*/true, /*rank0_only=*/true));
  for (const Summoned& x : s) ASSERT_TRUE(x.status.ok()) << x.status.error_message();
  EXPECT_GT(s[0].response.units_size(), 0);
  EXPECT_EQ(s[1].response.units_size(), 0);  // other ranks get (and allocate) nothing
  EXPECT_EQ(s[2].response.units_size(), 0);
  EXPECT_EQ(s[1].response.unit_indices_size(), s[0].response.units_size());
  std::vector<ShmSegment> keep;
  for (const v1::UnitView& v : s[0].response.units()) {
    float* p = MapFloats(v.params(), &keep);
    for (int64_t i = 0; i < f.plan.units[v.unit()].padded_numel; ++i) p[i] = 7.0f;
  }
  for (const grpc::Status& st : EndAll(d, f.callers, s)) EXPECT_TRUE(st.ok()) << st.error_message();
  s = SummonAll(d, f.callers, Options(false));
  ASSERT_TRUE(s[2].status.ok()) << s[2].status.error_message();
  EXPECT_GT(s[2].response.units_size(), 0);
  for (const v1::UnitView& v : s[2].response.units()) {
    float* p = MapFloats(v.params(), &keep);
    for (int64_t i = 0; i < f.plan.units[v.unit()].numel; ++i) ASSERT_EQ(p[i], 7.0f) << i;
  }
  EndAll(d, f.callers, s);
}

TEST_P(DaemonSummonTest, BuffersKeepTheirSegmentsAndGiveMemoryBackBetweenSummons) {
  DaemonProcess d(GetParam());
  Fixture f = JoinAndRegister(d, 2);
  std::vector<std::string> first;
  for (int round = 0; round < 3; ++round) {
    for (bool writeback : {true, false}) {
      std::vector<Summoned> s = SummonAll(d, f.callers, Options(writeback));
      ASSERT_TRUE(s[0].status.ok() && s[1].status.ok()) << s[0].status.error_message();
      std::vector<std::string> names;
      for (const Summoned& x : s) {
        for (const v1::UnitView& v : x.response.units()) names.push_back(v.params().segment());
      }
      if (round == 0 && writeback) first = names;
      if (writeback) {
        EXPECT_EQ(names, first) << "round " << round << ": a new segment per summon";
      }
      EndAll(d, f.callers, s);
    }
  }
  // Idle for a second, the kept buffers give their pages back: nothing stays beyond the partial
  // page a hole punch leaves in a buffer smaller than a page (these units are a few KiB).
  auto resident = [&] {
    int64_t bytes = 0;
    for (const std::string& name : first) {
      struct stat st;
      EXPECT_EQ(stat(("/dev/shm" + name).c_str(), &st), 0) << name;
      bytes += st.st_blocks * 512 > 4096 ? st.st_blocks * 512 : 0;
    }
    return bytes;
  };
  for (int i = 0; i < 100 && resident() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(resident(), 0);
}

TEST_P(DaemonSummonTest, InitialValuesFromEveryRankAndFromRank0) {
  for (v1::InitMode mode : {v1::INIT_MODE_FROM_EVERY_RANK, v1::INIT_MODE_FROM_RANK0}) {
    DaemonProcess d(GetParam());
    std::vector<uint64_t> sessions = JoinAll(d, "g", 2);
    std::vector<v1::Caller> callers = {MakeCaller("g", 0, sessions[0]),
                                       MakeCaller("g", 1, sessions[1])};
    std::vector<v1::RegisterModuleRequest> reqs;
    for (const v1::Caller& c : callers) {
      reqs.push_back(RegisterRequest(c, "gpt_tied"));
      reqs.back().set_init(mode);
    }
    std::vector<Registered> out = RegisterAll(d, reqs);
    ASSERT_TRUE(out[0].status.ok() && out[1].status.ok()) << out[0].status.error_message();
    const Plan plan = *FromProto(out[0].response.plan());
    const bool rank0 = mode == v1::INIT_MODE_FROM_RANK0;
    EXPECT_EQ(out[1].response.init_summon().units_size(),
              rank0 ? 0 : static_cast<int>(plan.units.size()));
    std::vector<ShmSegment> keep;
    std::vector<Summoned> init(2);
    for (int r = 0; r < 2; ++r) {
      init[r].response = out[r].response.init_summon();
      for (const v1::UnitView& v : init[r].response.units()) {
        float* p = MapFloats(v.params(), &keep);
        for (int64_t i = 0; i < plan.units[v.unit()].padded_numel; ++i)
          p[i] = rank0 ? 5.0f : 1.0f + r;
      }
    }
    // The init summon is open: summoning again first is refused.
    EXPECT_EQ(SummonAll(d, {callers[0]}, Options(false))[0].status.error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    for (const grpc::Status& st : EndAll(d, callers, init))
      EXPECT_TRUE(st.ok()) << st.error_message();
    std::vector<Summoned> s = SummonAll(d, callers, Options(false));
    ASSERT_TRUE(s[1].status.ok()) << s[1].status.error_message();
    for (const v1::UnitView& v : s[1].response.units()) {
      const PlanUnit& u = plan.units[v.unit()];
      float* p = MapFloats(v.params(), &keep);
      for (int64_t i = 0; i < u.numel; ++i) {
        const float want = rank0 ? 5.0f : (i < u.shard_numel ? 1.0f : 2.0f);
        ASSERT_EQ(p[i], want) << "mode " << mode << " unit " << u.index << " element " << i;
      }
    }
    EndAll(d, callers, s);
  }
}

// Every rank begins, writes `value(rank)` into its full gradient, and finishes.
void ReduceScatterAll(DaemonProcess& d, const Fixture& f, int32_t unit, v1::ReduceOp op,
                      bool accumulate, const std::function<float(int)>& value) {
  std::vector<std::future<void>> futures;
  for (size_t r = 0; r < f.callers.size(); ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      auto stub = d.Stub(f.callers[r].rank());
      v1::ReduceScatterGradsRequest req;
      *req.mutable_caller() = f.callers[r];
      req.set_unit(unit);
      req.set_begin(true);
      v1::ReduceScatterGradsResponse resp;
      grpc::ClientContext ctx1;
      grpc::Status begun = stub->ReduceScatterGrads(&ctx1, req, &resp);
      ASSERT_TRUE(begun.ok()) << begun.error_message();
      std::vector<ShmSegment> keep;
      float* p = MapFloats(resp.full_grad(), &keep);
      for (int64_t i = 0; i < f.plan.units[unit].padded_numel; ++i) p[i] = value(r);
      req.set_begin(false);
      req.set_op(op);
      req.set_accumulate(accumulate);
      grpc::ClientContext ctx2;
      ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      grpc::Status st = stub->ReduceScatterGrads(&ctx2, req, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }));
  }
  for (auto& fut : futures) fut.get();
}

TEST_P(DaemonGradTest, ReduceScatterSumAvgAccumulateAndWithGrads) {
  DaemonProcess d(GetParam());
  Fixture f = JoinAndRegister(d, 3);  // uneven: unit sizes are not multiples of 3
  const int32_t unit = 1;
  // Before any gradient: with_grads reports none.
  std::vector<Summoned> s = SummonAll(d, f.callers, Options(false, false, true));
  EXPECT_FALSE(s[0].response.units(unit).has_grads());
  EndAll(d, f.callers, s);

  auto check = [&](float want) {
    std::vector<Summoned> g = SummonAll(d, f.callers, Options(false, false, true));
    ASSERT_TRUE(g[0].status.ok()) << g[0].status.error_message();
    ASSERT_TRUE(g[0].response.units(unit).has_grads());
    std::vector<ShmSegment> keep;
    float* p = MapFloats(g[0].response.units(unit).grads(), &keep);
    for (int64_t i = 0; i < f.plan.units[unit].numel; ++i) ASSERT_FLOAT_EQ(p[i], want) << i;
    EndAll(d, f.callers, g);
  };
  ReduceScatterAll(d, f, unit, v1::REDUCE_OP_SUM, false, [](int r) { return 1.0f + r; });
  check(6.0f);  // 1 + 2 + 3
  ReduceScatterAll(d, f, unit, v1::REDUCE_OP_AVG, false, [](int r) { return 1.0f + r; });
  check(2.0f);
  ReduceScatterAll(d, f, unit, v1::REDUCE_OP_SUM, true, [](int) { return 0.5f; });
  check(3.5f);  // 2 + 1.5
}

// Issue 27: a trainer's call that allocates (held here by the daemon's testing hook) holds no
// gRPC callback thread (gRPC has as many as cores, at most 16, shared by every service): while
// one rank's begins are held, another trainer's calls are answered. Blocking opens of the
// hook's FIFOs synchronize; without RequestWorkers the other calls end DEADLINE_EXCEEDED.
TEST(DaemonBusyTest, HeldBeginsOfOneRankDoNotStallOtherTrainers) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("fse2e_hold", getpid());
  fs::create_directories(dir);
  const std::string fifo = (dir / "hold").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(mkfifo((fifo + ".held").c_str(), 0600), 0);
  DaemonProcess d(Layout::kSingle,
                  {"--testing_hold_begin_reduce_scatter=" + fifo, "--lease_timeout=300s"});
  Fixture slow = JoinAndRegister(d, 1, "gpt_tied", "slow");
  Fixture other = JoinAndRegister(d, 1, "gpt_tied", "other");
  auto stub = d.Stub(0);

  // More begins of one rank than gRPC has callback threads.
  constexpr int kBegins = 32;
  struct Call {
    grpc::ClientContext ctx;
    v1::ReduceScatterGradsRequest request;
    v1::ReduceScatterGradsResponse response;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Call>> begins;
  absl::Mutex mu;
  int answered = 0;
  for (int i = 0; i < kBegins; ++i) {
    begins.push_back(std::make_unique<Call>());
    Call* c = begins.back().get();
    c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    *c->request.mutable_caller() = slow.callers[0];
    c->request.set_unit(0);
    c->request.set_begin(true);
    stub->async()->ReduceScatterGrads(&c->ctx, &c->request, &c->response,
                                      [&mu, &answered, c](grpc::Status s) {
                                        absl::MutexLock lock(&mu);
                                        c->status = std::move(s);
                                        ++answered;
                                      });
  }
  // Returns once a begin reached the hook; its line follows.
  const int held = open((fifo + ".held").c_str(), O_RDONLY);
  ASSERT_GE(held, 0);
  char line[5];
  ASSERT_EQ(read(held, line, sizeof(line)), 5);

  // Another trainer, while the begin is held.
  grpc::ClientContext ping_ctx;
  ping_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::PingResponse pong;
  const grpc::Status ping = stub->Ping(&ping_ctx, v1::PingRequest(), &pong);
  grpc::ClientContext views_ctx;
  views_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetShardViewsRequest views_req;
  *views_req.mutable_caller() = other.callers[0];
  v1::GetShardViewsResponse views;
  const grpc::Status viewed = stub->GetShardViews(&views_ctx, views_req, &views);
  std::vector<Summoned> summoned = SummonAll(d, other.callers, Options(false, false, false));
  std::vector<grpc::Status> ended = EndAll(d, other.callers, summoned);
  // One rank's calls run one at a time, in order: the others wait behind the held one.
  int queued_bytes = -1;
  EXPECT_EQ(ioctl(held, FIONREAD, &queued_bytes), 0);

  const int release = open(fifo.c_str(), O_WRONLY);  // the held begin is the reader
  ASSERT_GE(release, 0);
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                        +[](int* n) { return *n == kBegins; }, &answered),
                                    absl::Seconds(120)));
  }
  close(release);
  close(held);
  fs::remove_all(dir);

  EXPECT_TRUE(ping.ok()) << ping.error_message();
  EXPECT_TRUE(viewed.ok()) << viewed.error_message();
  ASSERT_TRUE(summoned[0].status.ok()) << summoned[0].status.error_message();
  EXPECT_TRUE(ended[0].ok()) << ended[0].error_message();
  EXPECT_EQ(queued_bytes, 0);
  absl::MutexLock lock(&mu);
  for (int i = 0; i < answered; ++i) {
    EXPECT_TRUE(begins[i]->status.ok()) << i << ": " << begins[i]->status.error_message();
  }
}

// Runs only as the child of KilledClientFreesItsRankAndShardsOutliveIt: joins rank
// FS_E2E_RANK of group "g" (world FS_E2E_WORLD, coordinator FS_E2E_COORDINATOR), opens its
// lease, reports through the pipe, and waits to be killed.
TEST(LeaseHolderChild, HoldLease) {
  const char* socket = getenv("FS_E2E_SOCKET");
  const char* fd = getenv("FS_E2E_READY_FD");
  if (socket == nullptr || fd == nullptr) GTEST_SKIP() << "runs only as a child process";
  const char* world = getenv("FS_E2E_WORLD");
  const char* rank = getenv("FS_E2E_RANK");
  const char* coordinator = getenv("FS_E2E_COORDINATOR");
  const int w = world == nullptr ? 1 : atoi(world);
  const int r = rank == nullptr ? 0 : atoi(rank);
  auto channel =
      grpc::CreateChannel(std::string("unix:") + socket, grpc::InsecureChannelCredentials());
  auto stub = v1::ShardService::NewStub(channel);
  Joined j = Join(stub.get(), "g", w, r, "t0k", 10000, coordinator == nullptr ? "" : coordinator);
  if (!j.status.ok()) _exit(2);
  grpc::ClientContext ctx;
  auto lease = stub->Lease(&ctx);
  v1::LeaseRequest first;
  *first.mutable_caller() = MakeCaller("g", r, j.response.session());
  if (!lease->Write(first)) _exit(3);
  char c = 1;
  if (write(atoi(fd), &c, 1) != 1) _exit(4);
  pause();
  _exit(0);
}

// Single daemon only: this is about SIGTERM of *the* daemon of a local group (its socket, its
// segments, its waiting joins). What a dying daemon does to the other daemons of a group is
// in multi_daemon_test.cc.
TEST(DaemonSigtermTest, SigtermRemovesSocketAndSegments) {
  DaemonProcess d(Layout::kSingle);
  std::vector<uint64_t> s = JoinAll(d, "g", 1);
  std::vector<Registered> out =
      RegisterAll(d, {RegisterRequest(MakeCaller("g", 0, s[0]), "gpt_tied")});
  ASSERT_TRUE(out[0].status.ok());
  EXPECT_FALSE(d.daemon(0).Segments().empty());
  // A join that waits for a missing rank is failed, not left hanging, by the shutdown.
  auto stub = d.Stub(0);
  auto waiting = std::async(std::launch::async, [&] { return Join(stub.get(), "h", 2, 0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(d.daemon(0).Terminate(), 0);
  Joined j = waiting.get();
  EXPECT_FALSE(j.status.ok());
  EXPECT_FALSE(fs::exists(d.daemon(0).socket()));
  EXPECT_TRUE(d.daemon(0).Segments().empty());
}

INSTANTIATE_TEST_SUITE_P(Layouts, DaemonE2ETest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());
INSTANTIATE_TEST_SUITE_P(Layouts, DaemonSummonTest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());
INSTANTIATE_TEST_SUITE_P(Layouts, DaemonGradTest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());

}  // namespace
}  // namespace flatshard
