// Daemons that come back and peers that freeze (issue 11), with real flatshardd processes
// standing in for nodes (tests/testing/cluster.h):
//  - a daemon killed and restarted: once every rank has joined again the group re-forms, and
//    the module whose shards that daemon lost is named to every rank (Join's lost modules)
//    and registered afresh, never "collective mismatch at op_seq 1";
//  - the coordinator restarted on the same port: the survivors' first rejoin reaches it;
//  - a peer daemon frozen (SIGSTOP) in the middle of a large all-gather: the survivors fail
//    with UNAVAILABLE within heartbeat timeout + abort grace, not at their call deadline.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::ConnectOptions;
using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExpectEveryRankLostItsModule;
using ::flatshard::testing::ExpectParams;
using ::flatshard::testing::GroupOptions;
using ::flatshard::testing::JoinRanks;
using ::flatshard::testing::Layout;
using ::flatshard::testing::LeaveSurvivors;
using ::flatshard::testing::OnCluster;
using ::flatshard::testing::Rank;
using ::flatshard::testing::RegisterExample;
using ::flatshard::testing::RunRanks;
using ::flatshard::testing::WriteParams;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr char kToken[] = "t0k";

// No retries: each call's own outcome.
ConnectOptions NoRetries(absl::Duration call_timeout = absl::Seconds(20)) {
  return {call_timeout, absl::Seconds(20), 1};
}

float Value(const std::string& /*fqn*/, int64_t i) {
  return 1.0f + static_cast<float>(i % 97) * 0.5f;
}

// Registers (gpt_tied, zeros) on every rank, writes Value() everywhere and checks it back.
void RegisterAndInit(std::vector<Rank>& ranks) {
  RegisterExample(ranks);
  WriteParams(ranks, Value);
  ExpectParams(ranks, Value);
}

class RestartedDaemonLosesShardsTest : public ::testing::TestWithParam<Layout> {};

// The last daemon (not the coordinator) is killed and restarted under its node name. Every
// rank joins again (survivors leave first); the join names the lost module to every rank, and
// registering it afresh works on every rank, end to end.
TEST_P(RestartedDaemonLosesShardsTest, EveryRankIsToldByNameAndRegistersAfresh) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fsrec";
  options.extra_flags = {"--peer_timeout=2s"};
  Cluster c(GetParam(), options);
  const int world = GetParam() == Layout::kTwoDaemons ? 2 : 4;
  const int victim = c.daemon_count() - 1;
  const GroupOptions group = OnCluster(c, "g", kToken, NoRetries());
  std::vector<Rank> ranks = JoinRanks(world, group);
  RegisterAndInit(ranks);
  std::vector<int> lost_ranks;
  for (int r = 0; r < world; ++r) {
    if (c.DaemonOf(r) == victim) lost_ranks.push_back(r);
  }

  c.Kill(victim);
  for (int r : lost_ranks) ranks[r] = Rank();
  ASSERT_TRUE(c.Restart(victim));
  const absl::Status left = LeaveSurvivors(ranks);
  EXPECT_TRUE(left.ok()) << left;
  JoinRanks(ranks, group);
  const std::string lost_text =
      absl::StrCat("group g: module \"\" (the root) lost the shards of ",
                   lost_ranks.size() == 1 ? "rank " : "ranks ", lost_ranks[0], " (daemon node",
                   victim, ": restarted without them");
  ASSERT_NO_FATAL_FAILURE(ExpectEveryRankLostItsModule(ranks, {lost_text, "register it afresh"}));
  // Registering afresh initialises the module again on every rank: no collective mismatch.
  RegisterAndInit(ranks);
}

INSTANTIATE_TEST_SUITE_P(Layouts, RestartedDaemonLosesShardsTest,
                         ::testing::ValuesIn(::flatshard::testing::MultiDaemonLayouts()),
                         ::flatshard::testing::LayoutParamName());

// A free loopback TCP port (bound and released; a daemon takes it right after).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return -1;
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

bool WaitForFile(const std::string& path) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (access(path.c_str(), F_OK) != 0) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// The coordinator daemon is killed and restarted on the same port. The survivor (rank 1, on
// the other daemon) leaves and joins again at once: its channel to the coordinator must not
// sit in reconnect backoff ("coordinator unreachable"); the group re-forms and the module
// rank 0's daemon lost is named.
TEST(RestartedCoordinatorTest, SurvivorsFirstRejoinReachesItOnTheSamePort) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string coordinator = absl::StrCat("127.0.0.1:", port);
  // Its own --peer_address_file: DaemonProcess waits only for the Unix socket without
  // DaemonOptions::peer (whose port would be a new one at every start).
  const std::string peer_file = absl::StrCat(::testing::TempDir(), "/fsrec_coordinator_", getpid());
  std::remove(peer_file.c_str());
  DaemonOptions o0;
  o0.tag_prefix = "fsrec";
  o0.node_name = "node0";
  o0.extra_flags = {"--peer_address=" + coordinator, "--peer_address_file=" + peer_file,
                    "--peer_timeout=2s"};
  DaemonProcess d0(o0);
  ASSERT_TRUE(WaitForFile(peer_file));
  DaemonOptions o1;
  o1.tag_prefix = "fsrec";
  o1.peer = true;
  o1.node_name = "node1";
  o1.extra_flags = {"--peer_timeout=2s"};
  DaemonProcess d1(o1);
  const std::vector<std::string> address = {d0.address(), d1.address()};
  GroupOptions group;
  group.token = kToken;
  group.coordinator = coordinator;
  group.connect = [&](int r) { return ConnectClient(address[r], NoRetries()); };
  std::vector<Rank> ranks = JoinRanks(2, group);
  RegisterAndInit(ranks);

  d0.Kill();
  ranks[0] = Rank();
  // Let the survivor's daemon notice (its watch stream breaks; the channel backs off).
  absl::SleepFor(absl::Seconds(3));
  std::remove(peer_file.c_str());
  ASSERT_TRUE(d0.Restart());
  ASSERT_TRUE(WaitForFile(peer_file)) << "the coordinator did not listen again";
  RunRanks(2, [&](int r) {
    if (r == 0) {
      ranks[0].client = ConnectClient(address[0], NoRetries());
      ASSERT_NE(ranks[0].client, nullptr);
    } else {
      EXPECT_TRUE(ranks[1].client->Leave().ok());
    }
    const absl::Time start = absl::Now();
    absl::Status joined = ranks[r].client->Join("g", 2, r, kToken, coordinator);
    ASSERT_TRUE(joined.ok()) << "rank " << r << " rejoining: " << joined;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_THAT(ranks[r].client->lost_modules(), SizeIs(1)) << "rank " << r;
    EXPECT_THAT(ranks[r].client->lost_modules()[0],
                HasSubstr("lost the shards of rank 0 (daemon node0"));
  }
  RegisterAndInit(ranks);
}

