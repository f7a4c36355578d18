// Published weights (issue 25, README "Publishing weights") end to end: real flatshardd
// processes, the C++ client as trainers (Client::Publish) and as readers (WeightsReader).
//   - a version holds the committed step, element for element, in the state_dict layout
//     (tied parameters under every key, sharing bytes), cast when asked; live changes that
//     were not committed never show;
//   - readers map it read-only; a lease keeps a version past keep-K, its end (also a reader
//     killed with SIGKILL) frees it; Drop; watch wakes on a new version;
//   - named errors: unknown names and versions, other owners, ranks that disagree or do not
//     call, a uid quota too small, a daemon restart (groups on several daemons:
//     weights_multi_test);
//   - a publisher killed with SIGKILL at random points leaves no partial version.

#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "common/checkpoint/checkpoint.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/weights_testing.h"
#include "tests/testing/cluster.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/metrics_scrape.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/run_as_user.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::Layout;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

using weights_testing::At;
using weights_testing::Connect;
using weights_testing::ExpectHolds;
using weights_testing::FillShards;
using weights_testing::kToken;
using weights_testing::Options;
using weights_testing::Pattern;
using weights_testing::Reader;
using weights_testing::Trainers;
using weights_testing::Versions;

TEST(WeightsTest, PublishesTheCommittedStepInStateDictLayoutAndCasts) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 2, "pub");
  t.Step(1, /*commit=*/true);
  t.Step(2, /*commit=*/false);  // live only: a version never shows it
  auto published = t.Publish("gpt");
  for (const auto& p : published) {
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->version, 1u);
    EXPECT_EQ(p->generation, 1u);
    EXPECT_EQ(p->owner_uid, static_cast<int64_t>(::getuid()));
  }
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, 1u);
  EXPECT_EQ((*v)->info().bytes, published[0]->bytes);
  ExpectHolds(*t.plan, t.manifest, **v, 1);

  // The mapping is read-only: a write faults (in a child, which dies of it).
  const pid_t child = fork();
  if (child == 0) {
    *static_cast<volatile char*>(const_cast<void*>((*v)->tensors()[0].data)) = 1;
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) << status;

  // Cast to bfloat16, after the next commit.
  t.Step(3, /*commit=*/true);
  PublishOptions o;
  o.dtype = DType::kBFloat16;
  for (const auto& p : t.Publish("gpt", o)) ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::unique_ptr<WeightsVersion>> cast = r->Open("gpt");
  ASSERT_TRUE(cast.ok()) << cast.status();
  EXPECT_EQ((*cast)->info().version, 2u);
  EXPECT_EQ((*cast)->info().generation, 2u);
  ExpectHolds(*t.plan, t.manifest, **cast, 3, /*bf16=*/true);
  // Version 1 is still open and unchanged.
  ExpectHolds(*t.plan, t.manifest, **v, 1);
}

// Device shards (flatshardd --simulate_gpus: the daemon's GPU code paths over host memory):
// the committed copies are copied to host through the device context; the version is host.
TEST(WeightsTest, PublishesDeviceShardsOfASimulatedGpuDaemon) {
  ::flatshard::testing::ClusterOptions o;
  o.extra_flags = {"--simulate_gpus=2"};
  Cluster d(Layout::kSingle, o);
  Trainers t(d, 2, "gpu", /*simulated_gpus=*/true);
  absl::StatusOr<ShardViews> views = t.c[0]->GetShardViews("");
  ASSERT_TRUE(views.ok()) << views.status();
  ASSERT_GE(views->units().front().device, 0) << "the shards should be device memory";
  t.Step(1, /*commit=*/true);
  for (const auto& p : t.Publish("gpt")) ASSERT_TRUE(p.ok()) << p.status();
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->tensors()[0].device, -1);
  ExpectHolds(*t.plan, t.manifest, **v, 1);
}

// flatshardctl weights list / inspect / drop, with --json.
std::string RunCtl(const std::string& cmd, int* exit_code) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
  const int status = pclose(f);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

