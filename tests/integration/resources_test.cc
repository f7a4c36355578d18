// Resources bounded and owned (issue 11), against a real flatshardd: groups nobody uses are
// reclaimed after --group_idle_timeout; the daemon raises its descriptor limit at start and
// refuses a registration beyond a segment quota cleanly, keeping nothing of it; a JoinGroup
// with world_size 2^20 costs the daemon little memory and its error stays short.

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kToken[] = "t0k";

DaemonOptions With(std::vector<std::string> flags) {
  DaemonOptions o;
  o.tag_prefix = "fsres";
  o.extra_flags = std::move(flags);
  return o;
}

std::unique_ptr<client::Client> Connect(const DaemonProcess& d) {
  client::ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(20);
  options.join_timeout = absl::Seconds(10);
  options.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// A model of `units` Linear modules of `numel` float32 parameters each, one unit apiece (the
// root holds nothing and makes no unit).
std::string ManyUnitsManifest(int units, int numel = 4) {
  std::string children;
  for (int i = 0; i < units; ++i) {
    absl::StrAppend(&children, i == 0 ? "" : ",", R"({"name": "l)", i, R"(", "module": {"id": )",
                    i + 1,
                    R"(, "type": "Linear", "bases": ["Module"], "children": [], "params": [)",
                    R"({"name": "weight", "id": )", i, R"(, "shape": [)", numel,
                    R"(], "dtype": "float32", "requires_grad": true}]}})");
  }
  return absl::StrCat(R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Net", )",
                      R"("bases": ["Module"], "params": [], "children": [)", children, "]}}");
}
constexpr char kLinearPolicy[] =
    R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})";

std::vector<std::string> GroupNames(const DaemonProcess& d) {
  auto stub = v1::AdminService::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListGroupsResponse resp;
  grpc::Status s = stub->ListGroups(&ctx, v1::ListGroupsRequest(), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  std::vector<std::string> out;
  for (const v1::GroupInfo& g : resp.groups()) out.push_back(g.group());
  return out;
}

// A line of /proc/<pid>/<file> that starts with `key`, or "".
std::string ProcLine(pid_t pid, const std::string& file, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/", file));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return line;
  }
  return "";
}

int64_t ResidentBytes(pid_t pid) {
  // "VmRSS:	   19348 kB"
  std::vector<std::string> parts =
      absl::StrSplit(ProcLine(pid, "status", "VmRSS:"), ' ', absl::SkipWhitespace());
  int64_t kb = 0;
  if (parts.size() >= 2) kb = std::stoll(parts[1]);
  return kb << 10;
}

TEST(GroupIdleTimeoutTest, AGroupWithoutSessionsIsReclaimedAndLogged) {
  DaemonProcess d(With({"--group_idle_timeout=1s"}));
  auto c = Connect(d);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Join("idle", 1, 0, kToken).ok());
  const std::string manifest = ::flatshard::testing::ExampleModelFile("gpt_tied", "manifest");
  const std::string policy = ::flatshard::testing::ExampleModelFile("gpt_tied", "policy");
  ASSERT_TRUE(c->Register("", manifest, policy, client::InitMode::kZeros).ok());
  ASSERT_FALSE(d.Segments().empty());
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_THAT(GroupNames(d), ::testing::ElementsAre("idle")) << "reclaimed with a live session";
  ASSERT_TRUE(c->Leave().ok());
  const absl::Time left = absl::Now();
  while (!GroupNames(d).empty() && absl::Now() - left < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT(GroupNames(d), IsEmpty());
  EXPECT_THAT(d.Segments(), IsEmpty());
  EXPECT_THAT(d.Log(),
              ::testing::ContainsRegex("group=idle reclaimed: no session for [0-9.]+m?s "
                                       "\\(--group_idle_timeout=1s\\); 1 registered modules"));
  // The name can be used again from scratch.
  ASSERT_TRUE(c->Join("idle", 1, 0, kToken).ok());
  EXPECT_THAT(c->registered_modules(), IsEmpty());
}

