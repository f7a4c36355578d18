#include "server/peer/coordinator.h"

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/ucx/ucx_tag.h"

namespace flatshard::server::peer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

DaemonIdentity Daemon(const std::string& node, const std::string& id) {
  return DaemonIdentity{node, id, node + ":7451", "ucx-" + id};
}

const DaemonIdentity kA = Daemon("a", "a-1");
const DaemonIdentity kB = Daemon("b", "b-1");
const DaemonIdentity kC = Daemon("c", "c-1");
const DaemonIdentity kBRestarted = Daemon("b", "b-2");

// Records what the coordinator pushes down one Watch stream.
class FakeSink final : public WatchSink {
 public:
  struct Event {
    enum Kind { kTable, kFailure, kClose } kind;
    PeerTable table;
    std::string group;
    uint64_t epoch = 0;
    absl::Status status;
  };

  void PushTable(const PeerTable& table) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(Event{Event::kTable, table, table.group, table.epoch, absl::OkStatus()});
  }
  void PushFailure(const std::string& group, uint64_t epoch, const absl::Status& s) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(Event{Event::kFailure, {}, group, epoch, s});
  }
  void Close(const absl::Status& s) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(Event{Event::kClose, {}, "", 0, s});
  }
  std::vector<Event> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(events_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<Event> events_;
};

// The outcome of one Rendezvous call; `calls` proves it is answered exactly once. Shared with
// the callback, which may run after the test body (the coordinator's destructor fails it).
struct Result {
  struct State {
    int calls = 0;
    std::optional<absl::StatusOr<PeerTable>> value;
  };
  std::shared_ptr<State> s = std::make_shared<State>();
  Coordinator::RendezvousCallback Callback() {
    return [s = s](absl::StatusOr<PeerTable> r) {
      ++s->calls;
      s->value = std::move(r);
    };
  }
  int calls() const { return s->calls; }
  const absl::StatusOr<PeerTable>& value() const { return *s->value; }
  bool answered() const { return s->calls > 0; }
  absl::Status status() const { return s->value->status(); }
};

class CoordinatorTest : public ::testing::Test {
 protected:
  CoordinatorTest()
      : coordinator_(CoordinatorOptions{absl::Seconds(3), [this] {
                                          absl::MutexLock lock(&clock_mu_);
                                          return now_;
                                        }}) {}

  void Advance(absl::Duration d) {
    {
      absl::MutexLock lock(&clock_mu_);
      now_ += d;
    }
    coordinator_.ExpireDeadlines();
  }
  absl::Time Now() {
    absl::MutexLock lock(&clock_mu_);
    return now_;
  }

  // Rank `rank` of group "g" (world `world`, token "t") arrives from `daemon`, deadline in 10 s.
  void Join(Result& r, const DaemonIdentity& daemon, int rank, int world = 2,
            const std::string& group = "g", const std::string& token = "t",
            absl::Duration wait = absl::Seconds(10)) {
    coordinator_.Rendezvous(RendezvousArgs{group, token, world, rank, daemon}, Now() + wait,
                            r.Callback());
  }

  Coordinator::WatcherId WatchWith(const DaemonIdentity& d, std::shared_ptr<FakeSink> sink) {
    absl::StatusOr<Coordinator::WatcherId> id = coordinator_.Watch(d, sink);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }

  // Forms "g" at epoch 1 with A on rank 0 and B on rank 1.
  void FormAB() {
    Result r0, r1;
    Join(r0, kA, 0);
    Join(r1, kB, 1);
    ASSERT_TRUE(r0.answered() && r0.value().ok()) << r0.status();
    ASSERT_TRUE(r1.answered() && r1.value().ok()) << r1.status();
    ASSERT_EQ(r0.value()->epoch, 1u);
  }

  std::optional<GroupSnapshot> Group(const std::string& name) {
    for (GroupSnapshot& g : coordinator_.Snapshot().groups) {
      if (g.group == name) return g;
    }
    return std::nullopt;
  }

  absl::Mutex clock_mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  Coordinator coordinator_;
};

TEST_F(CoordinatorTest, TableCompletesWhenEveryRankArrives) {
  Result r0, r1, r2;
  Join(r0, kA, 0, 3);
  Join(r1, kB, 1, 3);
  EXPECT_FALSE(r0.answered());
  EXPECT_FALSE(r1.answered());
  std::optional<GroupSnapshot> g = Group("g");
  ASSERT_TRUE(g.has_value());
  EXPECT_THAT(g->pending_ranks, ElementsAre(0, 1));
  EXPECT_EQ(g->epoch, 0u);

  Join(r2, kB, 2, 3);
  for (Result* r : {&r0, &r1, &r2}) {
    ASSERT_EQ(r->calls(), 1);
    ASSERT_TRUE(r->value().ok()) << r->status();
    EXPECT_EQ(r->value()->group, "g");
    EXPECT_EQ(r->value()->epoch, 1u);
    EXPECT_THAT(r->value()->rank_daemons, ElementsAre(kA, kB, kB));
  }
  g = Group("g");
  EXPECT_THAT(g->pending_ranks, IsEmpty());
  EXPECT_FALSE(g->dirty);
}