TEST(WeightsTest, FlatshardctlListsInspectsAndDrops) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 1, "ctl");
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt")[0].ok());
  const std::string ctl = absl::StrCat(std::string(FS_BINARY_DIR), "/client/flatshardctl weights ");
  const std::string sock = absl::StrCat(" --socket ", d.SocketFor(0));
  int code = -1;
  std::string out = RunCtl(ctl + "list --json" + sock, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("\"name\": \"gpt\""));
  EXPECT_THAT(out, HasSubstr("\"version\": 1"));
  EXPECT_THAT(out, HasSubstr("\"group\": \"ctl\""));
  out = RunCtl(ctl + "inspect gpt" + sock, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(t.plan->units[0].params[0].fqn));
  EXPECT_THAT(out, HasSubstr("float32"));
  out = RunCtl(ctl + "inspect gpt --version 9" + sock + " 2>&1", &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("no version 9"));
  out = RunCtl(ctl + "drop gpt --version 1 --json" + sock, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("\"dropped\": 1"));
  out = RunCtl(ctl + "list" + sock, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("no published weights"));
  out = RunCtl(ctl + "frobnicate" + sock + " 2>&1", &code);
  EXPECT_EQ(code, 2) << out;
}

TEST(WeightsTest, KeepsTheNewestAndWhatReadersHoldAndFreesTheRest) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 1, "keep");
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt")[0].ok());
  absl::StatusOr<std::unique_ptr<WeightsVersion>> held = r->Open("gpt", At(1));
  ASSERT_TRUE(held.ok()) << held.status();
  const size_t segments = d.daemon(0).Segments().size();
  for (int s = 2; s <= 4; ++s) {
    t.Step(s, true);
    ASSERT_TRUE(t.Publish("gpt")[0].ok());
  }
  // keep 2 (3, 4) plus version 1, held by the reader; version 2 is gone (its segment is
  // the name's spare, for version 5).
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(1, 3, 4));
  EXPECT_EQ(d.daemon(0).Segments().size(), segments + 3);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> gone = r->Open("gpt", At(2));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.status().message(), HasSubstr("no version 2 (versions here: 1, 3, 4)"));
  ExpectHolds(*t.plan, t.manifest, **held, 1);
  ASSERT_TRUE((*held)->Release().ok());
  for (int i = 0; i < 100 && Versions(*r, "gpt").size() != 2; ++i)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(3, 4));
  // Version 1's segment replaced version 2's as the spare.
  EXPECT_EQ(d.daemon(0).Segments().size(), segments + 2);
  // Numbers are never reused.
  t.Step(5, true);
  auto p = t.Publish("gpt");
  ASSERT_TRUE(p[0].ok());
  EXPECT_EQ(p[0]->version, 5u);
}

TEST(WeightsTest, NamesUnknownNamesVersionsOwnersAndBadArguments) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 2, "errs");
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("nothing");
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(v.status().message(), HasSubstr("no published weights \"nothing\""));
  t.Step(1, true);
  for (const auto& p : t.Publish("gpt")) ASSERT_TRUE(p.ok()) << p.status();
  v = r->Open("gpt", At(7));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(v.status().message(), HasSubstr("no version 7 (versions here: 1)"));
  OpenWeightsOptions other;
  other.owner_uid = 4242;
  v = r->Open("gpt", other);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(v.status().message(), HasSubstr("uid 4242"));

  // Ranks that disagree: nobody publishes, both hear which rank and field.
  std::vector<absl::StatusOr<PublishedVersion>> out(2, absl::UnknownError(""));
  RunRanks(2, [&](int rank) {
    PublishOptions o;
    if (rank == 1) o.dtype = DType::kFloat16;
    out[rank] = t.c[rank]->Publish("", "gpt", o);
  });
  for (const auto& p : out) {
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("options.dtype"));
  }
  // A rank that does not call: DEADLINE_EXCEEDED naming it.
  ClientOptions quick = Options(d.AddressFor(0));
  quick.call_timeout = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<Client>> alone = Client::Connect(quick);
  ASSERT_TRUE(alone.ok());
  ASSERT_TRUE(t.c[0]->Leave().ok());
  ASSERT_TRUE((*alone)->Join("errs", 2, 0, kToken).ok());
  absl::StatusOr<PublishedVersion> late = (*alone)->Publish("", "gpt");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_THAT(late.status().message(), HasSubstr("rank(s) 1 did not call Publish"));
  // Bad arguments before any RPC.
  PublishOptions bad;
  bad.dtype = DType::kInt32;
  EXPECT_EQ((*alone)->Publish("", "gpt", bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*alone)->Publish("", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(1));
}

