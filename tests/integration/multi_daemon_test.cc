// Failure tests of multi-daemon groups: several real flatshardd processes on this host stand in
// for nodes (tests/testing/cluster.h), trainers are threads with their own Client talking to
// their own rank's daemon, every join names daemon 0 as the coordinator. Covers a daemon
// killed mid-collective, ranks that disagree on the op order, a daemon restarted under the
// same node name, the admin view of a pending collective, join deadlines and tokens checked
// at the coordinator (DESIGN.md "Lifecycles", "Collective order and failure").

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/shard_snapshot.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::SnapshotShards;

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::ConnectOptions;
using ::flatshard::testing::ExpectParams;
using ::flatshard::testing::JoinRanks;
using ::flatshard::testing::Layout;
using ::flatshard::testing::OnCluster;
using ::flatshard::testing::Rank;
using ::flatshard::testing::RegisterExample;
using ::flatshard::testing::RunRanks;
using ::flatshard::testing::WriteParams;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::UnorderedElementsAreArray;

constexpr char kToken[] = "t0k";

::flatshard::testing::ClusterOptions Options() {
  ::flatshard::testing::ClusterOptions o;
  o.tag_prefix = "fsmd";
  return o;
}

// A client without retries (the tests look at each call's own outcome).
ConnectOptions NoRetries(absl::Duration call_timeout = absl::Seconds(10),
                         absl::Duration join_timeout = absl::Seconds(10)) {
  return {call_timeout, join_timeout, 1};
}

// Threads joined on every path out of a test (a failed ASSERT included).
class Threads {
 public:
  Threads() = default;
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;
  ~Threads() { Join(); }
  template <typename F>
  void Start(F&& f) {
    threads_.emplace_back(std::forward<F>(f));
  }
  void Join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  std::vector<std::thread> threads_;
};

// Connects a client per rank (to its daemon) and joins every rank of `group` concurrently.
std::vector<Rank> JoinAll(const Cluster& c, const std::string& group, int world,
                          absl::Duration call_timeout = absl::Seconds(10)) {
  return JoinRanks(world, OnCluster(c, group, kToken, NoRetries(call_timeout)));
}

SummonOptions ReadOnly() {
  SummonOptions o;
  o.writeback = false;
  return o;
}

// Element i of parameter `fqn`, exact in float32.
float Value(const std::string& fqn, int64_t i) {
  uint32_t h = 2166136261u;
  for (unsigned char c : fqn) h = (h ^ c) * 16777619u;
  return static_cast<float>(1 + h % 61) + static_cast<float>(i % 64) * 0.25f;
}

// Every rank writes Value() into a writeback summon of the whole model and ends it.
void InitValues(std::vector<Rank>& ranks) { WriteParams(ranks, Value); }

// Every rank summons the whole model read-only and checks Value() everywhere.
void ExpectValuesEverywhere(std::vector<Rank>& ranks) { ExpectParams(ranks, Value); }

// Names the first difference between two SnapshotShards() results ("" when equal).
std::string SnapshotDiff(const std::vector<std::vector<float>>& got,
                         const std::vector<std::vector<float>>& want) {
  if (got.size() != want.size()) {
    return absl::StrCat(got.size() / 2, " units, want ", want.size() / 2);
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const std::string what =
        absl::StrCat("unit ", i / 2, i % 2 == 0 ? " shard" : " gradient shard");
    if (got[i].size() != want[i].size()) {
      return absl::StrCat(what, ": ", got[i].size(), " elements, want ", want[i].size(),
                          want[i].empty() ? " (none)" : "");
    }
    for (size_t j = 0; j < got[i].size(); ++j) {
      if (got[i][j] != want[i][j]) {
        return absl::StrCat(what, " element ", j, ": ", got[i][j], ", want ", want[i][j]);
      }
    }
  }
  return "";
}

int32_t UnitOf(const Plan& plan, const std::string& module) {
  for (const PlanUnit& u : plan.units) {
    if (u.module == module) return u.index;
  }
  ADD_FAILURE() << "no unit for module " << module;
  return -1;
}

// Raw AdminService.ListPendingCollectives on a daemon's socket.
absl::StatusOr<v1::ListPendingCollectivesResponse> ListPending(const std::string& address,
                                                               const std::string& group = "") {
  auto stub =
      v1::AdminService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListPendingCollectivesRequest req;
  req.set_group(group);
  v1::ListPendingCollectivesResponse resp;
  grpc::Status st = stub->ListPendingCollectives(&ctx, req, &resp);
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  return resp;
}