TEST_F(CoordinatorTest, RejectsInvalidArguments) {
  struct Case {
    RendezvousArgs args;
    const char* says;
  } cases[] = {
      {{"", "t", 2, 0, kA}, "empty group"},
      {{"g", "t", 0, 0, kA}, "world_size 0 is not in [1, 1048576]"},
      {{"g", "t", 2147483647, 0, kA}, "world_size 2147483647 is not in [1, 1048576]"},
      {{"g", "t", 2, -1, kA}, "rank -1 out of range [0, 2)"},
      {{"g", "t", 2, 2, kA}, "rank 2 out of range [0, 2)"},
      {{"g", "t", 2, 0, Daemon("a", "")}, "empty daemon_id"},
      {{"g", "t", 2, 0, Daemon(std::string(2000, 'n'), "a-1")}, "oversized daemon identity"},
      {{std::string(2000, 'g'), "t", 2, 0, kA}, "oversized daemon identity"},
  };
  DaemonIdentity huge_address = kA;
  huge_address.backend_address.assign(1 << 20, 'x');
  {
    Result r;
    coordinator_.Rendezvous({"g", "t", 2, 0, huge_address}, Now() + absl::Seconds(1), r.Callback());
    ASSERT_EQ(r.calls(), 1);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("backend address over 65536 bytes"));
  }
  for (Case& c : cases) {
    Result r;
    coordinator_.Rendezvous(c.args, Now() + absl::Seconds(1), r.Callback());
    ASSERT_EQ(r.calls(), 1);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.says));
  }
  EXPECT_THAT(coordinator_.Snapshot().groups, IsEmpty());

  Result first, other;
  Join(first, kA, 0, 2);
  Join(other, kB, 1, 3);
  ASSERT_TRUE(other.answered());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other.status().message(),
              HasSubstr("group g has world_size 2, rank 1 joined with world_size 3"));
  EXPECT_FALSE(first.answered());
  EXPECT_FALSE(Group("g")->members[1].has_value());
}

TEST_F(CoordinatorTest, WrongTokenIsPermissionDeniedEverywhere) {
  Result first;
  Join(first, kA, 0, 2, "g", "secret");
  for (const char* token : {"secreT", "secret2", "", "secre"}) {
    Result r;
    Join(r, kB, 1, 2, "g", token);
    ASSERT_TRUE(r.answered());
    EXPECT_EQ(r.status(), absl::PermissionDeniedError("group g: wrong token"));
  }
  EXPECT_EQ(coordinator_.Depart("g", "nope", 0, kA.daemon_id),
            absl::PermissionDeniedError("group g: wrong token"));
  EXPECT_EQ(coordinator_.ReportFailure("nope", kA.daemon_id, "g", 0, absl::AbortedError("x")),
            absl::PermissionDeniedError("group g: wrong token"));
  EXPECT_TRUE(Group("g")->members[0].has_value());  // the wrong-token Depart cleared nothing
  EXPECT_FALSE(first.answered());
}

TEST_F(CoordinatorTest, DeadlineNamesMissingRanksAndLeavesNoTrace) {
  Result r0, r2;
  Join(r0, kA, 0, 4, "g", "t", absl::Seconds(1));
  Join(r2, kB, 2, 4, "g", "t", absl::Seconds(1));
  EXPECT_EQ(coordinator_.NextDeadline(), Now() + absl::Seconds(1));
  Advance(absl::Milliseconds(999));
  EXPECT_FALSE(r0.answered());
  Advance(absl::Milliseconds(1));
  for (Result* r : {&r0, &r2}) {
    ASSERT_EQ(r->calls(), 1);
    EXPECT_EQ(r->status(), absl::DeadlineExceededError(
                               "group g: ranks 1, 3 of 4 did not join before the deadline"));
  }
  EXPECT_THAT(coordinator_.Snapshot().groups, IsEmpty());
  EXPECT_EQ(coordinator_.NextDeadline(), absl::InfiniteFuture());
}

// Resident memory of this process in bytes (/proc/self/statm).
int64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long size = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &size, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