TEST(WeightsTest, WatchWakesOnANewVersionAndDropRemoves) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 1, "watch");
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  absl::StatusOr<PublishedVersion> none = r->WaitForVersion("gpt", 0, absl::Milliseconds(300));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  absl::StatusOr<PublishedVersion> seen = absl::UnknownError("");
  std::thread watcher([&] { seen = r->WaitForVersion("gpt", 0, absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(200));
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt")[0].ok());
  watcher.join();
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->version, 1u);
  EXPECT_EQ(seen->generation, 1u);
  // Already there: answered at once.
  absl::StatusOr<PublishedVersion> again = r->WaitForVersion("gpt", 0, absl::Seconds(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->version, 1u);
  none = r->WaitForVersion("gpt", 1, absl::Milliseconds(200));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(none.status().message(), HasSubstr("newer than 1"));
}

TEST(WeightsTest, QuotaTooSmallRefusesNamingTheUidAndPublishesNothing) {
  // One 768 KiB parameter: shard and committed copy fit a 2 MiB quota, a version does not.
  constexpr char kManifest[] =
      R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Linear",
          "bases": ["Module"], "children": [], "params": [{"name": "weight", "id": 0,
          "shape": [384, 512], "dtype": "float32", "requires_grad": true}]}})";
  ::flatshard::testing::ClusterOptions o;
  o.extra_flags = {"--memory_quota_mib_per_uid=2"};
  Cluster d(Layout::kSingle, o);
  std::unique_ptr<Client> c = Connect(d.AddressFor(0));
  ASSERT_TRUE(c->Join("quota", 1, 0, kToken).ok());
  absl::StatusOr<RegisteredModule> m =
      c->Register("", kManifest, R"({"format": "flatshard.policy/1"})", InitMode::kZeros);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(c->Commit("").ok());
  const size_t segments = d.daemon(0).Segments().size();
  absl::StatusOr<PublishedVersion> p = c->Publish("", "big");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr(absl::StrCat("uid ", ::getuid())));
  EXPECT_THAT(p.status().message(), HasSubstr("quota"));
  EXPECT_THAT(p.status().message(), HasSubstr("weights \"big\""));
  EXPECT_EQ(d.daemon(0).Segments().size(), segments);
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  EXPECT_TRUE(Versions(*r, "big").empty());
}

TEST(WeightsTest, VersionsDoNotSurviveARestartAndReadersAreToldSo) {
  Cluster d(Layout::kSingle);
  {
    Trainers t(d, 1, "restart");
    t.Step(1, true);
    ASSERT_TRUE(t.Publish("gpt")[0].ok());
  }
  d.Kill(0);
  ASSERT_TRUE(d.Restart(0));
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(v.status().message(),
              HasSubstr("survive a daemon restart unless it runs with --ephemeral"));
}

// Whether a stored weights file in `state`/weights holds `version` (its JSON header line).
bool StoredHolds(const std::string& state, uint64_t version) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(state + "/weights", ec)) {
    if (e.path().extension() != ".weights") continue;
    std::string head(4096, '\0');
    std::ifstream(e.path()).read(head.data(), head.size());
    const std::string want = absl::StrCat("\"version\":", version);
    const size_t at = head.find(want);
    if (at != std::string::npos &&
        !std::isdigit(static_cast<unsigned char>(head[at + want.size()]))) {
      return true;
    }
  }
  return false;
}

