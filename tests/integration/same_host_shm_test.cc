// Daemons on one host: by default (--ucx_error_handling=auto) their UCX endpoints have peer
// error handling and run over TCP loopback (issue 27: a daemon killed while writing into a
// peer's UCX shared-memory queue wedges it for good); with --ucx_error_handling=none they use
// shared memory and a dead peer is found by the heartbeats (--peer_timeout), whose abort
// abandons the transfers UCX cannot cancel. Either way a daemon killed in the middle of a
// large all-gather fails the survivor's op, named, within the heartbeat timeout. Messages of
// 256 KiB and more go by same-host copy (one process_vm_readv,
// server/collective/ucx/same_host_copy.h): values to the element with and without it
// (--ucx_same_host_copy=false), the path counted in /metrics; a daemon killed mid-copy fails
// the survivor's op, named, never the survivor.
// Real flatshardd processes (tests/testing/cluster.h), one trainer thread per rank.

#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/metrics_scrape.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/shard_snapshot.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::Layout;

constexpr char kToken[] = "t0k";
// Bytes gathered per summon: 64 MiB by default (32 MiB cross between the daemons each way);
// FS_SHM_TEST_MIB=256 runs the issue's 256 MiB case (slower: ~15 s per summon on 2 busy cores).
int64_t Numel() {
  const char* mib = getenv("FS_SHM_TEST_MIB");
  return (mib != nullptr ? atoll(mib) : 64) * (int64_t{1} << 20) / 4;
}

std::string ManifestJson(int64_t numel) {
  return absl::StrCat(R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Linear", )",
                      R"("bases": ["Module"], "params": [{"name": "weight", "id": 0, "shape": [)",
                      numel, R"(], "dtype": "float32", "requires_grad": true}], "children": []}})");
}

