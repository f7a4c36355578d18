// Runs the built `flatshardctl` against a real flatshardd (tests/testing/daemon_process.h):
// status, groups, units, pending, drain and log-level, as tables and as --json, after trainers
// (the C++ client library, one Client per rank on its own thread) joined, registered and
// summoned; drain refusing joins and finishing once the open summons end, with the gRPC health
// service NOT_SERVING meanwhile; a daemon that is down; bad flags.

#include <pty.h>
#include <unistd.h>

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cli/ctl_runner.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::flatshard::testing::CtlResult;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::Lines;
using ::flatshard::testing::RunCtl;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

constexpr char kToken[] = "tok";

// Commands that talk to a daemon, with the arguments each needs.
const std::vector<std::vector<std::string>>& DaemonCommands() {
  static const auto* commands = new std::vector<std::vector<std::string>>{
      {"status"}, {"groups"},  {"units", "g"},        {"pending"},
      {"drain"},  {"undrain"}, {"log-level", "info"}, {"delete-group", "g"}};
  return *commands;
}

std::vector<std::string> With(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

nlohmann::json Json(const CtlResult& r) {
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

// The daemon's gRPC health of `service` ("": overall): 1 SERVING, 2 NOT_SERVING, -1 when the
// call failed.
int Health(const std::string& target, const std::string& service = "") {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  // HealthCheckRequest{service}: field 1, length-delimited (empty for "").
  std::string encoded;
  if (!service.empty()) {
    encoded.push_back(0x0a);
    encoded.push_back(static_cast<char>(service.size()));
    encoded += service;
  }
  grpc::Slice body(encoded);
  grpc::ByteBuffer request(&body, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  if (!done.get_future().get().ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status = 1 (enum)}: tag 0x08 and a one-byte varint.
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
}

// One trainer rank: a Client joined to group "g" with the whole example model registered.
struct Rank {
  std::unique_ptr<client::Client> client;
  client::RegisteredModule model;
  std::unique_ptr<client::SummonedParams> summon;
};

std::unique_ptr<client::Client> Connect(const DaemonProcess& d, absl::Duration join_timeout) {
  client::ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(10);
  options.join_timeout = join_timeout;
  options.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

void ForEachRank(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

class FlatshardctlAdminTest : public ::testing::Test {
 protected:
  FlatshardctlAdminTest()
      : daemon_([] {
          ::flatshard::testing::DaemonOptions o;
          o.tag_prefix = "fsctl";
          return o;
        }()) {}

  // `world` ranks join "g" and register gpt_tied.
  void JoinAndRegister(int world) {
    ranks_.resize(world);
    const std::string manifest = ::flatshard::testing::ExampleModelFile("gpt_tied", "manifest");
    const std::string policy = ::flatshard::testing::ExampleModelFile("gpt_tied", "policy");
    ForEachRank(world, [&](int r) {
      ranks_[r].client = Connect(daemon_, absl::Seconds(10));
      ASSERT_NE(ranks_[r].client, nullptr);
      ASSERT_TRUE(ranks_[r].client->Join("g", world, r, kToken).ok());
      absl::StatusOr<client::RegisteredModule> m =
          ranks_[r].client->Register("", manifest, policy, client::InitMode::kZeros);
      ASSERT_TRUE(m.ok()) << m.status();
      ranks_[r].model = *std::move(m);
    });
  }
  void SummonAll() {
    ForEachRank(static_cast<int>(ranks_.size()), [&](int r) {
      absl::StatusOr<std::unique_ptr<client::SummonedParams>> s =
          ranks_[r].client->Summon("", "", client::SummonOptions());
      ASSERT_TRUE(s.ok()) << s.status();
      ranks_[r].summon = *std::move(s);
    });
  }
  void EndAll() {
    ForEachRank(static_cast<int>(ranks_.size()), [&](int r) {
      if (ranks_[r].summon) {
        EXPECT_TRUE(ranks_[r].summon->End().ok());
      }
      ranks_[r].summon.reset();
    });
  }
  CtlResult Ctl(std::vector<std::string> args) {
    args.push_back("--socket=" + daemon_.socket());
    return RunCtl(args);
  }

  DaemonProcess daemon_;
  std::vector<Rank> ranks_;
};

TEST_F(FlatshardctlAdminTest, StatusAndGroupsAfterJoinAndRegister) {
  CtlResult r = Ctl({"status", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = Json(r);
  EXPECT_EQ(j["groups"], 0);
  EXPECT_EQ(j["draining"], false);
  EXPECT_EQ(j["memory"]["limit_bytes"], nullptr);
  EXPECT_TRUE(j["gpus"].empty()) << "a host daemon has no GPU pools";

  JoinAndRegister(2);
  r = Ctl({"status", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, IsEmpty());
  j = Json(r);
  for (const char* key : {"version", "pid", "node", "uptime_seconds", "backends", "peer_address",
                          "draining", "groups", "clients", "memory"}) {
    EXPECT_TRUE(j.contains(key)) << key << " in " << r.out;
  }
  EXPECT_EQ(j["pid"], daemon_.pid());
  EXPECT_EQ(j["groups"], 1);
  EXPECT_EQ(j["clients"], 2);
  EXPECT_EQ(j["draining"], false);
  EXPECT_EQ(j["peer_address"], "");
  EXPECT_THAT(j["backends"].get<std::vector<std::string>>(), Contains("inproc"));
  EXPECT_GT(j["memory"]["by_kind"]["shard"].get<int64_t>(), 0);
  EXPECT_EQ(j["memory"]["by_kind"]["unsharded"], 0);
  EXPECT_GE(j["memory"]["total_bytes"], j["memory"]["by_kind"]["shard"]);
  EXPECT_GT(j["memory"]["buffers"].get<int64_t>(), 0);

  r = Ctl({"status"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("version"), HasSubstr("inproc"), HasSubstr("no limit")));
  EXPECT_THAT(Lines(r.out), AllOf(Contains(::testing::MatchesRegex("groups +1")),
                                  Contains(::testing::MatchesRegex("clients +2")),
                                  Contains(::testing::MatchesRegex("draining +no")),
                                  Contains(::testing::MatchesRegex("  shard +[1-9][0-9]* B"))));

  r = Ctl({"groups", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = Json(r);
  ASSERT_EQ(j["groups"].size(), 1u) << r.out;
  const nlohmann::json& g = j["groups"][0];
  EXPECT_EQ(g["group"], "g");
  EXPECT_EQ(g["world_size"], 2);
  EXPECT_EQ(g["coordinator"], "");
  EXPECT_EQ(g["local_ranks"], nlohmann::json({0, 1}));
  EXPECT_EQ(g["joined_ranks"], nlohmann::json({0, 1}));
  EXPECT_EQ(g["registered_modules"], nlohmann::json({""}));
  EXPECT_EQ(g["status"], "OK");
  EXPECT_EQ(g["ranks"], nlohmann::json::parse(R"([{"rank": 0, "state": "joined"},
                                                 {"rank": 1, "state": "joined"}])"));

  r = Ctl({"groups"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  EXPECT_THAT(lines[0],
              StartsWith("GROUP  WORLD  EPOCH  COORDINATOR  LOCAL_RANKS  JOINED  DEPARTED"));
  EXPECT_THAT(lines[1], ::testing::MatchesRegex("g +2 +0 +- +0,1 +0,1 +- +\\(root\\) +OK"));

  // A rank that leaves is no longer a client or joined.
  ASSERT_TRUE(ranks_[1].client->Leave().ok());
  j = Json(Ctl({"groups", "--json"}));
  EXPECT_EQ(j["groups"][0]["joined_ranks"], nlohmann::json({0}));
  EXPECT_EQ(Json(Ctl({"status", "--json"}))["clients"], 1);
}

// A rank that called Leave shows as left (status LEFT, not an error code) until it joins
// again; one whose lease closed (the trainer went away) as lost, the status UNAVAILABLE.
TEST_F(FlatshardctlAdminTest, GroupsShowALeftRankAsLeftAndALostOneAsLost) {
  JoinAndRegister(2);
  ASSERT_TRUE(ranks_[1].client->Leave().ok());
  nlohmann::json g = Json(Ctl({"groups", "--json"}))["groups"][0];
  EXPECT_EQ(g["joined_ranks"], nlohmann::json({0}));
  EXPECT_EQ(g["ranks"], nlohmann::json::parse(R"([{"rank": 0, "state": "joined"},
                                                 {"rank": 1, "state": "left"}])"));
  EXPECT_EQ(g["status"], "LEFT: group g: rank 1's session left the group");
  CtlResult r = Ctl({"groups"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(Lines(r.out).size(), 2u) << r.out;
  EXPECT_THAT(Lines(r.out)[1],
              ::testing::MatchesRegex("g +2 +0 +- +0,1 +0 +1 left +\\(root\\) +LEFT: group g: "
                                      "rank 1's session left the group"));
  EXPECT_THAT(Ctl({"pending", "g"}).out, HasSubstr("status LEFT: "));

  // Joined again: no longer left.
  ASSERT_TRUE(ranks_[1].client->Join("g", 2, 1, kToken).ok());
  g = Json(Ctl({"groups", "--json"}))["groups"][0];
  EXPECT_EQ(g["joined_ranks"], nlohmann::json({0, 1}));
  EXPECT_EQ(g["ranks"], nlohmann::json::parse(R"([{"rank": 0, "state": "joined"},
                                                 {"rank": 1, "state": "joined"}])"));

  // Rank 0's client goes away without Leave: its lease closes and the daemon ends the session.
  ranks_[0].client.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Json(Ctl({"groups", "--json"}))["groups"][0]["joined_ranks"].size() != 1u &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  g = Json(Ctl({"groups", "--json"}))["groups"][0];
  EXPECT_EQ(g["ranks"], nlohmann::json::parse(R"([{"rank": 0, "state": "lost"},
                                                 {"rank": 1, "state": "joined"}])"));
  EXPECT_THAT(g["status"].get<std::string>(),
              StartsWith("UNAVAILABLE: group g: rank 0's session ended (its lease closed"));
  EXPECT_THAT(Lines(Ctl({"groups"}).out)[1], HasSubstr(" 0 lost "));
}

// delete-group refuses (exit 1, one line naming the joined rank, nothing changed) while a
// rank is joined, then removes the group with its shards: the daemon's segments are gone.
TEST_F(FlatshardctlAdminTest, DeleteGroupOnceEveryRankLeftFreesItsShards) {
  JoinAndRegister(2);
  const size_t segments = daemon_.Segments().size();
  ASSERT_GT(segments, 0u);
  ASSERT_TRUE(ranks_[0].client->Leave().ok());
  CtlResult r = Ctl({"delete-group", "g"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_EQ(r.err,
            "flatshardctl delete-group: group g: rank 1 is still joined; "
            "every rank must leave before the group can be deleted\n");
  EXPECT_EQ(daemon_.Segments().size(), segments) << "a refused delete changed something";
  EXPECT_EQ(Json(Ctl({"groups", "--json"}))["groups"].size(), 1u);

  ASSERT_TRUE(ranks_[1].client->Leave().ok());
  r = Ctl({"delete-group", "g", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = Json(r);
  EXPECT_EQ(j["group"], "g");
  EXPECT_EQ(j["modules"], nlohmann::json({""}));
  EXPECT_GE(j["freed_buffers"].get<int64_t>(), static_cast<int64_t>(segments));
  EXPECT_GT(j["freed_bytes"].get<int64_t>(), 0);
  EXPECT_TRUE(Json(Ctl({"groups", "--json"}))["groups"].empty());
  EXPECT_EQ(Json(Ctl({"status", "--json"}))["memory"]["total_bytes"], 0);
  EXPECT_THAT(daemon_.Segments(), IsEmpty()) << "the group's segments stayed";
  EXPECT_THAT(daemon_.Log(), HasSubstr("group=g deleted by uid"));

  r = Ctl({"delete-group", "g"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "flatshardctl delete-group: this daemon hosts no group g\n");
  // The name is free again: a new group starts with nothing registered.
  ranks_.clear();
  auto c = Connect(daemon_, absl::Seconds(10));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Join("g", 1, 0, kToken).ok());
  EXPECT_THAT(c->registered_modules(), IsEmpty());
  r = Ctl({"delete-group", "g"});
  ASSERT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("rank 0 is still joined"));
  EXPECT_THAT(RunCtl({"delete-group", "--help"}).out, HasSubstr("must have left"));
}

TEST(FlatshardctlGpuStatusTest, StatusShowsEachGpuPool) {
  ::flatshard::testing::DaemonOptions o;
  o.tag_prefix = "fsctlgpu";
  o.extra_flags = {"--simulate_gpus=2", "--gpu_memory_limit_mib=64"};
  DaemonProcess daemon(o);
  CtlResult r = RunCtl({"status", "--json", "--socket=" + daemon.socket()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["gpus"].size(), 2u) << r.out;
  EXPECT_EQ(j["gpus"][1]["device"], 1);
  EXPECT_EQ(j["gpus"][1]["uuid"], "SIM-GPU-1");
  EXPECT_EQ(j["gpus"][0]["limit_bytes"], int64_t{64} << 20);
  EXPECT_EQ(j["gpus"][0]["reserved_bytes"], 0);
  EXPECT_EQ(j["gpus"][0]["buffers"], 0);
  r = RunCtl({"status", "--socket=" + daemon.socket()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("gpu 0"), HasSubstr("gpu 1"), HasSubstr("SIM-GPU-1")));
}

TEST_F(FlatshardctlAdminTest, UnitsShowSummonedDuringASummonAndIdleAfter) {
  JoinAndRegister(2);
  const int units = static_cast<int>(ranks_[0].model.plan->units.size());
  ASSERT_GT(units, 1);
  CtlResult r = Ctl({"units", "g", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = Json(r);
  EXPECT_EQ(j["group"], "g");
  ASSERT_EQ(j["modules"].size(), 1u);
  EXPECT_EQ(j["modules"][0]["module"], "");
  // Registered with zeros: initialised, at the first committed generation.
  EXPECT_EQ(j["modules"][0]["initialized"], true);
  EXPECT_EQ(j["modules"][0]["generation"], 0);
  ASSERT_EQ(j["modules"][0]["units"].size(), static_cast<size_t>(units));
  for (const nlohmann::json& u : j["modules"][0]["units"]) {
    EXPECT_EQ(u["last_op"], nullptr);
    ASSERT_EQ(u["ranks"].size(), 2u);
    for (const nlohmann::json& rank : u["ranks"]) {
      EXPECT_EQ(rank["state"], "IDLE");
      EXPECT_GT(rank["shard_bytes"].get<int64_t>(), 0);
      EXPECT_EQ(rank["grad_bytes"], 0);
      EXPECT_EQ(rank["unsharded_bytes"], 0);
      EXPECT_EQ(rank["state_bytes"], 0);
    }
  }

  SummonAll();
  j = Json(Ctl({"units", "g", "--json", "--module="}));
  ASSERT_EQ(j["modules"].size(), 1u);
  for (const nlohmann::json& u : j["modules"][0]["units"]) {
    EXPECT_EQ(u["last_op"]["op"], "summon");
    EXPECT_EQ(u["last_op"]["ok"], true);
    EXPECT_GE(u["last_op"]["age_seconds"].get<double>(), 0.0);
    for (const nlohmann::json& rank : u["ranks"]) {
      EXPECT_EQ(rank["state"], "SUMMONED") << u;
      // The full padded buffer: world_size shards.
      EXPECT_EQ(rank["unsharded_bytes"].get<int64_t>(), 2 * rank["shard_bytes"].get<int64_t>());
    }
  }
  r = Ctl({"units", "g"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 2u + 2u * units) << r.out;
  EXPECT_EQ(lines[0], "group g  module (root)  " + std::to_string(units) + " units  generation 0");
  EXPECT_THAT(
      lines[1],
      ::testing::MatchesRegex(
          " +UNIT +MODULE +RANK +STATE +SHARD_B +GRAD_B +UNSHARDED_B +STATE_B +LAST_OP +AGE"));
  for (size_t i = 2; i < lines.size(); ++i) {
    EXPECT_THAT(lines[i], ::testing::MatchesRegex(" +[0-9]+ +[^ ]+ +[01] +SUMMONED +[0-9]+ +0 "
                                                  "+[1-9][0-9]* +0 +summon rank [01] +[0-9.]+s"));
  }

  EndAll();
  j = Json(Ctl({"units", "g", "--json"}));
  for (const nlohmann::json& u : j["modules"][0]["units"]) {
    EXPECT_EQ(u["last_op"]["op"], "end");
    for (const nlohmann::json& rank : u["ranks"]) {
      EXPECT_EQ(rank["state"], "IDLE");
      EXPECT_EQ(rank["unsharded_bytes"], 0);
    }
  }
  r = Ctl({"units", "g"});
  EXPECT_THAT(r.out, AllOf(HasSubstr("IDLE"), ::testing::Not(HasSubstr("SUMMONED"))));

  // A reduce-scatter of unit 1 gives both ranks a gradient shard.
  ForEachRank(2, [&](int rank) {
    absl::Status s = ranks_[rank].client->ReduceScatterGrads(
        "", 1, client::ReduceOp::kSum, false,
        [](client::PendingReduceScatter&) { return absl::OkStatus(); });
    EXPECT_TRUE(s.ok()) << s;
  });
  j = Json(Ctl({"units", "g", "--json"}));
  const nlohmann::json& unit1 = j["modules"][0]["units"][1];
  EXPECT_EQ(unit1["last_op"]["op"], "reduce_scatter");
  for (const nlohmann::json& rank : unit1["ranks"]) {
    EXPECT_EQ(rank["grad_bytes"], rank["shard_bytes"]);
  }
  // Optimizer state (RegisterState): a float32 shard-shaped state and an int64 scalar.
  ForEachRank(2, [&](int rank) {
    absl::StatusOr<client::ShardViews> v = ranks_[rank].client->RegisterState(
        "", {{"exp_avg", DType::kFloat32, client::StateShape::kShard},
             {"step", DType::kInt64, client::StateShape::kScalar}});
    EXPECT_TRUE(v.ok()) << v.status();
  });
  j = Json(Ctl({"units", "g", "--json"}));
  for (const nlohmann::json& u : j["modules"][0]["units"]) {
    for (const nlohmann::json& rank : u["ranks"]) {
      EXPECT_EQ(rank["state_bytes"].get<int64_t>(), rank["shard_bytes"].get<int64_t>() + 8);
    }
  }
  EXPECT_THAT(Ctl({"units", "g"}).out, HasSubstr("STATE_B"));

  r = Ctl({"units", "g", "--module", "h.0"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "flatshardctl units: group g: module \"h.0\" is not registered\n");
  r = Ctl({"units", "nope"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "flatshardctl units: this daemon hosts no group nope\n");
}

TEST_F(FlatshardctlAdminTest, PendingWithoutPendingCollectives) {
  JoinAndRegister(2);
  CtlResult r = Ctl({"pending", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = Json(r);
  ASSERT_EQ(j["groups"].size(), 1u);
  EXPECT_EQ(j["groups"][0]["group"], "g");
  EXPECT_EQ(j["groups"][0]["pending"], nlohmann::json::array());
  r = Ctl({"pending", "g"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out,
              AllOf(StartsWith("group g  world_size 2"), HasSubstr("no pending collectives")));
  r = Ctl({"pending", "nope"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "flatshardctl pending: this daemon hosts no group nope\n");
}

TEST_F(FlatshardctlAdminTest, DrainRefusesJoinsAndFinishesWhenTheSummonEnds) {
  JoinAndRegister(2);
  SummonAll();
  EXPECT_EQ(Health(daemon_.address()), 1);  // SERVING

  // With the summons open the drain times out, but draining has begun.
  CtlResult r = Ctl({"drain", "--timeout-ms", "300"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::MatchesRegex(
                         "drain timed out after [0-9]+\\.[0-9]s: 2 open summons, 0 pending "
                         "collectives, 0 pending joins still in flight\n"));
  EXPECT_EQ(Health(daemon_.address()), 2);  // NOT_SERVING
  // Liveness stays SERVING while draining: a drain must not get the daemon restarted.
  EXPECT_EQ(Health(daemon_.address(), "flatshard.liveness"), 1);
  EXPECT_EQ(Json(Ctl({"status", "--json"}))["draining"], true);

  // No new groups, no new joins.
  std::unique_ptr<client::Client> late = Connect(daemon_, absl::Seconds(1));
  ASSERT_NE(late, nullptr);
  absl::Status joined = late->Join("other", 1, 0, kToken);
  EXPECT_TRUE(absl::IsUnavailable(joined)) << joined;
  EXPECT_THAT(std::string(joined.message()), HasSubstr("flatshardd is draining"));
  EXPECT_EQ(Json(Ctl({"groups", "--json"}))["groups"].size(), 1u);

  // A drain that waits, its progress line on a terminal: it ends once the summons end.
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  ::flatshard::testing::CtlProcess p = ::flatshard::testing::StartCtl(
      {"drain", "--timeout-ms", "10000", "--socket", daemon_.socket()}, slave);
  close(slave);
  std::string terminal;
  auto read_terminal = std::async(std::launch::async, [master, &terminal] {
    char buf[4096];
    for (ssize_t n; (n = read(master, buf, sizeof(buf))) > 0;) terminal.append(buf, n);
  });
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_TRUE(::flatshard::testing::CtlRunning(p)) << "drain ended with summons open";
  EndAll();
  r = ::flatshard::testing::WaitCtl(p);
  read_terminal.wait();  // EIO once the last writer is gone
  close(master);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(terminal, HasSubstr("\r\033[Kdraining: 2 open summons, 0 pending collectives"));
  EXPECT_THAT(terminal, ::testing::ContainsRegex("drained: no work in flight after [0-9.]+s"));

  // Nothing in flight: a drain returns at once; JSON.
  r = Ctl({"drain", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = Json(r);
  EXPECT_EQ(j["done"], true);
  EXPECT_EQ(j["timed_out"], false);
  EXPECT_EQ(j["open_summons"], 0);
  EXPECT_EQ(j["pending_collectives"], 0);
  EXPECT_EQ(j["pending_joins"], 0);
  EXPECT_EQ(Health(daemon_.address()), 2);
}

// undrain returns a drained daemon to service: joins accepted, health SERVING, status not
// draining; on a daemon not draining it changes nothing and says so.
TEST_F(FlatshardctlAdminTest, UndrainAcceptsJoinsAgain) {
  CtlResult r = Ctl({"undrain"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "not draining: nothing to undo\n");

  r = Ctl({"drain", "--timeout-ms", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Health(daemon_.address()), 2);  // NOT_SERVING
  std::unique_ptr<client::Client> c = Connect(daemon_, absl::Seconds(5));
  ASSERT_NE(c, nullptr);
  absl::Status joined = c->Join("g", 1, 0, kToken);
  EXPECT_TRUE(absl::IsUnavailable(joined)) << joined;
  EXPECT_THAT(std::string(joined.message()), HasSubstr("flatshardd is draining"));

  r = Ctl({"undrain"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, IsEmpty());
  EXPECT_EQ(r.out, "undrained: new groups and joins are accepted again\n");
  EXPECT_EQ(Health(daemon_.address()), 1);  // SERVING
  EXPECT_EQ(Health(daemon_.address(), "flatshard.liveness"), 1);
  EXPECT_EQ(Json(Ctl({"status", "--json"}))["draining"], false);
  joined = c->Join("g", 1, 0, kToken);
  EXPECT_TRUE(joined.ok()) << joined;
  EXPECT_EQ(Json(Ctl({"groups", "--json"}))["groups"].size(), 1u);
  EXPECT_THAT(daemon_.Log(), HasSubstr("undrained: new groups and joins are accepted again"));

  // Idempotent; JSON. A second drain drains again.
  r = Ctl({"undrain", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Json(r), nlohmann::json({{"was_draining", false}, {"draining", false}}));
  ASSERT_EQ(Ctl({"drain", "--timeout-ms", "0"}).exit_code, 0);
  EXPECT_EQ(Health(daemon_.address()), 2);
  EXPECT_EQ(Json(Ctl({"status", "--json"}))["draining"], true);
  r = Ctl({"undrain", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Json(r), nlohmann::json({{"was_draining", true}, {"draining", false}}));
  EXPECT_EQ(Health(daemon_.address()), 1);
  EXPECT_THAT(RunCtl({"undrain", "--help"}).out, HasSubstr("accepts new groups and joins again"));
}

TEST_F(FlatshardctlAdminTest, LogLevel) {
  CtlResult r = Ctl({"log-level"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "log level info\n");
  r = Ctl({"log-level", "debug", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Json(r), nlohmann::json({{"previous", "info"}, {"level", "debug"}}));
  r = Ctl({"log-level", "WARNING"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "log level debug -> warning\n");
  EXPECT_THAT(daemon_.Log(),
              AllOf(HasSubstr("log level info -> debug"), HasSubstr("log level debug -> warning")));
  // At warning, joins and registrations no longer log.
  const std::string before = daemon_.Log();
  JoinAndRegister(1);
  EXPECT_EQ(daemon_.Log(), before);
  r = Ctl({"log-level", "v3"});
  EXPECT_EQ(r.out, "log level warning -> v3\n");
  EXPECT_THAT(daemon_.Log(), HasSubstr("log level warning -> v3"));
}

TEST_F(FlatshardctlAdminTest, DaemonDownIsOneLineAndExit1) {
  const std::string missing = daemon_.socket() + ".missing";
  for (const std::vector<std::string>& command : DaemonCommands()) {
    SCOPED_TRACE(command[0]);
    CtlResult r = RunCtl(With(command, {"--socket", missing}));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.out, IsEmpty());
    EXPECT_EQ(r.err, "flatshardctl " + command[0] + ": no daemon answering at unix:" + missing +
                         " (is flatshardd running?)\n");
  }
  // A killed daemon leaves its socket behind: nobody listens there.
  daemon_.Kill();
  for (const std::vector<std::string>& command : DaemonCommands()) {
    SCOPED_TRACE(command[0]);
    CtlResult r = Ctl(command);
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.out, IsEmpty());
    EXPECT_EQ(r.err, "flatshardctl " + command[0] + ": no daemon answering at unix:" +
                         daemon_.socket() + " (is flatshardd running?)\n");
  }
  CtlResult r = RunCtl({"status", "--address", "127.0.0.1:1", "--timeout-ms", "500"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err,
            "flatshardctl status: no daemon answering at 127.0.0.1:1 (is flatshardd running?)\n");
}

TEST(FlatshardctlAdminFlagsTest, BadFlagsExit2WithOneLine) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"status", "--bogus"}, "flatshardctl status: unknown flag --bogus"},
      {{"status", "extra"}, "flatshardctl status: unexpected argument 'extra'"},
      {{"groups", "--json=yes"}, "flatshardctl groups: flag --json takes no value"},
      {{"units"}, "flatshardctl units: GROUP is required (see flatshardctl units --help)"},
      {{"units", "a", "b"}, "flatshardctl units: unexpected argument 'b'"},
      {{"units", "g", "--module"}, "flatshardctl units: flag --module needs a value (M)"},
      {{"pending", "a", "b"}, "flatshardctl pending: unexpected argument 'b'"},
      {{"drain", "--timeout-ms", "soon"},
       "flatshardctl drain: --timeout-ms must be an integer in [0, 86400000], got 'soon'"},
      {{"log-level", "loud"},
       "flatshardctl log-level: LEVEL must be error, warning, info, debug or v0..v9, got 'loud'"},
      {{"status", "--socket", "/a", "--address", "b:1"},
       "flatshardctl status: give --socket or --address, not both"},
      {{"status", "-s"}, "flatshardctl status: unexpected argument '-s'"},
      {{"delete-group"},
       "flatshardctl delete-group: GROUP is required (see flatshardctl delete-group --help)"},
      {{"delete-group", "a", "b"}, "flatshardctl delete-group: unexpected argument 'b'"},
      {{"undrain", "now"}, "flatshardctl undrain: unexpected argument 'now'"},
  };
  for (const auto& [args, line] : cases) {
    SCOPED_TRACE(args[0] + " " + (args.size() > 1 ? args[1] : ""));
    CtlResult r = RunCtl(args);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_THAT(r.out, IsEmpty());
    EXPECT_EQ(r.err, line + "\n");
  }
}

TEST(FlatshardctlAdminFlagsTest, HelpEverywhere) {
  CtlResult top = RunCtl({"--help"});
  ASSERT_EQ(top.exit_code, 0);
  for (const char* command : {"plan", "status", "groups", "units", "pending", "drain", "undrain",
                              "log-level", "delete-group"}) {
    EXPECT_THAT(top.out, ::testing::ContainsRegex(std::string("\n  ") + command + " "));
  }
  for (const std::vector<std::string>& command : DaemonCommands()) {
    SCOPED_TRACE(command[0]);
    // --help wins over everything else and needs no daemon.
    CtlResult r = RunCtl(With(command, {"--socket", "/nonexistent.sock", "--help"}));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.err, IsEmpty());
    EXPECT_THAT(r.out, StartsWith("Usage: flatshardctl " + command[0]));
    for (const char* flag : {"--socket PATH", "--address HOST:PORT", "--timeout-ms N", "--json",
                             "--help", "Exit status"}) {
      EXPECT_THAT(r.out, HasSubstr(flag));
    }
  }
  EXPECT_THAT(RunCtl({"units", "--help"}).out, HasSubstr("--module M"));
}

}  // namespace
}  // namespace flatshard