// Before, a rendezvous with world_size 2^20 made a slot per rank up front (~200 MB); the
// deadline's message listed every missing rank.
TEST_F(CoordinatorTest, HugeWorldSizeCostsLittleAndItsDeadlineMessageStaysShort) {
  const int64_t before = ResidentBytes();
  std::vector<Result> results(4);
  for (int i = 0; i < 4; ++i) {
    Join(results[i], kA, 3, 1 << 20, "huge" + std::to_string(i), "t", absl::Seconds(1));
  }
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, int64_t{32} << 20) << (grown >> 20) << " MiB for 4 huge rendezvous";
  std::optional<GroupSnapshot> g = Group("huge0");
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->world_size, 1 << 20);
  Advance(absl::Seconds(1));
  for (Result& r : results) {
    ASSERT_EQ(r.calls(), 1);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(r.status().message()),
                ::testing::EndsWith(", 15, 16, ... (1048575 ranks) of 1048576 did not join "
                                    "before the deadline"));
  }
}

// The table carries what each rank's daemon reported this round; ranks that did not take
// part are unknown (nullopt), not "holding nothing".
TEST_F(CoordinatorTest, TableCarriesTheModulesReportedThisRoundOnly) {
  FormAB();
  Result r0, r1;
  RendezvousArgs a{"g", "t", 2, 0, kA};
  a.registered_modules = {
      "layers\x1f"
      "fp0"};
  coordinator_.Rendezvous(a, Now() + absl::Seconds(10), r0.Callback());
  ASSERT_TRUE(r0.answered() && r0.value().ok()) << r0.status();
  ASSERT_EQ(r0.value()->rank_modules.size(), 2u);
  EXPECT_EQ(r0.value()->rank_modules[0], std::vector<std::string>({"layers\x1f"
                                                                   "fp0"}));
  EXPECT_EQ(r0.value()->rank_modules[1], std::nullopt) << "rank 1 did not report this round";
  RendezvousArgs b{"g", "t", 2, 1, kBRestarted};
  coordinator_.Rendezvous(b, Now() + absl::Seconds(10), r1.Callback());
  ASSERT_TRUE(r1.answered() && r1.value().ok()) << r1.status();
  // A daemon that holds nothing (restarted) reports exactly that.
  ASSERT_EQ(r1.value()->rank_modules.size(), 2u);
  EXPECT_EQ(r1.value()->rank_modules[0], std::nullopt);
  EXPECT_EQ(r1.value()->rank_modules[1], std::vector<std::string>());
}

TEST_F(CoordinatorTest, RanksWaitingWithAboutTheSameDeadlineNameTheSameMissingRanks) {
  Result r0, r1;
  Join(r0, kA, 0, 4, "g", "t", absl::Milliseconds(1000));
  Join(r1, kB, 1, 4, "g", "t", absl::Milliseconds(1010));
  Advance(absl::Milliseconds(1000));
  ASSERT_TRUE(r0.answered());
  ASSERT_FALSE(r1.answered());
  Advance(absl::Milliseconds(10));
  ASSERT_TRUE(r1.answered());
  for (Result* r : {&r0, &r1}) {
    EXPECT_EQ(r->status().message(), "group g: ranks 2, 3 of 4 did not join before the deadline");
  }
  // Long after a rank gave up, it is missing like any other.
  Result late0, late1;
  Join(late1, kB, 1, 4, "g", "t", absl::Seconds(5));
  Join(late0, kA, 0, 4, "g", "t", absl::Seconds(1));
  Advance(absl::Seconds(1));
  ASSERT_TRUE(late0.answered());
  Advance(absl::Seconds(4));
  ASSERT_TRUE(late1.answered());
  EXPECT_EQ(late1.status().message(),
            "group g: ranks 0, 2, 3 of 4 did not join before the deadline");
}

TEST_F(CoordinatorTest, ExpiryClearsOnlyTheExpiredArrival) {
  Result early, late;
  Join(early, kA, 0, 3, "g", "t", absl::Seconds(1));
  Join(late, kB, 1, 3, "g", "t", absl::Seconds(5));
  Advance(absl::Seconds(1));
  ASSERT_TRUE(early.answered());
  EXPECT_EQ(early.status().message(), "group g: rank 2 of 3 did not join before the deadline");
  EXPECT_FALSE(late.answered());
  std::optional<GroupSnapshot> g = Group("g");
  EXPECT_FALSE(g->members[0].has_value());
  EXPECT_EQ(g->members[1], kB);
  EXPECT_THAT(g->pending_ranks, ElementsAre(1));
  EXPECT_EQ(coordinator_.NextDeadline(), Now() + absl::Seconds(4));
}

TEST_F(CoordinatorTest, PassedDeadlineFailsAtOnceUnlessTheTableCompletes) {
  Result r0, r1;
  Join(r0, kA, 0, 2, "g", "t", absl::ZeroDuration());
  ASSERT_TRUE(r0.answered());
  EXPECT_EQ(r0.status().code(), absl::StatusCode::kDeadlineExceeded);
  Join(r0, kA, 0, 2, "g", "t");
  Join(r1, kB, 1, 2, "g", "t", absl::ZeroDuration());
  ASSERT_TRUE(r1.answered());
  EXPECT_TRUE(r1.value().ok()) << r1.status();
}