const v1::GroupCollectives* FindGroup(const v1::ListPendingCollectivesResponse& resp,
                                      const std::string& group) {
  for (const v1::GroupCollectives& g : resp.groups()) {
    if (g.group() == group) return &g;
  }
  return nullptr;
}

// Rejoins every rank of a failed group (Leave, then Join concurrently) and re-attaches by
// registering the same model again.
void RejoinAndReattach(const Cluster& c, std::vector<Rank>& ranks, const std::string& group) {
  const int world = static_cast<int>(ranks.size());
  RunRanks(world, [&](int r) {
    absl::Status left = ranks[r].client->Leave();
    EXPECT_TRUE(left.ok()) << "rank " << r << " Leave: " << left;
    absl::Status joined = ranks[r].client->Join(group, world, r, kToken, c.coordinator());
    ASSERT_TRUE(joined.ok()) << "rank " << r << " joining again: " << joined;
    EXPECT_THAT(ranks[r].client->registered_modules(), ::testing::ElementsAre(""));
  });
  RegisterExample(ranks);
}

// ---- (a) A daemon killed with SIGKILL mid-collective ----

struct KillCase {
  std::string name;
  int victim;  // the daemon killed: 0 is the coordinator
  // SIGKILL: the process is gone and its connections close at once. SIGSTOP: it hangs with its
  // connections open (an unreachable peer), found only by missed heartbeats (--peer_timeout).
  int signal = SIGKILL;
};

void PrintTo(const KillCase& c, std::ostream* os) { *os << c.name; }

class KilledDaemonTest : public ::testing::TestWithParam<KillCase> {};

// Two daemons, world 4 (ranks 0 and 2 on daemon 0, 1 and 3 on daemon 1). The surviving
// daemon's ranks block in Summon while the victim's ranks never arrive; then the victim is
// killed. The survivors fail within 5 s (heartbeats, --peer_timeout 3 s by default), with one
// sticky UNAVAILABLE that later collectives get at once; the surviving daemon leaves no
// segment behind when it exits.
TEST_P(KilledDaemonTest, SurvivorsFailWithinFiveSecondsAndLeakNothing) {
  Cluster c(Layout::kTwoDaemons, Options());
  const int victim = GetParam().victim;
  const int survivor = 1 - victim;
  constexpr int kWorld = 4;
  // The call timeout is far beyond 5 s: the error must come from the dead peer, not a deadline.
  std::vector<Rank> ranks = JoinAll(c, "g", kWorld, absl::Seconds(30));
  RegisterExample(ranks);
  InitValues(ranks);
  std::vector<int> survivors;
  for (int r = 0; r < kWorld; ++r) {
    if (c.DaemonOf(r) == survivor) survivors.push_back(r);
  }

  std::vector<absl::Status> status(kWorld);
  std::vector<absl::Time> done_at(kWorld);
  Threads threads;
  for (int r : survivors) {
    threads.Start([&, r] {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s =
          ranks[r].client->Summon("", "", ReadOnly());
      done_at[r] = absl::Now();
      status[r] = s.status();
    });
  }
  // Wait until the survivors' summon is pending at their daemon, then kill the other one.
  bool pending = false;
  for (int i = 0; i < 100 && !pending; ++i) {
    absl::StatusOr<v1::ListPendingCollectivesResponse> resp =
        ListPending(c.daemon(survivor).address(), "g");
    if (resp.ok()) {
      const v1::GroupCollectives* g = FindGroup(*resp, "g");
      pending = g != nullptr && !g->pending().empty();
    }
    if (!pending) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(pending) << "the survivors' summon never showed up as pending";
  const absl::Time killed = absl::Now();
  if (GetParam().signal == SIGKILL) {
    c.Kill(victim);
  } else {
    ASSERT_EQ(::kill(c.daemon(victim).pid(), GetParam().signal), 0);
  }
  threads.Join();
  for (int r : survivors) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kUnavailable)
        << "rank " << r << ": " << status[r];
    EXPECT_LT(done_at[r] - killed, absl::Seconds(5))
        << "rank " << r << " failed " << absl::FormatDuration(done_at[r] - killed)
        << " after the kill: " << status[r];
  }
  EXPECT_EQ(status[survivors[0]], status[survivors[1]]) << "one sticky status for the group";

  // Later collectives fail at once with the same status.
  std::vector<absl::Status> later(kWorld);
  const absl::Time again = absl::Now();
  Threads more;
  for (int r : survivors) {
    more.Start([&, r] { later[r] = ranks[r].client->Summon("", "", ReadOnly()).status(); });
  }
  more.Join();
  EXPECT_LT(absl::Now() - again, absl::Seconds(2)) << "a later collective waited";
  for (int r : survivors) {
    EXPECT_EQ(later[r].code(), absl::StatusCode::kUnavailable) << "rank " << r << ": " << later[r];
    EXPECT_EQ(later[r].message(), status[r].message()) << "rank " << r;
  }
  // The admin view shows the sticky status.
  absl::StatusOr<v1::ListPendingCollectivesResponse> resp =
      ListPending(c.daemon(survivor).address(), "g");
  ASSERT_TRUE(resp.ok()) << resp.status();
  const v1::GroupCollectives* g = FindGroup(*resp, "g");
  ASSERT_NE(g, nullptr);
  EXPECT_NE(g->status(), "OK");

  // No leaked segments once the surviving daemon exits (the victim's stay, as after a crash;
  // the Cluster removes them).
  if (GetParam().signal != SIGKILL) c.Kill(victim);
  ranks.clear();
  EXPECT_EQ(c.daemon(survivor).Terminate(), 0);
  EXPECT_THAT(c.daemon(survivor).Segments(), ::testing::IsEmpty());
}