TEST(WeightsTest, WithAStateDirTheNewestVersionSurvivesAKill) {
  char tmpl[] = "/tmp/fsw-state.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string state = tmpl;
  ::flatshard::testing::ClusterOptions o;
  o.extra_flags = {absl::StrCat("--state_dir=", state)};
  {
    Cluster d(Layout::kSingle, o);
    std::shared_ptr<const Plan> plan;
    std::string manifest;
    {
      Trainers t(d, 2, "durable");
      plan = t.plan;
      manifest = t.manifest;
      t.Step(1, true);
      for (const auto& p : t.Publish("gpt")) ASSERT_TRUE(p.ok()) << p.status();
      t.Step(2, true);
      PublishOptions grant;
      grant.reader_token = "t0k";
      grant.dtype = DType::kBFloat16;
      for (const auto& p : t.Publish("gpt", grant)) ASSERT_TRUE(p.ok()) << p.status();
    }
    // Publish answers before the version is stored: wait for its file.
    for (int i = 0; i < 500 && !StoredHolds(state, 2); ++i) absl::SleepFor(absl::Milliseconds(10));
    ASSERT_TRUE(StoredHolds(state, 2));
    d.Kill(0);
    ASSERT_TRUE(d.Restart(0));
    std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
    EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(2)) << "only the newest is kept";
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ((*v)->info().version, 2u);
    EXPECT_EQ((*v)->info().generation, 2u);
    ExpectHolds(*plan, manifest, **v, 2, /*bf16=*/true);
    // Numbering goes on after the adopted version.
    Trainers t(d, 1, "after");
    t.Step(3, true);
    auto p = t.Publish("gpt");
    ASSERT_TRUE(p[0].ok()) << p[0].status();
    EXPECT_EQ(p[0]->version, 3u);
  }
  std::error_code ignored;
  std::filesystem::remove_all(state, ignored);
}

// GET /metrics of a daemon's --metrics_address ("127.0.0.1:port").
using ::flatshard::testing::ScrapeMetrics;

TEST(WeightsTest, MetricsCountVersionsBytesReadersAndPublishes) {
  char tmpl[] = "/tmp/fsw-metrics.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string file = absl::StrCat(tmpl, "/address");
  ::flatshard::testing::ClusterOptions o;
  o.extra_flags = {"--metrics_address=127.0.0.1:0", "--metrics_address_file=" + file};
  Cluster d(Layout::kSingle, o);
  Trainers t(d, 1, "metrics");
  t.Step(1, true);
  auto p = t.Publish("gpt");
  ASSERT_TRUE(p[0].ok());
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok());
  std::string address;
  std::getline(std::ifstream(file), address);
  const std::string text = ScrapeMetrics(address);
  EXPECT_THAT(text, HasSubstr("\nflatshard_weights_versions 1\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("\nflatshard_weights_bytes ", p[0]->bytes, "\n")));
  EXPECT_THAT(text, HasSubstr("\nflatshard_weights_readers 1\n"));
  EXPECT_THAT(text, HasSubstr("\nflatshard_weights_publishes_total{code=\"OK\"} 1\n"));
  std::error_code ignored;
  std::filesystem::remove_all(tmpl, ignored);
}

// The /dev/shm file mapped at `p` in this process ("" when none).
std::string SegmentOf(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || addr < lo || addr >= hi) continue;
    const size_t at = line.find("/dev/shm/");
    return at == std::string::npos ? "" : line.substr(at);
  }
  return "";
}

double MetricValue(const std::string& text, const std::string& name) {
  const size_t at = text.find(absl::StrCat("\n", name, " "));
  double v = -1;
  if (at != std::string::npos) {
    const size_t from = at + name.size() + 2;
    (void)absl::SimpleAtod(text.substr(from, text.find('\n', from) - from), &v);
  }
  return v;
}

