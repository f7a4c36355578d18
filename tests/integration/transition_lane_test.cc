// The transition lane (proto/flatshard/v1/transition_lane.proto; client/transition_lane.h,
// server/service/transition_lane_service.h) against a real flatshardd: the client library's
// Summons go over it (the daemon counts them), give exactly what the unary call gives (to the
// element, with FLATSHARD_NO_TRANSITION_LANE=1 as the unary side), and fail as it does: a
// collective that never completes at its deadline naming the missing rank, a killed daemon
// with UNAVAILABLE, a frozen one (SIGSTOP) with DEADLINE_EXCEEDED within the call timeout (no
// hang); and a daemon asked to stop with SIGTERM while a client keeps its lane open stops at
// once, not after its shutdown grace.

#include <signal.h>
#include <stdlib.h>

#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::ConnectOptions;
using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::GroupOptions;
using ::flatshard::testing::Rank;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

constexpr char kLaneRequests[] = "flatshard_transition_lane_requests_total";

float Value(const std::string& fqn, int64_t i) {
  return static_cast<float>(fqn.size() * 1000 + 1 + i % 997);
}

double LaneRequests(const DaemonProcess& d) {
  const std::map<std::string, double> m = d.Metrics();
  auto it = m.find(kLaneRequests);
  return it == m.end() ? -1 : it->second;
}

// Waits (at most 5 s) until process `pid` is stopped (state T in /proc/PID/stat): kill()
// returns before the signal took effect.
bool Stopped(pid_t pid) {
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (absl::Now() < until) {
    std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T') {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// Sets FLATSHARD_NO_TRANSITION_LANE for the Clients made while it lives.
class NoLane {
 public:
  NoLane() { ::setenv("FLATSHARD_NO_TRANSITION_LANE", "1", 1); }
  ~NoLane() { ::unsetenv("FLATSHARD_NO_TRANSITION_LANE"); }
};

std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> flags = {}) {
  DaemonOptions o;
  o.tag_prefix = "fslane";
  o.metrics = true;
  o.extra_flags = std::move(flags);
  auto d = std::make_unique<DaemonProcess>(o);
  return d;
}

std::vector<Rank> Join(const DaemonProcess& d, int world, absl::Duration call_timeout) {
  GroupOptions g;
  g.connect = [&d, call_timeout](int) {
    return ConnectClient(d.address(), ConnectOptions(call_timeout, absl::Seconds(20), 1));
  };
  return ::flatshard::testing::JoinRanks(world, g);
}

SummonOptions ReadOnly() {
  SummonOptions read;
  read.writeback = false;
  return read;
}

// Every rank walks the model's units in plan order, one transition each (the previous unit
// ends in the same request), and finds Value() in every element of each unit's parameters.
void WalkUnits(std::vector<Rank>& ranks) {
  RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    const SummonOptions read = ReadOnly();
    std::unique_ptr<SummonedParams> held;
    for (const PlanUnit& u : ranks[r].model.plan->units) {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s =
          ranks[r].client->Summon("", u.module, read, std::move(held));
      ASSERT_TRUE(s.ok()) << "rank " << r << " unit " << u.index << ": " << s.status();
      held = *std::move(s);
      for (const PlanParam& p : u.params) {
        const ParamView* v = held->Find(p.fqn);
        ASSERT_NE(v, nullptr) << "rank " << r << " " << p.fqn;
        const float* data = static_cast<const float*>(v->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(data[i], Value(p.fqn, i)) << "rank " << r << " " << p.fqn << "[" << i << "]";
        }
      }
    }
    ASSERT_TRUE(held->End().ok()) << "rank " << r;
  });
}

// `world` ranks join `d` and register the example model; each then summons and ends it once,
// so that its lane is open.
std::vector<Rank> ReadyRanks(const DaemonProcess& d, int world, absl::Duration call_timeout) {
  std::vector<Rank> ranks = Join(d, world, call_timeout);
  ::flatshard::testing::RegisterExample(ranks);
  RunRanks(world, [&](int r) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", ReadOnly());
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    ASSERT_TRUE((*s)->End().ok()) << "rank " << r;
  });
  return ranks;
}