INSTANTIATE_TEST_SUITE_P(Kill, KilledDaemonTest,
                         ::testing::Values(KillCase{"Coordinator", 0}, KillCase{"Peer", 1},
                                           KillCase{"CoordinatorHangs", 0, SIGSTOP},
                                           KillCase{"PeerHangs", 1, SIGSTOP}),
                         [](const ::testing::TestParamInfo<KillCase>& info) {
                           return info.param.name;
                         });

// ---- (b) Ranks on different daemons disagree on the op order ----

// Also in Single (one daemon, the inproc backend), for comparison: the same rules hold there.
class MismatchTest : public ::testing::TestWithParam<Layout> {};

// Rank 0 summons unit h.0 while rank 1 (another daemon) summons h.1; the other ranks (in
// ThreeDaemonsUneven, world 4) summon h.0 like rank 0. Every rank fails with ABORTED naming
// both ops and ranks; no shard changes; once every rank joins again the values are intact.
TEST_P(MismatchTest, DifferentUnitsAbortEveryRankAndChangeNothing) {
  Cluster c(GetParam(), Options());
  const int world = c.layout() == Layout::kTwoDaemons ? 2 : 4;
  std::vector<Rank> ranks = JoinAll(c, "g", world);
  RegisterExample(ranks);
  InitValues(ranks);
  const Plan& plan = *ranks[0].model.plan;
  const int32_t h0 = UnitOf(plan, "h.0");
  const int32_t h1 = UnitOf(plan, "h.1");
  std::vector<std::vector<std::vector<float>>> before(world);
  for (int r = 0; r < world; ++r) before[r] = SnapshotShards(*ranks[r].client);

  std::vector<absl::Status> status(world);
  RunRanks(world, [&](int r) {
    status[r] = ranks[r].client->Summon("", r == 1 ? "h.1" : "h.0", ReadOnly()).status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kAborted) << "rank " << r << ": " << status[r];
    EXPECT_THAT(status[r].message(),
                AllOf(HasSubstr("collective mismatch at op_seq"),
                      HasSubstr(absl::StrCat("rank 1 called AllGather(unit ", h1, ",")),
                      HasSubstr(absl::StrCat(" called AllGather(unit ", h0, ","))))
        << "rank " << r;
  }
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(SnapshotDiff(SnapshotShards(*ranks[r].client), before[r]), "") << "rank " << r;
  }
  RejoinAndReattach(c, ranks, "g");
  ExpectValuesEverywhere(ranks);
}