// A version that fell out with no reader on it lends its segment to the next version of the
// name with the same size and grants (copied at memcpy speed into memory already backed);
// 4 readers of one version map that one copy, and the daemon copied each version's bytes
// once whatever the number of readers.
TEST(WeightsTest, ReusesTheSegmentOfAVersionThatFellOutAndCopiesOncePerVersion) {
  char tmpl[] = "/tmp/fsw-reuse.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string file = absl::StrCat(tmpl, "/address");
  ::flatshard::testing::ClusterOptions o;
  o.extra_flags = {"--weights_keep=1", "--metrics_address=127.0.0.1:0",
                   "--metrics_address_file=" + file};
  Cluster d(Layout::kSingle, o);
  Trainers t(d, 1, "reuse");
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  std::string address;
  std::getline(std::ifstream(file), address);
  std::vector<std::string> segment(4);
  int64_t bytes = 0;
  for (int s = 1; s <= 3; ++s) {
    // The previous version's lease ends when the daemon sees its stream close.
    for (int i = 0; i < 200 && MetricValue(ScrapeMetrics(address), "flatshard_weights_readers") > 0;
         ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    t.Step(s, true);
    auto p = t.Publish("gpt");
    ASSERT_TRUE(p[0].ok()) << p[0].status();
    bytes = p[0]->bytes;
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    ExpectHolds(*t.plan, t.manifest, **v, s);
    segment[s] = SegmentOf((*v)->tensors()[0].data);
  }
  // keep 1: version 1 fell out when 2 came (a fresh segment) and 3 was copied into it.
  EXPECT_NE(segment[2], segment[1]);
  EXPECT_EQ(segment[3], segment[1]);
  // Four readers, one copy.
  std::vector<std::unique_ptr<WeightsReader>> readers;
  std::vector<std::unique_ptr<WeightsVersion>> held;
  for (int i = 0; i < 4; ++i) {
    readers.push_back(Reader(d.AddressFor(0)));
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = readers.back()->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(SegmentOf((*v)->tensors()[0].data), segment[3]);
    held.push_back(*std::move(v));
  }
  std::string text = ScrapeMetrics(address);
  EXPECT_EQ(MetricValue(text, "flatshard_weights_copied_bytes_total"), 3.0 * bytes) << text;
  EXPECT_EQ(MetricValue(text, "flatshard_weights_segment_reuses_total"), 1.0);
  EXPECT_EQ(MetricValue(text, "flatshard_weights_readers"), 4.0);
  EXPECT_EQ(MetricValue(text, "flatshard_weights_spare_bytes"), 1.0 * bytes);  // version 2's
  // Other grants: the spare (version 2's) is not reused (who mapped it may not read this).
  held.clear();
  PublishOptions granted;
  granted.reader_uids = {4242};
  t.Step(4, true);
  auto p = t.Publish("gpt", granted);
  ASSERT_TRUE(p[0].ok()) << p[0].status();
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  ExpectHolds(*t.plan, t.manifest, **v, 4);
  EXPECT_NE(SegmentOf((*v)->tensors()[0].data), segment[2]);
  text = ScrapeMetrics(address);
  EXPECT_EQ(MetricValue(text, "flatshard_weights_copied_bytes_total"), 4.0 * bytes);
  EXPECT_EQ(MetricValue(text, "flatshard_weights_segment_reuses_total"), 1.0);
  std::error_code ignored;
  std::filesystem::remove_all(tmpl, ignored);
}

// ---- Readers of another uid ----

constexpr char kTestUser[] = "fsweights";

// Run as kTestUser: what root published is readable only where granted, read-only.
TEST(WeightsChild, DISABLED_OtherUidReader) {
  const char* address = std::getenv("FS_W_ADDRESS");
  ASSERT_NE(address, nullptr);
  const uid_t uid = ::getuid();
  ASSERT_NE(uid, 0u);
  std::unique_ptr<WeightsReader> r = Reader(address);
  ASSERT_NE(r, nullptr);
  OpenWeightsOptions root;
  root.owner_uid = 0;
  absl::StatusOr<std::unique_ptr<WeightsVersion>> granted = r->Open("granted", root);
  ASSERT_TRUE(granted.ok()) << granted.status();
  absl::StatusOr<std::unique_ptr<WeightsVersion>> denied = r->Open("private", root);
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
  EXPECT_THAT(denied.status().message(), HasSubstr(absl::StrCat("uid ", uid)));
  OpenWeightsOptions wrong = root;
  wrong.token = "not-it";
  denied = r->Open("tokened", wrong);
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
  EXPECT_THAT(denied.status().message(), HasSubstr("wrong reader token"));
  OpenWeightsOptions right = root;
  right.token = "t0k";
  absl::StatusOr<std::unique_ptr<WeightsVersion>> tokened = r->Open("tokened", right);
  ASSERT_TRUE(tokened.ok()) << tokened.status();
  // Both hold the same committed step: the same bytes.
  ASSERT_EQ((*granted)->info().bytes, (*tokened)->info().bytes);
  for (const WeightsTensor& t : (*granted)->tensors()) {
    const WeightsTensor* u = (*tokened)->Find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    ASSERT_EQ(std::memcmp(t.data, u->data, t.bytes), 0) << t.name;
  }
  // Not writable: the segment refuses O_RDWR to this uid.
  absl::StatusOr<std::vector<PublishedVersion>> listed = r->List();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u) << "only the version granted to this uid is listed";
  EXPECT_EQ((*listed)[0].name, "granted");
  std::string segment;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    struct stat st;
    if (::stat(e.path().c_str(), &st) == 0 &&
        static_cast<int64_t>(st.st_size) >= (*granted)->info().bytes &&
        ::access(e.path().c_str(), R_OK) == 0 && st.st_uid == 0) {
      const int fd = ::open(e.path().c_str(), O_RDWR);
      EXPECT_EQ(fd, -1) << e.path() << " opened read-write by uid " << uid;
      if (fd >= 0) ::close(fd);
    }
  }
}