TEST_F(CoordinatorTest, RestartedDaemonReplacesItsRanksAndTheOthersGetTheNewEpoch) {
  FormAB();
  auto sink_a = std::make_shared<FakeSink>(), sink_b = std::make_shared<FakeSink>();
  WatchWith(kA, sink_a);
  WatchWith(kB, sink_b);

  Result r;
  Join(r, kBRestarted, 1);  // same node "b", new daemon_id
  ASSERT_TRUE(r.answered());
  ASSERT_TRUE(r.value().ok()) << r.status();
  EXPECT_EQ(r.value()->epoch, 2u);
  EXPECT_THAT(r.value()->rank_daemons, ElementsAre(kA, kBRestarted));

  std::vector<FakeSink::Event> events = sink_a->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, FakeSink::Event::kTable);
  EXPECT_EQ(events[0].table.epoch, 2u);
  EXPECT_THAT(events[0].table.rank_daemons, ElementsAre(kA, kBRestarted));
  EXPECT_THAT(sink_b->Take(), IsEmpty());  // b-1 hosts nothing of g any more

  // A stale Depart from the replaced daemon does not clear its successor.
  EXPECT_TRUE(coordinator_.Depart("g", "t", 1, kB.daemon_id).ok());
  EXPECT_EQ(Group("g")->members[1], kBRestarted);
}

// UCX tags carry a 16-bit hash of (group, epoch), and a daemon may still run a group's previous
// incarnation while the new one connects: a re-form skips epochs whose hash equals the
// previous epoch's (the backend would refuse it: "collides with live group").
TEST_F(CoordinatorTest, ReformSkipsAnEpochWhoseUcxTagHashEqualsThePreviousOnes) {
  std::string name;  // a group whose epochs 1 and 2 collide (about 1 name in 65536)
  for (int i = 0; name.empty(); ++i) {
    const std::string candidate = absl::StrCat("g", i);
    if (collective::ucx::GroupTagHash(candidate, 1) ==
        collective::ucx::GroupTagHash(candidate, 2)) {
      name = candidate;
    }
  }
  Result r0, r1;
  Join(r0, kA, 0, 2, name);
  Join(r1, kB, 1, 2, name);
  ASSERT_TRUE(r0.answered() && r0.value().ok()) << r0.status();
  ASSERT_EQ(r0.value()->epoch, 1u);
  Result again;
  Join(again, kBRestarted, 1, 2, name);  // a new daemon for rank 1: the group re-forms
  ASSERT_TRUE(again.answered() && again.value().ok()) << again.status();
  EXPECT_EQ(again.value()->epoch, 3u) << name;
  EXPECT_NE(collective::ucx::GroupTagHash(name, again.value()->epoch),
            collective::ucx::GroupTagHash(name, 1));
}

// The same when every rank departed and the coordinator forgot the group before it forms
// again: a daemon may still run the forgotten incarnation (seen in CI: a restarted daemon's
// ranks re-joined after the survivors' had left, and the survivor's backend refused the new
// epoch as colliding with its live old one).
TEST_F(CoordinatorTest, AGroupFormedAgainAfterBeingForgottenSkipsItsLastEpochsUcxTagHash) {
  std::string name;  // a group whose epochs 1 and 2 collide (about 1 name in 65536)
  for (int i = 0; name.empty(); ++i) {
    const std::string candidate = absl::StrCat("g", i);
    if (collective::ucx::GroupTagHash(candidate, 1) ==
        collective::ucx::GroupTagHash(candidate, 2)) {
      name = candidate;
    }
  }
  Result r0, r1;
  Join(r0, kA, 0, 2, name);
  Join(r1, kB, 1, 2, name);
  ASSERT_TRUE(r0.answered() && r0.value().ok()) << r0.status();
  ASSERT_EQ(r0.value()->epoch, 1u);
  ASSERT_TRUE(coordinator_.Depart(name, "t", 0, kA.daemon_id).ok());
  ASSERT_TRUE(coordinator_.Depart(name, "t", 1, kB.daemon_id).ok());
  ASSERT_FALSE(Group(name).has_value());  // forgotten
  Result again0, again1;
  Join(again0, kA, 0, 2, name);
  Join(again1, kBRestarted, 1, 2, name);
  ASSERT_TRUE(again1.answered() && again1.value().ok()) << again1.status();
  EXPECT_EQ(again1.value()->epoch, 3u) << name;
}

