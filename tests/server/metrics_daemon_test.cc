// A real flatshardd with --metrics_address: a group joins, registers, summons, commits and
// saves and loads a checkpoint through the client library; scrapes over a plain socket show
// the RPCs, collectives, memory, groups, clients, commits, checkpoints and process metrics
// move. Also checks --log_format=json lines and the daemon's log level flag.

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "flatshard/client.h"
#include "flatshard/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/metrics_scrape.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

using ::flatshard::testing::ParseMetrics;
using ::flatshard::testing::ScrapeMetrics;

void ForEachRank(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

TEST(MetricsDaemonTest, ScrapesShowRpcsCollectivesMemoryGroupsAndClients) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("fsmetrics", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string address_file = (dir / "metrics_address").string();
  testing::DaemonOptions options;
  options.tag_prefix = "fsmetrics";
  options.extra_flags = {"--metrics_address=127.0.0.1:0", "--metrics_address_file=" + address_file,
                         "--log_format=json"};
  testing::DaemonProcess daemon(options);
  ASSERT_TRUE(daemon.running());
  for (int i = 0; i < 500 && !std::filesystem::exists(address_file); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string metrics_address;
  std::getline(std::ifstream(address_file), metrics_address);
  ASSERT_THAT(metrics_address, ::testing::StartsWith("127.0.0.1:"));

  const std::string before_text = ScrapeMetrics(metrics_address);
  ASSERT_THAT(before_text, ::testing::StartsWith("HTTP/1.1 200 OK"));
  ASSERT_THAT(before_text, HasSubstr("text/plain; version=0.0.4"));
  std::map<std::string, double> before = ParseMetrics(before_text);
  EXPECT_EQ(before["flatshard_groups"], 0);
  EXPECT_EQ(before["flatshard_clients"], 0);
  EXPECT_EQ(before["flatshard_memory_bytes{kind=\"shard\"}"], 0);
  EXPECT_EQ(before.count("flatshard_aborted_collectives_total"), 1u);
  EXPECT_EQ(before["flatshard_commits_total{code=\"OK\"}"], 0);
  EXPECT_EQ(before["flatshard_commit_bytes_total"], 0);
  EXPECT_EQ(before["flatshard_commit_duration_seconds_count"], 0);
  // Build info: one sample, value 1, with the version this test was built with.
  int build_info = 0;
  for (const auto& [name, v] : before) {
    if (!absl::StartsWith(name, "flatshard_build_info{")) continue;
    ++build_info;
    EXPECT_EQ(v, 1);
    EXPECT_THAT(name, HasSubstr(absl::StrCat("version=\"", FLATSHARD_VERSION_STRING, "\"")));
    EXPECT_THAT(name, HasSubstr("commit=\""));
  }
  EXPECT_EQ(build_info, 1) << before_text;
  // process_* from /proc/self: plausible for a daemon that just started.
  EXPECT_GT(before["process_resident_memory_bytes"], 1 << 20);
  EXPECT_GE(before["process_virtual_memory_bytes"], before["process_resident_memory_bytes"]);
  EXPECT_GE(before["process_open_fds"], 3);
  EXPECT_GT(before["process_max_fds"], before["process_open_fds"]);
  EXPECT_GE(before["process_cpu_seconds_total"], 0);
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_GT(before["process_start_time_seconds"], now - 120);
  EXPECT_LE(before["process_start_time_seconds"], now + 1);
  EXPECT_THAT(before_text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));

  constexpr int kWorld = 2;
  const std::string manifest = testing::ExampleModelFile("gpt_tied", "manifest");
  const std::string policy = testing::ExampleModelFile("gpt_tied", "policy");
  std::vector<std::unique_ptr<client::Client>> clients(kWorld);
  int64_t shard_bytes = 0;  // one rank's, from the plan
  ForEachRank(kWorld, [&](int r) {
    client::ClientOptions o;
    o.address = daemon.address();
    o.call_timeout = absl::Seconds(10);
    o.join_timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients[r] = *std::move(c);
    ASSERT_TRUE(clients[r]->Join("metrics-job", kWorld, r, "tok").ok());
    absl::StatusOr<client::RegisteredModule> m =
        clients[r]->Register("", manifest, policy, client::InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_NE(m->layout, nullptr);
    if (r == 0) {
      for (const client::PlanLayout::Unit& u : m->layout->units) {
        shard_bytes += u.shard_numel * ItemSize(u.dtype);
      }
    }
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> s =
        clients[r]->Summon("", "", client::SummonOptions());
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE((*s)->End().ok());
    absl::StatusOr<uint64_t> generation = clients[r]->Commit("");
    ASSERT_TRUE(generation.ok()) << generation.status();
  });
  ASSERT_FALSE(::testing::Test::HasFailure());
  // A checkpoint of the committed step, then a load of it, from rank 0.
  const std::string ckpt = (dir / "ckpt").string();
  std::vector<std::pair<int64_t, int64_t>> progress;
  absl::StatusOr<client::Client::CheckpointInfo> saved = clients[0]->SaveCheckpoint(
      "", ckpt, [&](int64_t done, int64_t total) { progress.emplace_back(done, total); });
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().first, progress.back().second);
  absl::StatusOr<client::Client::CheckpointInfo> loaded = clients[0]->LoadCheckpoint("", ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_FALSE(clients[0]->LoadCheckpoint("", (dir / "no-such-ckpt").string()).ok());

  std::map<std::string, double> after = ParseMetrics(ScrapeMetrics(metrics_address));
  EXPECT_EQ(after["flatshard_rpcs_total{method=\"JoinGroup\",code=\"OK\"}"], kWorld);
  EXPECT_EQ(after["flatshard_rpcs_total{method=\"RegisterModule\",code=\"OK\"}"], kWorld);
  EXPECT_EQ(after["flatshard_rpcs_total{method=\"Summon\",code=\"OK\"}"], kWorld);
  EXPECT_EQ(after["flatshard_rpc_latency_seconds_count{method=\"Summon\"}"], kWorld);
  EXPECT_GT(after["flatshard_collectives_total{kind=\"AllGather\",status=\"OK\"}"], 0);
  EXPECT_GT(after["flatshard_collective_bytes_total{backend=\"inproc\"}"], 0);
  EXPECT_GT(after["flatshard_memory_bytes{kind=\"shard\"}"], 0);
  EXPECT_EQ(after["flatshard_groups"], 1);
  EXPECT_EQ(after["flatshard_clients"], kWorld);
  EXPECT_EQ(after["flatshard_memory_limit_bytes"], 0);
  EXPECT_EQ(after["flatshard_commits_total{code=\"OK\"}"], kWorld);
  EXPECT_EQ(after["flatshard_commit_duration_seconds_count"], kWorld);
  EXPECT_GT(after["flatshard_commit_duration_seconds_sum"], 0);
  // Each rank copies its shards into its committed copies (no optimizer state here).
  EXPECT_EQ(after["flatshard_commit_bytes_total"], kWorld * shard_bytes);
  EXPECT_GT(shard_bytes, 0);
  EXPECT_EQ(after["flatshard_checkpoints_total{kind=\"save\",code=\"OK\"}"], 1);
  EXPECT_EQ(after["flatshard_checkpoints_total{kind=\"load\",code=\"OK\"}"], 1);
  double failed_loads = 0;
  for (const auto& [name, v] : after) {
    if (absl::StartsWith(name, "flatshard_checkpoints_total{kind=\"load\"") &&
        !absl::StrContains(name, "code=\"OK\"")) {
      failed_loads += v;
    }
  }
  EXPECT_EQ(failed_loads, 1);
  EXPECT_EQ(after["flatshard_checkpoint_bytes_total{kind=\"save\"}"], saved->bytes);
  EXPECT_EQ(after["flatshard_checkpoint_bytes_total{kind=\"load\"}"], loaded->bytes);
  EXPECT_GT(saved->bytes, 0);
  EXPECT_EQ(after["flatshard_checkpoint_duration_seconds_count{kind=\"save\"}"], 1);
  EXPECT_EQ(after["flatshard_checkpoint_duration_seconds_count{kind=\"load\"}"], 2);
  EXPECT_GT(after["process_cpu_seconds_total"], 0);
  EXPECT_GE(after["process_cpu_seconds_total"], before["process_cpu_seconds_total"]);
  EXPECT_EQ(after["process_start_time_seconds"], before["process_start_time_seconds"]);

  // A refused call is counted with its code.
  EXPECT_FALSE(clients[0]->Summon("", "no.such.unit", client::SummonOptions()).ok());
  std::map<std::string, double> refused = ParseMetrics(ScrapeMetrics(metrics_address));
  double refused_calls = 0;
  for (const auto& [name, v] : refused) {
    if (name.rfind("flatshard_rpcs_total{method=\"Summon\"", 0) == 0 &&
        name.find("code=\"OK\"") == std::string::npos) {
      refused_calls += v;
    }
  }
  EXPECT_EQ(refused_calls, 1);

  clients.clear();  // leases end
  for (int i = 0; i < 200; ++i) {
    if (ParseMetrics(ScrapeMetrics(metrics_address))["flatshard_clients"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ParseMetrics(ScrapeMetrics(metrics_address))["flatshard_clients"], 0);

  EXPECT_EQ(daemon.Terminate(), 0);
  // --log_format=json: every line of the log is one JSON object; ids have their own keys.
  const std::string log = daemon.Log();
  bool saw_group_field = false;
  int json_lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    // (gRPC's own messages, if any, keep gRPC's format; ours are all JSON.)
    EXPECT_FALSE(line.size() > 5 && absl::StrContains("IWEF", line.substr(0, 1)) &&
                 absl::ascii_isdigit(line[1]) && absl::ascii_isdigit(line[4]) && line[5] == '-')
        << "a text-format line: " << line;
    if (!absl::StartsWith(line, "{\"ts\":")) continue;
    ++json_lines;
    EXPECT_EQ(line.back(), '}') << line;
    if (absl::StrContains(line, "\"group\":\"metrics-job\"")) saw_group_field = true;
  }
  EXPECT_GT(json_lines, 2);
  EXPECT_TRUE(saw_group_field) << log;
  std::filesystem::remove_all(dir);
}

TEST(MetricsDaemonTest, BadFlagsAreRefusedAtStartup) {
  const std::string bin = std::string(FS_BINARY_DIR) + "/server/flatshardd";
  const std::string sock =
      (std::filesystem::temp_directory_path() / absl::StrCat("fsmbad", ::getpid(), ".sock"))
          .string();
  for (const char* flag : {"--metrics_address=nonsense", "--log_level=loud", "--log_format=xml"}) {
    const std::string cmd = absl::StrCat(bin, " --socket=", sock, " --ephemeral ", flag,
                                         " --segment_prefix=fsmbad 2>/dev/null");
    EXPECT_NE(std::system(cmd.c_str()), 0) << flag;
  }
}

}  // namespace
}  // namespace flatshard