std::unique_ptr<Client> Connect(const std::string& address) {
  ClientOptions options;
  options.address = address;
  options.call_timeout = absl::Seconds(60);  // far beyond the heartbeat timeout
  options.join_timeout = absl::Seconds(20);
  options.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Per daemon: --metrics_address on a free port, written to a file under `dir`.
std::vector<std::vector<std::string>> MetricsFlags(const std::string& dir) {
  std::vector<std::vector<std::string>> flags;
  for (int d = 0; d < 2; ++d) {
    flags.push_back({"--metrics_address=127.0.0.1:0",
                     absl::StrCat("--metrics_address_file=", dir, "/metrics", d)});
  }
  return flags;
}

// flatshard_same_host_copies_total{result} of daemon `d` (0 when absent or unreachable).
double CopiesOf(const std::string& dir, int d, const std::string& result) {
  std::string address;
  std::getline(std::ifstream(absl::StrCat(dir, "/metrics", d)), address);
  std::map<std::string, double> m =
      ::flatshard::testing::ParseMetrics(::flatshard::testing::ScrapeMetrics(address));
  return m[absl::StrCat("flatshard_same_host_copies_total{result=\"", result, "\"}")];
}

std::string TempDir() {
  char tmpl[] = "/tmp/fsshm.XXXXXX";
  return ::mkdtemp(tmpl) != nullptr ? std::string(tmpl) : std::string("/tmp");
}

// Parameter values and gradients: small multiples of 0.25, so every sum is exact in float32.
float ParamValue(int64_t i) { return static_cast<float>(i % 61) * 0.25f; }
float GradValue(int rank, int64_t i) { return static_cast<float>((i * 3 + rank * 5) % 17) * 0.5f; }

struct StepOutcome {
  std::vector<std::vector<float>> grads;  // by rank: the reduced gradient shard
  double copies[2] = {0, 0};              // by daemon: same-host copies received (ok)
  double failed[2] = {0, 0};
};

// Two daemons x one rank, one 16 MiB parameter: written (writeback summon), summoned
// read-only (all-gather: 8 MiB each way) and checked to the element, then a gradient
// reduce-scatter (8 MiB each way).
StepOutcome RunStep(const std::vector<std::string>& flags) {
  const std::string dir = TempDir();
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fsshmv";
  options.default_wait = "60s";
  options.extra_flags = flags;
  options.daemon_flags = MetricsFlags(dir);
  Cluster c(Layout::kTwoDaemons, options);
  constexpr int64_t kNumel = int64_t{4} << 20;
  StepOutcome out;
  out.grads.resize(2);
  ::flatshard::testing::RunRanks(2, [&](int r) {
    std::unique_ptr<Client> client = Connect(c.AddressFor(r));
    ASSERT_NE(client, nullptr);
    ASSERT_TRUE(client->Join("g", 2, r, kToken, c.coordinator()).ok());
    ASSERT_TRUE(client->Register("", ManifestJson(kNumel), "{}", InitMode::kZeros).ok());
    SummonOptions o;
    o.writeback = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> w = client->Summon("", "", o);
    ASSERT_TRUE(w.ok()) << w.status();
    float* data = static_cast<float*>((*w)->Find("weight")->data);
    for (int64_t i = 0; i < kNumel; ++i) data[i] = ParamValue(i);
    ASSERT_TRUE((*w)->End().ok());
    o.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = client->Summon("", "", o);
    ASSERT_TRUE(s.ok()) << s.status();
    const float* got = static_cast<const float*>((*s)->Find("weight")->data);
    for (int64_t i = 0; i < kNumel; ++i) {
      ASSERT_EQ(got[i], ParamValue(i)) << "rank " << r << " element " << i;
    }
    ASSERT_TRUE((*s)->End().ok());
    absl::Status rs = client->ReduceScatterGrads("", 0, ReduceOp::kSum, false,
                                                 [&](PendingReduceScatter& pending) {
                                                   float* g = static_cast<float*>(pending.data());
                                                   for (int64_t i = 0; i < pending.numel(); ++i)
                                                     g[i] = GradValue(r, i);
                                                   return absl::OkStatus();
                                                 });
    ASSERT_TRUE(rs.ok()) << rs;
    out.grads[r] = ::flatshard::testing::SnapshotShards(*client).at(1);
  });
  for (int d = 0; d < 2; ++d) {
    out.copies[d] = CopiesOf(dir, d, "ok");
    out.failed[d] = CopiesOf(dir, d, "failed");
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return out;
}

TEST(SameHostCopyTest, OneCopyGivesTheExactValuesAndIsCounted) {
  const StepOutcome copy = RunStep({"--ucx_same_host_copy=true"});
  const StepOutcome ucx = RunStep({"--ucx_same_host_copy=false"});
  if (::testing::Test::HasFatalFailure()) return;
  for (int d = 0; d < 2; ++d) {
    // Used for same-host daemons where turned on, and only there.
    EXPECT_GE(copy.copies[d], 2) << "daemon " << d;  // at least the all-gather and the grads
    EXPECT_EQ(copy.failed[d], 0) << "daemon " << d;
    EXPECT_EQ(ucx.copies[d], 0) << "daemon " << d;
  }
  for (int r = 0; r < 2; ++r) {
    const std::vector<float>& grad = copy.grads[r];
    const int64_t n = static_cast<int64_t>(grad.size());
    ASSERT_EQ(n, int64_t{2} << 20) << "rank " << r;
    EXPECT_EQ(grad, ucx.grads[r]) << "rank " << r;
    for (int64_t j = 0; j < n; ++j) {
      const float want = GradValue(0, r * n + j) + GradValue(1, r * n + j);
      ASSERT_EQ(grad[j], want) << "rank " << r << " element " << j;
    }
  }
}

struct Rank {
  std::unique_ptr<Client> client;
  std::atomic<int> summons{0};
  std::atomic<bool> failed{false};
  absl::Status failure;
  absl::Time failed_at = absl::InfiniteFuture();
};

// 0: the coordinator is killed; 1: the other daemon; 2: the other daemon is frozen (SIGSTOP:
// its sockets stay open, only the heartbeats find it); 3: the other daemon, the daemons on
// shared memory (--ucx_error_handling=none: only the heartbeats find it).
class SameHostKillTest : public ::testing::TestWithParam<int> {};

// Two daemons x one rank summon a 64 MiB unit back to back (256 MiB with FS_SHM_TEST_MIB=256);
// a daemon is killed with SIGKILL (or frozen) while they do. The survivor's
// summon in flight fails with UNAVAILABLE naming the cause within the heartbeat timeout
// (3 s by default, 5 s allowed here; 10 s for the frozen daemon, found only by the heartbeats,
// whose survivor may wait for its ack), never hangs.
TEST_P(SameHostKillTest, SurvivorFailsWithUnavailableWithinTheHeartbeatTimeout) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fsshm";
  // Large summons are slow on a loaded 2-core host; the failure must come from the heartbeats
  // (asserted below), never from an op deadline.
  options.default_wait = "60s";
  const std::string dir = TempDir();
  options.daemon_flags = MetricsFlags(dir);
  for (std::vector<std::string>& flags : options.daemon_flags) {
    flags.push_back("--ucx_same_host_copy=true");
    if (GetParam() == 3) flags.push_back("--ucx_error_handling=none");
  }
  Cluster c(Layout::kTwoDaemons, options);
  const bool freeze = GetParam() == 2;
  const int victim = GetParam() == 0 ? 0 : 1;
  const int survivor = 1 - victim;
  std::vector<Rank> ranks(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ranks[r].client = Connect(c.AddressFor(r));
      if (ranks[r].client == nullptr) return;
      absl::Status s = ranks[r].client->Join("g", 2, r, kToken, c.coordinator());
      if (s.ok()) {
        s = ranks[r].client->Register("", ManifestJson(Numel()), "{}", InitMode::kZeros).status();
      }
      SummonOptions ro;
      ro.writeback = false;
      while (s.ok()) {
        absl::StatusOr<std::unique_ptr<SummonedParams>> p = ranks[r].client->Summon("", "", ro);
        s = p.ok() ? (*p)->End() : p.status();
        if (s.ok()) ++ranks[r].summons;
      }
      ranks[r].failed_at = absl::Now();
      ranks[r].failure = s;
      ranks[r].failed = true;
    });
  }
  // Let a few summons complete, then kill while the next one moves data.
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while ((ranks[0].summons < 2 || ranks[1].summons < 2) && absl::Now() < until &&
         ranks[0].failed_at == absl::InfiniteFuture() &&
         ranks[1].failed_at == absl::InfiniteFuture()) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (ranks[survivor].summons < 2) {
    ADD_FAILURE() << "summons before the kill: " << ranks[survivor].summons << ", "
                  << ranks[survivor].failure;
    for (int d = 0; d < 2; ++d) c.Kill(d);
    for (std::thread& t : threads) t.join();
    return;
  }
  // The summons so far crossed by same-host copy (32 MiB messages).
  EXPECT_GE(CopiesOf(dir, survivor, "ok"), 1);
  absl::SleepFor(absl::Milliseconds(30));  // into the next summon's transfer
  const absl::Time killed = absl::Now();
  if (freeze) {
    ASSERT_EQ(::kill(c.daemon(victim).pid(), SIGSTOP), 0);
    // Its trainer waits on the frozen daemon: end it once the survivor has its answer.
    const absl::Time limit = absl::Now() + absl::Seconds(30);
    while (!ranks[survivor].failed && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(5));
  }
  c.Kill(victim);
  for (std::thread& t : threads) t.join();
  const Rank& s = ranks[survivor];
  std::printf("survivor's failure after %s: %s\n",
              absl::FormatDuration(s.failed_at - killed).c_str(), s.failure.ToString().c_str());
  EXPECT_EQ(s.failure.code(), absl::StatusCode::kUnavailable) << s.failure;
  EXPECT_LT(s.failed_at - killed, absl::Seconds(freeze ? 10 : 5))
      << "failed " << absl::FormatDuration(s.failed_at - killed)
      << " after the kill: " << s.failure;

  // The survivor itself is unharmed: UCX did not abort it on the dead peer (as it does when a
  // CMA read finds the peer gone), and it exits cleanly.
  ranks.clear();
  EXPECT_EQ(c.daemon(survivor).Terminate(), 0);
  EXPECT_THAT(c.daemon(survivor).Log(), ::testing::Not(::testing::HasSubstr("backtrace")));
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

INSTANTIATE_TEST_SUITE_P(Kill, SameHostKillTest, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 0   ? std::string("Coordinator")
                                  : info.param == 1 ? std::string("Peer")
                                  : info.param == 2 ? std::string("FrozenPeer")
                                                    : std::string("PeerOverSharedMemory");
                         });

}  // namespace
}  // namespace flatshard::client