TEST_F(CoordinatorTest, TrainerRestartOnTheSameDaemonKeepsTheEpoch) {
  FormAB();
  auto sink_b = std::make_shared<FakeSink>();
  WatchWith(kB, sink_b);
  ASSERT_TRUE(coordinator_.Depart("g", "t", 0, kA.daemon_id).ok());
  std::optional<GroupSnapshot> g = Group("g");
  EXPECT_FALSE(g->members[0].has_value());
  EXPECT_FALSE(g->dirty);

  Result r;
  Join(r, kA, 0);
  ASSERT_TRUE(r.answered() && r.value().ok()) << r.status();
  EXPECT_EQ(r.value()->epoch, 1u);
  EXPECT_THAT(sink_b->Take(), IsEmpty());  // nothing new for b
}

TEST_F(CoordinatorTest, ArrivalIntoEmptySlotFromAnotherDaemonBumpsTheEpoch) {
  FormAB();
  auto sink_a = std::make_shared<FakeSink>();
  WatchWith(kA, sink_a);
  ASSERT_TRUE(coordinator_.Depart("g", "t", 1, kB.daemon_id).ok());
  Result r;
  Join(r, kC, 1);
  ASSERT_TRUE(r.answered() && r.value().ok()) << r.status();
  EXPECT_EQ(r.value()->epoch, 2u);
  std::vector<FakeSink::Event> events = sink_a->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].table.epoch, 2u);
}

TEST_F(CoordinatorTest, DaemonWithAPendingCallGetsTheTableByItsCallNotByPush) {
  // a hosts ranks 0 and 1, b rank 2. a's trainer of rank 1 restarts while b restarts too.
  Result r0, r1, r2;
  Join(r0, kA, 0, 3);
  Join(r1, kA, 1, 3);
  Join(r2, kB, 2, 3);
  ASSERT_TRUE(r2.value().ok());
  auto sink_a = std::make_shared<FakeSink>(), sink_c = std::make_shared<FakeSink>();
  WatchWith(kA, sink_a);
  ASSERT_TRUE(coordinator_.Depart("g", "t", 1, kA.daemon_id).ok());
  ASSERT_TRUE(coordinator_.Depart("g", "t", 2, kB.daemon_id).ok());
  Result again1, r2c;
  Join(again1, kA, 1, 3);
  Join(r2c, kC, 2, 3);
  ASSERT_TRUE(again1.answered() && again1.value().ok()) << again1.status();
  EXPECT_EQ(again1.value()->epoch, 2u);
  EXPECT_THAT(sink_a->Take(), IsEmpty());
}

TEST_F(CoordinatorTest, NewerCallForTheSameRankSupersedesTheOlder) {
  Result old_call, new_call;
  Join(old_call, kA, 0);
  Join(new_call, kA, 0);
  ASSERT_TRUE(old_call.answered());
  EXPECT_EQ(old_call.status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(new_call.answered());
  EXPECT_THAT(Group("g")->pending_ranks, ElementsAre(0));
}

TEST_F(CoordinatorTest, DepartFailsThePendingCallOfThatRank) {
  Result r;
  Join(r, kA, 0);
  ASSERT_TRUE(coordinator_.Depart("g", "t", 0, kA.daemon_id).ok());
  ASSERT_TRUE(r.answered());
  EXPECT_EQ(r.status(), absl::AbortedError("group g rank 0: departed"));
  EXPECT_THAT(coordinator_.Snapshot().groups, IsEmpty());
  EXPECT_TRUE(coordinator_.Depart("g", "t", 0, kA.daemon_id).ok());  // unknown group: OK
}

TEST_F(CoordinatorTest, GroupsWithoutMembersAreForgottenAndStartOver) {
  FormAB();
  ASSERT_TRUE(coordinator_.Depart("g", "t", 0, kA.daemon_id).ok());
  EXPECT_EQ(coordinator_.Depart("g", "t", 5, kB.daemon_id).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(coordinator_.Depart("g", "t", 1, kB.daemon_id).ok());
  EXPECT_THAT(coordinator_.Snapshot().groups, IsEmpty());
  // A new job may reuse the name with its own token and world size.
  Result r;
  Join(r, kC, 0, 1, "g", "other");
  ASSERT_TRUE(r.answered() && r.value().ok()) << r.status();
  EXPECT_EQ(r.value()->epoch, 2u) << "epochs never repeat, even for a forgotten group";
}

TEST_F(CoordinatorTest, ReportedFailureIsForwardedOnceToTheOtherDaemons) {
  Result r0, r1, r2;
  Join(r0, kA, 0, 3);
  Join(r1, kB, 1, 3);
  Join(r2, kC, 2, 3);
  auto sa = std::make_shared<FakeSink>(), sb = std::make_shared<FakeSink>(),
       sc = std::make_shared<FakeSink>();
  WatchWith(kA, sa);
  WatchWith(kB, sb);
  WatchWith(kC, sc);

  const absl::Status boom = absl::DeadlineExceededError("group g op_seq=7: rank 2 never arrived");
  ASSERT_TRUE(coordinator_.ReportFailure("t", kA.daemon_id, "g", 1, boom).ok());
  EXPECT_THAT(sa->Take(), IsEmpty());
  for (FakeSink* s : {sb.get(), sc.get()}) {
    std::vector<FakeSink::Event> events = s->Take();
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].kind, FakeSink::Event::kFailure);
    EXPECT_EQ(events[0].group, "g");
    EXPECT_EQ(events[0].epoch, 1u);
    EXPECT_EQ(events[0].status, boom);
  }
  EXPECT_TRUE(Group("g")->dirty);

  // The same failure seen by b adds nothing; a stale epoch is ignored.
  ASSERT_TRUE(coordinator_.ReportFailure("t", kB.daemon_id, "g", 1, boom).ok());
  ASSERT_TRUE(coordinator_.ReportFailure("t", kB.daemon_id, "g", 0, boom).ok());
  EXPECT_THAT(sa->Take(), IsEmpty());
  EXPECT_THAT(sc->Take(), IsEmpty());

  EXPECT_EQ(coordinator_.ReportFailure("t", kA.daemon_id, "nope", 1, boom).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_.ReportFailure("t", kA.daemon_id, "g", 1, absl::OkStatus()).code(),
            absl::StatusCode::kInvalidArgument);

  // The same daemons rejoin: the failure gives the group a new epoch.
  ASSERT_TRUE(coordinator_.Depart("g", "t", 0, kA.daemon_id).ok());
  Result again;
  Join(again, kA, 0, 3);
  ASSERT_TRUE(again.answered() && again.value().ok()) << again.status();
  EXPECT_EQ(again.value()->epoch, 2u);
  EXPECT_FALSE(Group("g")->dirty);
}