// ---- A frozen peer mid-transfer ----

// Bytes process `pid` has read through syscalls so far (/proc/<pid>/io rchar; TCP included).
int64_t ReadBytes(pid_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/io").c_str(), "r");
  if (f == nullptr) return 0;
  long long rchar = 0;
  if (std::fscanf(f, "rchar: %lld", &rchar) != 1) rchar = 0;
  std::fclose(f);
  return rchar;
}

// One unit of `numel` float32 parameters.
std::string OneBigUnit(int64_t numel) {
  return absl::StrCat(
      R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Big", )",
      R"("bases": ["Module"], "children": [], "params": [{"name": "w", "id": 0, "shape": [)", numel,
      R"(], "dtype": "float32", "requires_grad": true}]}})");
}

// Two daemons, one rank each, summoning a 64 MiB unit read-only in a loop (each summon moves
// 32 MiB between the daemons). Daemon 1 is frozen at a random moment, most likely while data
// is moving (UCX sends to it then never complete, and only an abort that finishes them
// releases rank 0). Rank 0 must fail with UNAVAILABLE within peer_timeout (2 s) + the abort
// grace (1 s) + slack, far before its 60 s call deadline.
TEST(FrozenPeerTest, SurvivorFailsSoonWhenThePeerFreezesMidTransfer) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fsfrz";
  options.extra_flags = {"--peer_timeout=2s"};
  Cluster c(Layout::kTwoDaemons, options);
  std::vector<Rank> ranks(2);
  RunRanks(2, [&](int r) {
    ranks[r].client =
        ConnectClient(c.AddressFor(r), NoRetries(r == 0 ? absl::Seconds(60) : absl::Seconds(8)));
    ASSERT_NE(ranks[r].client, nullptr);
    ASSERT_TRUE(ranks[r].client->Join("g", 2, r, kToken, c.coordinator()).ok());
    absl::StatusOr<RegisteredModule> m = ranks[r].client->Register(
        "", OneBigUnit(int64_t{16} << 20), R"({"format": "flatshard.policy/1"})", InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << m.status();
  });
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0};
  absl::Status failed;
  absl::Time failed_at;
  std::thread survivor([&] {
    SummonOptions read;
    read.writeback = false;
    while (!stop.load()) {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[0].client->Summon("", "", read);
      if (!s.ok()) {
        failed = s.status();
        failed_at = absl::Now();
        return;
      }
      ++rounds;
      if (absl::Status e = (*s)->End(); !e.ok()) {
        failed = e;
        failed_at = absl::Now();
        return;
      }
    }
  });
  std::thread peer([&] {
    SummonOptions read;
    read.writeback = false;
    while (!stop.load()) {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[1].client->Summon("", "", read);
      if (!s.ok() || !(*s)->End().ok()) return;
    }
  });
  // A few rounds first, then freeze daemon 1 while it is receiving data (its read count grows
  // fast), or at a random moment if that is not seen within a second.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (rounds.load() < 3 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  const pid_t victim = c.daemon(1).pid();
  int64_t last = ReadBytes(victim);
  const absl::Time give_up = absl::Now() + absl::Seconds(1);
  std::mt19937 rng(std::random_device{}());
  while (absl::Now() < give_up) {
    absl::SleepFor(absl::Microseconds(500));
    const int64_t now = ReadBytes(victim);
    if (now - last > (256 << 10)) break;
    last = now;
  }
  if (absl::Now() >= give_up) {
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(0, 150)(rng)));
  }
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);
  const absl::Time frozen = absl::Now();
  survivor.join();
  stop = true;
  ::kill(c.daemon(1).pid(), SIGKILL);  // releases the frozen peer's rank
  peer.join();
  // Whether the freeze caught transfers in flight (which only the abort grace finishes).
  const bool stuck = c.daemon(0).Log().find("still in flight") != std::string::npos;
  std::printf("rank 0 failed %s after daemon 1 froze (after %d rounds, %s): %s\n",
              absl::FormatDuration(failed_at - frozen).c_str(), rounds.load(),
              stuck ? "transfers in flight closed" : "between transfers",
              failed.ToString().c_str());
  EXPECT_GE(rounds.load(), 3);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_LT(failed_at - frozen, absl::Seconds(7))
      << "rank 0 failed " << absl::FormatDuration(failed_at - frozen)
      << " after the freeze: " << failed;
}

}  // namespace
}  // namespace flatshard::client