// Rank 0 summons while rank 1 (another daemon) reduce-scatters a gradient: ABORTED on both,
// naming the AllGather and the ReduceScatter; shards and gradient shards unchanged.
TEST_P(MismatchTest, SummonVersusReduceScatterAbortsEveryRankAndChangesNothing) {
  Cluster c(GetParam(), Options());
  constexpr int kWorld = 2;
  std::vector<Rank> ranks = JoinAll(c, "g", kWorld);
  RegisterExample(ranks);
  InitValues(ranks);
  const int32_t h0 = UnitOf(*ranks[0].model.plan, "h.0");
  std::vector<std::vector<std::vector<float>>> before(kWorld);
  for (int r = 0; r < kWorld; ++r) before[r] = SnapshotShards(*ranks[r].client);

  std::vector<absl::Status> status(kWorld);
  RunRanks(kWorld, [&](int r) {
    if (r == 0) {
      status[r] = ranks[r].client->Summon("", "h.0", ReadOnly()).status();
      return;
    }
    status[r] = ranks[r].client->ReduceScatterGrads(
        "", h0, ReduceOp::kSum, false, [](PendingReduceScatter& pending) {
          float* data = static_cast<float*>(pending.data());
          std::fill_n(data, pending.numel(), 100.0f);
          return absl::OkStatus();
        });
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kAborted) << "rank " << r << ": " << status[r];
    EXPECT_THAT(status[r].message(),
                AllOf(HasSubstr("collective mismatch at op_seq"),
                      HasSubstr(absl::StrCat("rank 0 called AllGather(unit ", h0, ",")),
                      HasSubstr(absl::StrCat("but rank 1 called ReduceScatter(unit ", h0, ","))))
        << "rank " << r;
  }
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(SnapshotDiff(SnapshotShards(*ranks[r].client), before[r]), "") << "rank " << r;
  }
  RejoinAndReattach(c, ranks, "g");
  ExpectValuesEverywhere(ranks);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(SnapshotDiff(SnapshotShards(*ranks[r].client), before[r]), "")
        << "rank " << r << " after re-forming";
  }
  // No gradient was ever reduced: a with_grads summon works on every rank and shows none
  // (gradients exist on every rank of a unit or on none).
  RunRanks(kWorld, [&](int r) {
    SummonOptions with_grads = ReadOnly();
    with_grads.with_grads = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", with_grads);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    EXPECT_TRUE((*s)->grads().empty()) << "rank " << r;
    absl::Status ended = (*s)->End();
    EXPECT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, MismatchTest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());

// ---- (c) A daemon restarted with the same node name ----

TEST(RestartedDaemonTest, JoinsANewGroupAndTheOldGroupReforms) {
  Cluster c(Layout::kTwoDaemons, Options());
  std::vector<Rank> old_ranks = JoinAll(c, "old", 2, absl::Seconds(20));
  RegisterExample(old_ranks);
  InitValues(old_ranks);
  absl::StatusOr<v1::ListPendingCollectivesResponse> before =
      ListPending(c.daemon(0).address(), "old");
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_NE(FindGroup(*before, "old"), nullptr);
  const uint64_t old_epoch = FindGroup(*before, "old")->epoch();

  c.Kill(1);
  // Rank 0's next collective fails once daemon 0 notices.
  const absl::Time killed = absl::Now();
  absl::Status failed = old_ranks[0].client->Summon("", "", ReadOnly()).status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_LT(absl::Now() - killed, absl::Seconds(5));
  old_ranks[1] = Rank();  // its daemon is gone

  ASSERT_TRUE(c.Restart(1));
  EXPECT_EQ(c.daemon(1).node_name(), "node1");
  // A new group across daemon 0 and the restarted daemon works end to end.
  {
    std::vector<Rank> fresh = JoinAll(c, "new", 2);
    RegisterExample(fresh);
    InitValues(fresh);
    ExpectValuesEverywhere(fresh);
  }
  // The old group re-forms once every rank joins again: rank 0 (still on daemon 0) and a new
  // rank-1 trainer on the restarted daemon.
  old_ranks[1].client = ConnectClient(c.AddressFor(1), NoRetries());
  ASSERT_NE(old_ranks[1].client, nullptr);
  RunRanks(2, [&](int r) {
    if (r == 0) {
      absl::Status left = old_ranks[0].client->Leave();
      EXPECT_TRUE(left.ok()) << left;
    }
    absl::Status joined = old_ranks[r].client->Join("old", 2, r, kToken, c.coordinator());
    EXPECT_TRUE(joined.ok()) << "rank " << r << " rejoining the old group: " << joined;
  });
  absl::StatusOr<v1::ListPendingCollectivesResponse> after =
      ListPending(c.daemon(0).address(), "old");
  ASSERT_TRUE(after.ok()) << after.status();
  const v1::GroupCollectives* g = FindGroup(*after, "old");
  ASSERT_NE(g, nullptr);
  EXPECT_GT(g->epoch(), old_epoch) << "the re-formed group has a new epoch";
  EXPECT_EQ(g->status(), "OK");
  EXPECT_TRUE(g->pending().empty());
}

// ---- (d) The admin RPC while a rank is absent ----

// Three daemons, world 4 (ranks 0 and 3 on daemon 0, 1 on daemon 1, 2 on daemon 2): ranks 0,
// 1 and 3 summon, rank 2 does not. Each daemon lists the group with its local ranks, and the
// daemons with an arrived rank list the pending collective with rank 2 missing.
TEST(AdminTest, ListPendingCollectivesShowsArrivedAndMissingRanks) {
  Cluster c(Layout::kThreeDaemonsUneven, Options());
  constexpr int kWorld = 4;
  std::vector<Rank> ranks = JoinAll(c, "g", kWorld);
  RegisterExample(ranks);
  std::vector<std::unique_ptr<SummonedParams>> summons(kWorld);
  std::vector<absl::Status> status(kWorld);
  auto summon = [&](int r) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", ReadOnly());
    status[r] = s.status();
    if (s.ok()) summons[r] = *std::move(s);
  };
  Threads threads;
  for (int r : {0, 1, 3}) threads.Start([&summon, r] { summon(r); });

  // Daemon 0 (ranks 0 and 3) shows the pending op once both its ranks arrived.
  const std::vector<std::vector<int>> local = {{0, 3}, {1}, {2}};
  v1::PendingCollective seen;
  bool found = false;
  for (int i = 0; i < 150 && !found; ++i) {
    absl::StatusOr<v1::ListPendingCollectivesResponse> resp = ListPending(c.daemon(0).address());
    ASSERT_TRUE(resp.ok()) << resp.status();
    const v1::GroupCollectives* g = FindGroup(*resp, "g");
    if (g != nullptr && !g->pending().empty()) {
      const v1::PendingCollective& p = g->pending(0);
      std::set<int> arrived(p.arrived_ranks().begin(), p.arrived_ranks().end());
      if (arrived.count(0) && arrived.count(3)) {
        seen = p;
        found = true;
        break;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(found) << "daemon 0 never listed the summon with ranks 0 and 3 arrived";
  EXPECT_THAT(seen.missing_ranks(), Contains(2));
  EXPECT_THAT(seen.arrived_ranks(), Not(Contains(2)));
  std::vector<int> all(seen.arrived_ranks().begin(), seen.arrived_ranks().end());
  all.insert(all.end(), seen.missing_ranks().begin(), seen.missing_ranks().end());
  EXPECT_THAT(all, UnorderedElementsAreArray({0, 1, 2, 3}))
      << "every rank is either arrived or missing, once";
  EXPECT_FALSE(seen.running());
  EXPECT_EQ(seen.kind(), "AllGather");
  EXPECT_GT(seen.op_seq(), 0u);

  uint64_t epoch = 0;
  for (int d = 0; d < 3; ++d) {
    SCOPED_TRACE(absl::StrCat("daemon ", d));
    absl::StatusOr<v1::ListPendingCollectivesResponse> resp = ListPending(c.daemon(d).address());
    ASSERT_TRUE(resp.ok()) << resp.status();
    const v1::GroupCollectives* g = FindGroup(*resp, "g");
    ASSERT_NE(g, nullptr);
    EXPECT_EQ(g->world_size(), kWorld);
    EXPECT_THAT(g->local_ranks(), UnorderedElementsAreArray(local[d]));
    EXPECT_EQ(g->status(), "OK");
    if (d == 0) epoch = g->epoch();
    EXPECT_EQ(g->epoch(), epoch) << "every daemon is at the coordinator's epoch";
    if (d == 1) {  // rank 1 arrived here
      ASSERT_FALSE(g->pending().empty());
      EXPECT_THAT(g->pending(0).arrived_ranks(), Contains(1));
      EXPECT_THAT(g->pending(0).missing_ranks(), Contains(2));
    }
    for (const v1::PendingCollective& p : g->pending()) {
      EXPECT_THAT(p.arrived_ranks(), Not(Contains(2)));
    }
  }
  // A filter on a group the daemon does not host: NOT_FOUND (or nothing of "g").
  absl::StatusOr<v1::ListPendingCollectivesResponse> other =
      ListPending(c.daemon(0).address(), "nope");
  if (other.ok()) {
    EXPECT_EQ(FindGroup(*other, "g"), nullptr);
  } else {
    EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound) << other.status();
  }

  // Rank 2 arrives: every summon completes and nothing is pending any more.
  threads.Start([&summon] { summon(2); });
  threads.Join();
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  RunRanks(kWorld, [&](int r) {
    absl::Status ended = summons[r]->End();
    EXPECT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
  });
  for (int d = 0; d < 3; ++d) {
    absl::StatusOr<v1::ListPendingCollectivesResponse> resp = ListPending(c.daemon(d).address());
    ASSERT_TRUE(resp.ok()) << resp.status();
    const v1::GroupCollectives* g = FindGroup(*resp, "g");
    ASSERT_NE(g, nullptr);
    EXPECT_TRUE(g->pending().empty()) << "daemon " << d << ": " << g->DebugString();
  }
}

// ---- (e) Join deadlines across daemons ----

// Three daemons, world 4. Ranks that joined at different daemons all learn which ranks are
// missing, also when the coordinator's own ranks are the missing ones; a failed join leaves no
// trace.
TEST(JoinAcrossDaemonsTest, DeadlineNamesTheMissingRanks) {
  Cluster c(Layout::kThreeDaemonsUneven, Options());
  constexpr int kWorld = 4;
  auto join_some = [&](const std::vector<int>& which, absl::Duration timeout) {
    std::vector<absl::Status> out(kWorld);
    Threads threads;
    for (int r : which) {
      threads.Start([&, r] {
        std::unique_ptr<Client> client =
            ConnectClient(c.AddressFor(r), NoRetries(absl::Seconds(10), timeout));
        if (client == nullptr) return;
        out[r] = client->Join("g", kWorld, r, kToken, c.coordinator());
      });
    }
    threads.Join();
    return out;
  };
  std::vector<absl::Status> s = join_some({0, 1}, absl::Seconds(1));
  for (int r : {0, 1}) {
    EXPECT_EQ(s[r].code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << ": " << s[r];
    EXPECT_THAT(s[r].message(), HasSubstr("ranks 2, 3 of 4 did not join")) << "rank " << r;
  }
  s = join_some({1, 2}, absl::Seconds(1));
  for (int r : {1, 2}) {
    EXPECT_EQ(s[r].code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << ": " << s[r];
    EXPECT_THAT(s[r].message(), HasSubstr("ranks 0, 3 of 4 did not join")) << "rank " << r;
  }
  std::vector<Rank> ranks = JoinAll(c, "g", kWorld);
  for (const Rank& r : ranks) EXPECT_TRUE(r.client != nullptr && r.client->joined());
}

// ---- (f) Tokens are checked at the coordinator ----

// Three daemons, world 4. Rank 1 creates the group at the coordinator through daemon 1; a
// wrong token is refused at once, whichever daemon it arrives at (daemon 2 has never seen
// the group; daemon 0 is the coordinator itself), and changes nothing.
TEST(JoinAcrossDaemonsTest, WrongTokenAtTheCoordinatorIsPermissionDenied) {
  Cluster c(Layout::kThreeDaemonsUneven, Options());
  constexpr int kWorld = 4;
  std::vector<Rank> ranks(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    ranks[r].client = ConnectClient(c.AddressFor(r), NoRetries());
    ASSERT_NE(ranks[r].client, nullptr);
  }
  absl::Status first;
  Threads rank1;
  rank1.Start([&] { first = ranks[1].client->Join("g", kWorld, 1, kToken, c.coordinator()); });
  absl::SleepFor(absl::Milliseconds(300));
  for (int r : {2, 0}) {
    const absl::Time start = absl::Now();
    absl::Status bad = ranks[r].client->Join("g", kWorld, r, "nope", c.coordinator());
    EXPECT_EQ(bad.code(), absl::StatusCode::kPermissionDenied) << "rank " << r << ": " << bad;
    EXPECT_THAT(bad.message(), HasSubstr("wrong token")) << "rank " << r;
    EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "refused only at the deadline";
    EXPECT_FALSE(ranks[r].client->joined());
  }
  std::vector<absl::Status> status(kWorld);
  RunRanks(kWorld, [&](int r) {
    if (r == 1) return;
    status[r] = ranks[r].client->Join("g", kWorld, r, kToken, c.coordinator());
  });
  rank1.Join();
  status[1] = first;
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
}

}  // namespace
}  // namespace flatshard::client