TEST(WeightsTest, ReadersOfAnotherUidNeedAGrantAndMapReadOnly) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: runs a reader as the user " << kTestUser;
  if (getpwnam(kTestUser) == nullptr) {
    const std::string cmd =
        absl::StrCat("useradd --system --user-group --no-create-home --shell /usr/sbin/nologin ",
                     kTestUser, " >/dev/null 2>&1");
    (void)std::system(cmd.c_str());
  }
  const passwd* pw = getpwnam(kTestUser);
  ASSERT_NE(pw, nullptr) << "useradd " << kTestUser << " failed";
  const uid_t uid = pw->pw_uid;
  const gid_t gid = pw->pw_gid;
  ::flatshard::testing::ClusterOptions o;
  o.extra_flags = {absl::StrCat("--socket_group=", kTestUser)};
  Cluster d(Layout::kSingle, o);
  Trainers t(d, 1, "uids");
  t.Step(1, true);
  PublishOptions granted;
  granted.reader_uids = {static_cast<int64_t>(uid)};
  ASSERT_TRUE(t.c[0]->Publish("", "granted", granted).ok());
  PublishOptions tokened;
  tokened.reader_token = "t0k";
  ASSERT_TRUE(t.c[0]->Publish("", "tokened", tokened).ok());
  ASSERT_TRUE(t.c[0]->Publish("", "private").ok());

  // The child: this binary, copied where the test user can run it.
  char tmpl[] = "/tmp/fsw-child.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir = tmpl;
  std::filesystem::permissions(dir, std::filesystem::perms(0755));
  const std::filesystem::path binary = dir / "weights_test";
  std::filesystem::copy_file("/proc/self/exe", binary);
  std::filesystem::permissions(binary, std::filesystem::perms(0755));
  std::vector<std::string> args = {binary.string(),
                                   "--gtest_filter=WeightsChild.DISABLED_OtherUidReader",
                                   "--gtest_also_run_disabled_tests"};
  std::vector<std::string> env = {absl::StrCat("FS_W_ADDRESS=", d.AddressFor(0)),
                                  "PATH=/usr/bin:/bin", "HOME=/"};
  const int status = ::flatshard::testing::RunAsUser(std::move(args), std::move(env), uid, gid);
  ASSERT_NE(status, -1) << "fork or waitpid failed";
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the reader running as uid " << uid << " failed (status " << status
      << "; its output is above)";
}

// ---- Processes killed with SIGKILL ----