TEST_F(CoordinatorTest, StaleFailureDoesNotDirtyTheGroup) {
  FormAB();
  ASSERT_TRUE(coordinator_.ReportFailure("t", kA.daemon_id, "g", 7, absl::AbortedError("x")).ok());
  EXPECT_FALSE(Group("g")->dirty);
}

// A Ping (PeerService.Ping) counts as a heartbeat of the daemon's current stream; a daemon
// without one is not found, and a ping cannot bring a daemon declared dead back.
TEST_F(CoordinatorTest, PingOfAWatchingDaemonKeepsItAlive) {
  FormAB();
  auto sa = std::make_shared<FakeSink>(), sb = std::make_shared<FakeSink>();
  WatchWith(kA, sa);
  WatchWith(kB, sb);
  EXPECT_FALSE(coordinator_.HeartbeatOf("nobody"));
  Advance(absl::Seconds(2));
  EXPECT_TRUE(coordinator_.HeartbeatOf(kA.daemon_id));
  Advance(absl::Seconds(1));  // b silent for 3 s, a pinged 1 s ago
  EXPECT_THAT(coordinator_.Snapshot().watching, ElementsAre(kA));
  EXPECT_FALSE(coordinator_.HeartbeatOf(kB.daemon_id));
  EXPECT_THAT(coordinator_.Snapshot().watching, ElementsAre(kA));
}

TEST_F(CoordinatorTest, SilentDaemonIsDeclaredDead) {
  Result r0, r1, r2;
  Join(r0, kA, 0, 3);
  Join(r1, kB, 1, 3);
  Join(r2, kB, 2, 3);
  auto sa = std::make_shared<FakeSink>(), sb = std::make_shared<FakeSink>();
  Coordinator::WatcherId ida = WatchWith(kA, sa);
  WatchWith(kB, sb);
  EXPECT_EQ(coordinator_.NextDeadline(), Now() + absl::Seconds(3));

  Advance(absl::Seconds(2));
  coordinator_.Heartbeat(ida);
  Advance(absl::Seconds(1));  // b silent for 3 s, a for 1 s

  std::vector<FakeSink::Event> closed = sb->Take();
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].kind, FakeSink::Event::kClose);
  EXPECT_EQ(closed[0].status.code(), absl::StatusCode::kUnavailable);
  std::vector<FakeSink::Event> events = sa->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, FakeSink::Event::kFailure);
  EXPECT_EQ(events[0].epoch, 1u);
  EXPECT_EQ(events[0].status,
            absl::UnavailableError(
                "group g: daemon b (b:7451) hosting ranks 1, 2 is gone: no heartbeat for 3s"));

  CoordinatorSnapshot snap = coordinator_.Snapshot();
  ASSERT_EQ(snap.groups.size(), 1u);
  EXPECT_THAT(snap.groups[0].members, ElementsAre(kA, std::nullopt, std::nullopt));
  EXPECT_TRUE(snap.groups[0].dirty);
  EXPECT_THAT(snap.watching, ElementsAre(kA));

  // A report of the same failure by a is not forwarded again (b is gone anyway).
  ASSERT_TRUE(coordinator_.ReportFailure("t", kA.daemon_id, "g", 1, absl::AbortedError("x")).ok());
  EXPECT_THAT(sa->Take(), IsEmpty());

  // b restarts and rejoins: a new epoch, pushed to a.
  Result n1, n2;
  Join(n1, kBRestarted, 1, 3);
  Join(n2, kBRestarted, 2, 3);
  ASSERT_TRUE(n2.answered() && n2.value().ok()) << n2.status();
  EXPECT_EQ(n2.value()->epoch, 2u);
  events = sa->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].table.epoch, 2u);
}