TEST(TransitionLaneTest, LibrarySummonsTakeTheLaneAndMatchTheUnaryCallToTheElement) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks = Join(*d, 2, absl::Seconds(20));
  ASSERT_EQ(LaneRequests(*d), 0) << "the lane counter is rendered from the start";
  ::flatshard::testing::RegisterExample(ranks);
  ::flatshard::testing::WriteParams(ranks, Value);
  RunRanks(2, [&](int r) {
    absl::StatusOr<uint64_t> c = ranks[r].client->Commit("");
    ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
  });
  const double before = LaneRequests(*d);
  WalkUnits(ranks);
  const double units = static_cast<double>(ranks[0].model.plan->units.size());
  EXPECT_GE(LaneRequests(*d) - before, 2 * units) << "a Summon per unit and rank on the lane";

  // The same walk with the lane off: unary Summons only, the same elements.
  for (Rank& r : ranks) ASSERT_TRUE(r.client->Leave().ok());
  ranks.clear();
  NoLane off;
  ranks = Join(*d, 2, absl::Seconds(20));
  ::flatshard::testing::RegisterExample(ranks);  // re-attaches
  const double unary_before = LaneRequests(*d);
  WalkUnits(ranks);
  EXPECT_EQ(LaneRequests(*d), unary_before) << "FLATSHARD_NO_TRANSITION_LANE=1 kept a lane";
}

TEST(TransitionLaneTest, ACollectiveThatNeverCompletesFailsAtItsDeadlineNamingTheMissingRank) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks = ReadyRanks(*d, 2, absl::Seconds(3));
  const SummonOptions read = ReadOnly();
  // Rank 0 alone.
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[0].client->Summon("", "", read);
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("rank 1 did not arrive")) << s.status();
  EXPECT_LT(took, absl::Seconds(6)) << s.status();
}

TEST(TransitionLaneTest, AKilledDaemonFailsTheSummonOnTheLaneWithUnavailable) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks = ReadyRanks(*d, 2, absl::Seconds(20));
  const SummonOptions read = ReadOnly();
  // Rank 0's Summon waits on the lane for rank 1, which never comes; the daemon dies.
  absl::StatusOr<std::unique_ptr<SummonedParams>> waiting = absl::UnknownError("unset");
  absl::Time answered;
  std::thread t([&] {
    waiting = ranks[0].client->Summon("", "", read);
    answered = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time killed = absl::Now();
  d->Kill();
  t.join();
  ASSERT_FALSE(waiting.ok());
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kUnavailable) << waiting.status();
  EXPECT_LT(answered - killed, absl::Seconds(5)) << waiting.status();
}

TEST(TransitionLaneTest, AFrozenDaemonFailsTheSummonWithinTheCallTimeout) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks = Join(*d, 1, absl::Seconds(2));
  ::flatshard::testing::RegisterExample(ranks);
  const SummonOptions read = ReadOnly();
  absl::StatusOr<std::unique_ptr<SummonedParams>> first = ranks[0].client->Summon("", "", read);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT(LaneRequests(*d), 0);
  ASSERT_EQ(::kill(d->pid(), SIGSTOP), 0);
  ASSERT_TRUE(Stopped(d->pid())) << "flatshardd never stopped";
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<SummonedParams>> s =
      ranks[0].client->Summon("", "", read, *std::move(first));
  const absl::Duration took = absl::Now() - start;
  ::kill(d->pid(), SIGCONT);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  // The Summon's call timeout, then the riding summon's own End (also the call timeout).
  EXPECT_LT(took, absl::Seconds(8)) << s.status();
  EXPECT_GE(took, absl::Milliseconds(1900)) << s.status();
  // Thawed, the daemon runs the request it had not read, finds its answer lost and ends that
  // summon (asynchronously: a Summon sent at once may still find it open), so the next
  // Summons (on a new lane) are not refused for good as "already unsharding".
  const absl::Time until = absl::Now() + absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<SummonedParams>> again = absl::UnknownError("unset");
  do {
    again = ranks[0].client->Summon("", "", read);
    if (again.ok() || again.status().code() != absl::StatusCode::kFailedPrecondition) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < until);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << d->Log();
  EXPECT_THAT(d->Log(), HasSubstr("ended: its caller gave up before the answer"));
  EXPECT_TRUE((*again)->End().ok());
}

TEST(TransitionLaneTest, SigtermWithALaneOpenStopsWithoutWaitingTheShutdownGrace) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--shutdown_grace=60s"});
  std::vector<Rank> ranks = ReadyRanks(*d, 1, absl::Seconds(20));
  ASSERT_TRUE(ranks[0].client->Leave().ok());
  // The Client lives on, its lane open and idle.
  const absl::Time start = absl::Now();
  EXPECT_EQ(d->Terminate(), 0) << "not stopped within 20 s";
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

}  // namespace
}  // namespace flatshard::client