TEST(DescriptorBudgetTest, SoftLimitRaisedAtStartAndSegmentQuotaRefusesCleanly) {
  // The daemon inherits a low soft limit and raises it to the hard one.
  struct rlimit saved = {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max < 2048) GTEST_SKIP() << "hard descriptor limit " << saved.rlim_max;
  struct rlimit low = saved;
  low.rlim_cur = 1024;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::unique_ptr<DaemonProcess> d;
  d = std::make_unique<DaemonProcess>(With({"--max_segments_per_uid=150"}));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  const std::string limits = ProcLine(d->pid(), "limits", "Max open files");
  const std::vector<std::string> fields = absl::StrSplit(limits, ' ', absl::SkipWhitespace());
  ASSERT_GE(fields.size(), 5u) << limits;
  EXPECT_EQ(fields[3], fields[4]) << "soft limit not raised to the hard limit: " << limits;
  EXPECT_EQ(fields[4],
            saved.rlim_max == RLIM_INFINITY ? "unlimited" : absl::StrCat(saved.rlim_max));
  EXPECT_THAT(d->Log(), HasSubstr("(raised from 1024)"));

  // One tenant registers more units than its segment quota: refused naming the uid, the quota
  // and the usage; nothing of the registration stays.
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Join("big", 1, 0, kToken).ok());
  absl::StatusOr<client::RegisteredModule> m =
      c->Register("", ManyUnitsManifest(200), kLinearPolicy, client::InitMode::kZeros);
  ASSERT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted) << m.status();
  EXPECT_THAT(
      std::string(m.status().message()),
      ::testing::MatchesRegex(absl::StrCat(".*uid ", ::geteuid(),
                                           " cannot allocate shard memory .*: it has 150 "
                                           "shared-memory segments open, its segment quota is 150 "
                                           "\\(--max_segments_per_uid\\).*")));
  EXPECT_THAT(d->Segments(), IsEmpty()) << "the refused registration left segments";
  // The daemon still serves: a model within the quota registers.
  absl::StatusOr<client::RegisteredModule> small =
      c->Register("", ManyUnitsManifest(20), kLinearPolicy, client::InitMode::kZeros);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->plan->units.size(), 20u);
}

// Before: one JoinGroup with world_size 2^20 took the daemon from ~19 MB to ~750 MB resident,
// four to 3 GB.
TEST(HugeWorldSizeTest, JoinsNobodyCompletesCostTheDaemonLittleAndSayWhoIsMissingBriefly) {
  DaemonProcess d(With({}));
  auto channel = grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::ShardService::NewStub(channel);
  {
    // Warm up the daemon's gRPC paths with a small join first.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    v1::JoinGroupRequest req;
    req.set_group("warm");
    req.set_world_size(2);
    req.set_token(kToken);
    v1::JoinGroupResponse resp;
    stub->JoinGroup(&ctx, req, &resp);
  }
  const int64_t before = ResidentBytes(d.pid());
  std::vector<std::future<grpc::Status>> joins;
  for (int i = 0; i < 4; ++i) {
    joins.push_back(std::async(std::launch::async, [&stub, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
      v1::JoinGroupRequest req;
      req.set_group(absl::StrCat("huge", i));
      req.set_world_size(1 << 20);
      req.set_rank(5);
      req.set_token(kToken);
      v1::JoinGroupResponse resp;
      return stub->JoinGroup(&ctx, req, &resp);
    }));
  }
  absl::SleepFor(absl::Seconds(1));
  const int64_t during = ResidentBytes(d.pid());
  EXPECT_THAT(GroupNames(d), ::testing::IsSupersetOf({"huge0", "huge1", "huge2", "huge3"}));
  for (auto& j : joins) {
    grpc::Status s = j.get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    if (!s.error_message().empty()) {
      EXPECT_LT(s.error_message().size(), 400u) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("(1048575 ranks) of 1048576 did not join"));
    }
  }
  std::printf("4 pending joins of world_size 2^20: daemon resident %.1f MiB -> %.1f MiB\n",
              before / 1048576.0, during / 1048576.0);
  EXPECT_LT(during - before, int64_t{64} << 20)
      << "4 pending joins of world_size 2^20 grew the daemon from " << (before >> 20) << " MiB to "
      << (during >> 20) << " MiB";
}

}  // namespace
}  // namespace flatshard