TEST_F(CoordinatorTest, BrokenStreamDeclaresDaemonDeadAndFailsItsPendingCalls) {
  FormAB();
  Result pending;
  Join(pending, kB, 0, 2, "h");  // b waits in another group
  auto sa = std::make_shared<FakeSink>(), sb = std::make_shared<FakeSink>();
  WatchWith(kA, sa);
  Coordinator::WatcherId idb = WatchWith(kB, sb);

  coordinator_.Unwatch(idb, "its watch stream broke");
  ASSERT_TRUE(pending.answered());
  EXPECT_EQ(pending.status(),
            absl::UnavailableError(
                "group h: daemon b (b:7451) hosting rank 0 is gone: its watch stream broke"));
  EXPECT_FALSE(Group("h").has_value());  // nothing left of h
  std::vector<FakeSink::Event> events = sa->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].status.message(),
            "group g: daemon b (b:7451) hosting rank 1 is gone: its watch stream broke");
  coordinator_.Unwatch(idb, "again");  // no-op
  EXPECT_THAT(sa->Take(), IsEmpty());
}

TEST_F(CoordinatorTest, NewStreamOfTheSameDaemonReplacesTheOldWithoutADeath) {
  FormAB();
  auto sa = std::make_shared<FakeSink>(), old_b = std::make_shared<FakeSink>(),
       new_b = std::make_shared<FakeSink>();
  WatchWith(kA, sa);
  Coordinator::WatcherId old_id = WatchWith(kB, old_b);
  WatchWith(kB, new_b);
  std::vector<FakeSink::Event> events = old_b->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, FakeSink::Event::kClose);
  coordinator_.Unwatch(old_id, "its watch stream broke");  // the old stream ends later
  EXPECT_THAT(sa->Take(), IsEmpty());
  EXPECT_EQ(Group("g")->members[1], kB);
  EXPECT_EQ(coordinator_.Snapshot().watching.size(), 2u);
}

TEST_F(CoordinatorTest, WatchCatchesUpOnATableItMissed) {
  FormAB();
  Result r;
  Join(r, kBRestarted, 1);  // epoch 2 while a is not watching
  ASSERT_TRUE(r.value().ok());
  auto sa = std::make_shared<FakeSink>();
  WatchWith(kA, sa);
  std::vector<FakeSink::Event> events = sa->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].table.epoch, 2u);
  // b-2 got epoch 2 from its call: nothing to catch up on.
  auto sb = std::make_shared<FakeSink>();
  WatchWith(kBRestarted, sb);
  EXPECT_THAT(sb->Take(), IsEmpty());
}

TEST_F(CoordinatorTest, ShutdownFailsPendingCallsAndClosesStreams) {
  Result r;
  Join(r, kA, 0);
  auto sa = std::make_shared<FakeSink>();
  WatchWith(kA, sa);
  coordinator_.Shutdown();
  ASSERT_TRUE(r.answered());
  EXPECT_EQ(r.status(), absl::UnavailableError("coordinator shutting down"));
  std::vector<FakeSink::Event> events = sa->Take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, FakeSink::Event::kClose);
  Result later;
  Join(later, kB, 1);
  ASSERT_TRUE(later.answered());
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(coordinator_.Watch(kB, sa).status().code(), absl::StatusCode::kUnavailable);
  coordinator_.Shutdown();  // idempotent
  EXPECT_EQ(r.calls(), 1);
}

TEST_F(CoordinatorTest, CallbacksMayCallBackIntoTheCoordinator) {
  int seen_groups = -1;
  coordinator_.Rendezvous(RendezvousArgs{"g", "t", 1, 0, kA}, Now() + absl::Seconds(1),
                          [&](absl::StatusOr<PeerTable> t) {
                            ASSERT_TRUE(t.ok());
                            seen_groups = static_cast<int>(coordinator_.Snapshot().groups.size());
                          });
  EXPECT_EQ(seen_groups, 1);
}

