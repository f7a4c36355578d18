// Daemons on one host talk over shared memory by default (UCX endpoints without peer error
// handling, --ucx_error_handling=auto), yet a daemon killed in the middle of a large
// all-gather is still found: the heartbeats (--peer_timeout) abort the group, and the abort
// abandons the transfers to the dead peer that UCX cannot cancel. Real flatshardd processes
// (tests/testing/cluster.h), one trainer thread per rank.

#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <cstdint>
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

struct Rank {
  std::unique_ptr<Client> client;
  std::atomic<int> summons{0};
  absl::Status failure;
  absl::Time failed_at = absl::InfiniteFuture();
};

// 0: the coordinator is killed; 1: the other daemon.
class SameHostKillTest : public ::testing::TestWithParam<int> {};

// Two daemons x one rank summon a 64 MiB unit back to back (256 MiB with FS_SHM_TEST_MIB=256);
// a daemon is killed with SIGKILL while they do. The survivor's
// summon in flight fails with UNAVAILABLE naming the cause within the heartbeat timeout
// (3 s by default, 5 s allowed here), never hangs; the daemons' UCX endpoints to each other
// were shared-memory ones (their log says so at UCX_LOG_LEVEL=info).
TEST_P(SameHostKillTest, SurvivorFailsWithUnavailableWithinTheHeartbeatTimeout) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fsshm";
  // Large summons are slow on a loaded 2-core host; the failure must come from the heartbeats
  // (asserted below), never from an op deadline.
  options.default_wait = "60s";
  Cluster c(Layout::kTwoDaemons, options);
  const int victim = GetParam();
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
  absl::SleepFor(absl::Milliseconds(30));  // into the next summon's transfer
  const absl::Time killed = absl::Now();
  c.Kill(victim);
  for (std::thread& t : threads) t.join();
  const Rank& s = ranks[survivor];
  EXPECT_EQ(s.failure.code(), absl::StatusCode::kUnavailable) << s.failure;
  EXPECT_LT(s.failed_at - killed, absl::Seconds(5))
      << "failed " << absl::FormatDuration(s.failed_at - killed)
      << " after the kill: " << s.failure;

  // The survivor itself is unharmed: UCX did not abort it on the dead peer (as it does when a
  // CMA read finds the peer gone), and it exits cleanly.
  ranks.clear();
  EXPECT_EQ(c.daemon(survivor).Terminate(), 0);
  EXPECT_THAT(c.daemon(survivor).Log(), ::testing::Not(::testing::HasSubstr("backtrace")));
}

INSTANTIATE_TEST_SUITE_P(Kill, SameHostKillTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 0 ? std::string("Coordinator")
                                                  : std::string("Peer");
                         });

}  // namespace
}  // namespace flatshard::client