// A reader process: opens the latest "gpt" of FS_W_OWNER, says so on stdout, holds it.
TEST(WeightsChild, DISABLED_HoldReader) {
  const char* address = std::getenv("FS_W_ADDRESS");
  ASSERT_NE(address, nullptr);
  std::unique_ptr<WeightsReader> r = Reader(address);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  std::printf("HOLDING\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(60));
}

// A trainer process (world 1, group FS_W_GROUP): commits and publishes in a loop until killed.
TEST(WeightsChild, DISABLED_PublishLoop) {
  const char* address = std::getenv("FS_W_ADDRESS");
  const char* group = std::getenv("FS_W_GROUP");
  ASSERT_TRUE(address != nullptr && group != nullptr);
  std::unique_ptr<Client> c = Connect(address);
  ASSERT_TRUE(c->Join(group, 1, 0, kToken).ok());
  absl::StatusOr<RegisteredModule> m =
      c->Register("", ExampleModelFile("gpt_tied", "manifest"),
                  ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
  ASSERT_TRUE(m.ok()) << m.status();
  for (int s = static_cast<int>(m->generation) + 1;; ++s) {
    absl::StatusOr<ShardViews> v = c->GetShardViews("");
    ASSERT_TRUE(v.ok()) << v.status();
    FillShards(*v, s);
    ASSERT_TRUE(c->Commit("").ok());
    ASSERT_TRUE(c->Publish("", "gpt").ok());
  }
}

TEST(WeightsTest, AReaderKilledReleasesItsLease) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 1, "crash");
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt")[0].ok());
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  std::vector<std::string> env = {absl::StrCat("FS_W_ADDRESS=", d.AddressFor(0)),
                                  "GTEST_ALSO_RUN_DISABLED_TESTS=1"};
  // The child's stdout is the pipe: spawn with it as fd 1.
  const int saved = dup(1);
  dup2(out[1], 1);
  const pid_t child = ::flatshard::testing::SpawnSelf("WeightsChild.DISABLED_HoldReader", env);
  dup2(saved, 1);
  close(saved);
  close(out[1]);
  ASSERT_GT(child, 0);
  std::string said;
  char buf[256];
  for (ssize_t n;
       said.find("HOLDING") == std::string::npos && (n = read(out[0], buf, sizeof(buf))) > 0;) {
    said.append(buf, n);
  }
  close(out[0]);
  ASSERT_THAT(said, HasSubstr("HOLDING"));
  for (int s = 2; s <= 3; ++s) {
    t.Step(s, true);
    ASSERT_TRUE(t.Publish("gpt")[0].ok());
  }
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(1, 2, 3));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  for (int i = 0; i < 300 && Versions(*r, "gpt").size() != 2; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(2, 3));
}

TEST(WeightsTest, APublisherKilledAtRandomPointsLeavesNoPartialVersion) {
  Cluster d(Layout::kSingle);
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));
  std::mt19937 rng(25);
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<std::string> env = {absl::StrCat("FS_W_ADDRESS=", d.AddressFor(0)),
                                    absl::StrCat("FS_W_GROUP=kill", trial),
                                    "GTEST_ALSO_RUN_DISABLED_TESTS=1"};
    const pid_t child = ::flatshard::testing::SpawnSelf("WeightsChild.DISABLED_PublishLoop", env);
    ASSERT_GT(child, 0);
    absl::SleepFor(absl::Milliseconds(300 + rng() % 700));
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  // Every version the table shows is whole: each holds the committed step it names.
  absl::StatusOr<std::vector<PublishedVersion>> all = r->List();
  ASSERT_TRUE(all.ok());
  EXPECT_FALSE(all->empty()) << "no trainer published before it was killed";
  std::shared_ptr<const Plan> plan;
  {
    Trainers t(d, 1, "plan");
    plan = t.plan;
  }
  for (const PublishedVersion& p : *all) {
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open(p.name, At(p.version));
    if (absl::IsNotFound(v.status()) && !absl::c_linear_search(Versions(*r, "gpt"), p.version)) {
      // A publish the killed trainer had already sent can still land after the List, and the
      // retention then drops the oldest listed version: gone whole, never partial.
      continue;
    }
    ASSERT_TRUE(v.ok()) << v.status();
    ExpectHolds(*plan, ExampleModelFile("gpt_tied", "manifest"), **v,
                static_cast<int>(p.generation));
  }
}

}  // namespace
}  // namespace flatshard::client