// GPU groups: how device memory moves is decided once, at the coordinator, so every daemon
// connects the same backend.
class CoordinatorDeviceTest : public CoordinatorTest {
 protected:
  static DaemonIdentity Gpu(const std::string& node, const std::string& id, bool nccl = true) {
    DaemonIdentity d = Daemon(node, id);
    d.nccl = nccl;
    return d;
  }
  void JoinOn(Result& r, const DaemonIdentity& daemon, int rank, const std::string& device,
              const std::string& nccl_id = "", int world = 2) {
    RendezvousArgs args{"g", "t", world, rank, daemon};
    args.device_uuid = device;
    args.nccl_unique_id = nccl_id;
    coordinator_.Rendezvous(args, Now() + absl::Seconds(10), r.Callback());
  }
};

TEST_F(CoordinatorDeviceTest, DistinctGpusOnNcclDaemonsGetNcclAndRank0sId) {
  Result r0, r1;
  JoinOn(r0, Gpu("a", "a-1"), 0, "GPU-a", "id-from-rank-0");
  JoinOn(r1, Gpu("b", "b-1"), 1, "GPU-b");
  ASSERT_TRUE(r1.answered() && r1.value().ok()) << r1.status();
  for (const Result* r : {&r0, &r1}) {
    EXPECT_EQ(r->value()->device_transport, "nccl");
    EXPECT_EQ(r->value()->nccl_unique_id, "id-from-rank-0");
    EXPECT_THAT(r->value()->rank_devices, ElementsAre("GPU-a", "GPU-b"));
  }
}

TEST_F(CoordinatorDeviceTest, TwoDaemonsOnOneGpuAreStagedThroughTheHost) {
  Result r0, r1;
  JoinOn(r0, Gpu("a", "a-1"), 0, "GPU-same", "id");
  JoinOn(r1, Gpu("a", "a-2"), 1, "GPU-same");
  ASSERT_TRUE(r0.answered() && r0.value().ok()) << r0.status();
  EXPECT_EQ(r0.value()->device_transport, "host");
  EXPECT_EQ(r1.value()->device_transport, "host");
  EXPECT_EQ(r0.value()->nccl_unique_id, "");
}

TEST_F(CoordinatorDeviceTest, ADaemonWithoutNcclOrAMissingIdMeansHost) {
  Result r0, r1;
  JoinOn(r0, Gpu("a", "a-1"), 0, "GPU-a", "id");
  JoinOn(r1, Gpu("b", "b-1", /*nccl=*/false), 1, "GPU-b");
  ASSERT_TRUE(r1.answered() && r1.value().ok()) << r1.status();
  EXPECT_EQ(r1.value()->device_transport, "host");

  Result s0, s1;  // a new group: no id from rank 0
  RendezvousArgs a0{"h", "t", 2, 0, Gpu("a", "a-1")};
  a0.device_uuid = "GPU-a";
  RendezvousArgs a1{"h", "t", 2, 1, Gpu("b", "b-1")};
  a1.device_uuid = "GPU-b";
  coordinator_.Rendezvous(a0, Now() + absl::Seconds(10), s0.Callback());
  coordinator_.Rendezvous(a1, Now() + absl::Seconds(10), s1.Callback());
  ASSERT_TRUE(s1.answered() && s1.value().ok()) << s1.status();
  EXPECT_EQ(s1.value()->device_transport, "host");
}

TEST_F(CoordinatorDeviceTest, AnIdIsHandedOutForOneRoundOnly) {
  Result r0, r1;
  JoinOn(r0, Gpu("a", "a-1"), 0, "GPU-a", "id-1");
  JoinOn(r1, Gpu("b", "b-1"), 1, "GPU-b");
  ASSERT_TRUE(r1.answered() && r1.value().ok());
  ASSERT_EQ(r1.value()->device_transport, "nccl");
  // Rank 1's daemon restarts: a new epoch, but rank 0 did not bring a new id this round.
  Result again;
  JoinOn(again, Gpu("b", "b-2"), 1, "GPU-b");
  ASSERT_TRUE(again.answered() && again.value().ok()) << again.status();
  EXPECT_GT(again.value()->epoch, r1.value()->epoch);
  EXPECT_EQ(again.value()->device_transport, "host");
  EXPECT_EQ(again.value()->nccl_unique_id, "");
}

TEST_F(CoordinatorDeviceTest, HostGroupsSayNothingAboutDevices) {
  Result r0, r1;
  Join(r0, kA, 0);
  Join(r1, kB, 1);
  ASSERT_TRUE(r1.answered() && r1.value().ok());
  EXPECT_EQ(r1.value()->device_transport, "");
}

}  // namespace
}  // namespace flatshard::server::peer
