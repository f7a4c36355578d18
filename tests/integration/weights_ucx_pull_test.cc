// A reader's daemon pulling versions over UCX (issue 25, README "Published weights across
// daemons", --weights_transport): real flatshardd processes on this host stand in for nodes.
//   - four readers on a daemon with no rank of the group: one copy, read with UCX gets from
//     both sources, element for element; the bytes counted under transport="ucx"; the
//     group's other daemon copies the leader's version over UCX too;
//   - a source (or the reader's daemon) with --weights_transport=grpc: its share comes over
//     the gRPC stream (the other source's over UCX), values exact, both counted;
//   - a reader's daemon whose UCX reaches no source: every range again over gRPC;
//   - a source killed while its share is pending: the share is read from the other source;
//   - a source killed while a UCX get from it is in flight (over TCP, the source's progress
//     stalled as it sent the rkey): the range from the other source; with no other source
//     the open fails UNAVAILABLE naming it, nothing kept, the reader's daemon still serving;
//   - with --weights_keep=1, pulls from the third on land in the name's spare segment (the
//     released version two before), element for element; the group's other daemon copies
//     the leader's version 4 into its spare too;
//   - a bad --weights_transport: the daemon refuses to start, naming the flag.

#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
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
#include "tests/integration/weights_multi_testing.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ParseMetrics;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;
using weights_testing::ExpectHolds;
using weights_testing::GroupDaemon;
using weights_testing::kWorld;
using weights_testing::Reader;
using weights_testing::ReaderDaemon;
using weights_testing::Trainers;

constexpr char kUcxBytes[] = "flatshard_weights_pulled_bytes_total{transport=\"ucx\"}";
constexpr char kGrpcBytes[] = "flatshard_weights_pulled_bytes_total{transport=\"grpc\"}";

// A metric's value (0 when absent).
double Value(const std::map<std::string, double>& m, const std::string& name) {
  auto it = m.find(name);
  return it == m.end() ? 0 : it->second;
}

// Two group daemons (flags each), step `step` committed and published as "gpt" (version 1).
struct Published {
  std::unique_ptr<DaemonProcess> d0;
  std::unique_ptr<DaemonProcess> d1;
  std::unique_ptr<Trainers> t;
  int64_t bytes = 0;
  // `env`: both daemons' extra environment.
  Published(const std::vector<std::string>& flags0, const std::vector<std::string>& flags1,
            const std::string& group, int step, const std::vector<std::string>& env = {}) {
    d0 = GroupDaemon(0, flags0, /*metrics=*/false, env);
    d1 = GroupDaemon(1, flags1, /*metrics=*/true, env);
    t = std::make_unique<Trainers>(std::vector<const DaemonProcess*>{d0.get(), d1.get()}, group);
    if (t->plan == nullptr) return;
    PublishStep(step);
  }
  // Commits step `step` and publishes it as the next version of "gpt".
  void PublishStep(int step) {
    t->Step(step);
    std::vector<absl::StatusOr<PublishedVersion>> p = t->Publish("gpt");
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(p[r].ok()) << "rank " << r << ": " << p[r].status();
      if (p[r].ok()) bytes = p[r]->bytes;
    }
  }
};

// Gets over TCP need the source's own progress (UCX emulates them with messages), so a source
// with --testing_weights_ucx_stall_after keeps the copier's get in flight until it dies.
const std::vector<std::string> kOverTcp = {"UCX_TLS=tcp"};

// The reader's daemon's log line (--v=1) for each UCX get from `source` that is in flight.
std::string InFlightLine(const DaemonProcess& source) {
  return absl::StrCat("from daemon ", source.peer_address(), " is in flight");
}

// Occurrences of `what` in `d`'s log.
int Count(const DaemonProcess& d, const std::string& what) {
  const std::string log = d.Log();
  int n = 0;
  for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
  return n;
}

// Whether `d`'s log holds `n` occurrences of `what` within `within` (polled: the line is the
// event waited for, not a delay).
bool AwaitCount(const DaemonProcess& d, const std::string& what, int n, absl::Duration within) {
  const absl::Time until = absl::Now() + within;
  while (Count(d, what) < n) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// `x`'s readers open "gpt" (version 1, step `step`) element for element.
void ExpectReadersSee(const ReaderDaemon& x, const Plan& plan, int readers, int step) {
  RunRanks(readers, [&](int i) {
    std::unique_ptr<WeightsReader> r = Reader(*x.d);
    ASSERT_NE(r, nullptr);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << "reader " << i << ": " << v.status();
    EXPECT_EQ((*v)->info().version, 1u);
    ExpectHolds(plan, **v, step);
  });
}

TEST(WeightsUcxPullTest, FourReadersGetOneCopyReadWithUcxGetsFromBothSources) {
  Published g({}, {}, "ucxpull", 1);
  ASSERT_NE(g.t->plan, nullptr);
  ASSERT_GT(g.bytes, 2 * 4096);  // both sources send a share
  ReaderDaemon x({g.d0->peer_address(), g.d1->peer_address()});
  ExpectReadersSee(x, *g.t->plan, 4, 1);
  const std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), 1);
  EXPECT_EQ(Value(m, kUcxBytes), static_cast<double>(g.bytes));
  EXPECT_EQ(m.count(kGrpcBytes), 0u);
  EXPECT_EQ(Value(m, "flatshard_weights_transport{transport=\"ucx\"}"), 1);
  EXPECT_EQ(Value(m, "flatshard_weights_peer_copied_bytes_total{transport=\"ucx\"}"),
            static_cast<double>(g.bytes));
  // The group's other daemon got its copy from the leader over UCX too.
  std::unique_ptr<WeightsReader> r1 = Reader(*g.d1);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v1 = r1->Open("gpt");
  ASSERT_TRUE(v1.ok()) << v1.status();
  ExpectHolds(*g.t->plan, **v1, 1);
  const std::map<std::string, double> m1 = g.d1->Metrics();
  EXPECT_EQ(Value(m1, "flatshard_weights_peer_copied_bytes_total{transport=\"ucx\"}"),
            static_cast<double>(g.bytes));
  EXPECT_EQ(m1.count("flatshard_weights_peer_copied_bytes_total{transport=\"grpc\"}"), 0u);
}

TEST(WeightsUcxPullTest, ASourceWithoutUcxSendsItsShareOverGrpc) {
  Published g({}, {"--weights_transport=grpc"}, "mixed", 2);
  ASSERT_NE(g.t->plan, nullptr);
  ASSERT_GT(g.bytes, 2 * 4096);
  ReaderDaemon x({g.d0->peer_address(), g.d1->peer_address()});
  ExpectReadersSee(x, *g.t->plan, 2, 2);
  std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), 1);
  // The first share (daemon 0) over UCX, the second (daemon 1, gRPC only) in the stream.
  EXPECT_GT(Value(m, kUcxBytes), 0);
  EXPECT_GT(Value(m, kGrpcBytes), 0);
  EXPECT_EQ(Value(m, kUcxBytes) + Value(m, kGrpcBytes), static_cast<double>(g.bytes));

  // Daemon 1 (gRPC only) got the leader's version in the stream.
  const std::map<std::string, double> m1 = g.d1->Metrics();
  EXPECT_EQ(Value(m1, "flatshard_weights_peer_copied_bytes_total{transport=\"grpc\"}"),
            static_cast<double>(g.bytes));

  // A reader's daemon that asks for gRPC gets every byte in the streams.
  ReaderDaemon y({g.d0->peer_address(), g.d1->peer_address()}, {"--weights_transport=grpc"});
  ExpectReadersSee(y, *g.t->plan, 1, 2);
  m = ParseMetrics(y.Metrics());
  EXPECT_EQ(Value(m, kGrpcBytes), static_cast<double>(g.bytes));
  EXPECT_EQ(m.count(kUcxBytes), 0u);
  EXPECT_EQ(Value(m, "flatshard_weights_transport{transport=\"grpc\"}"), 1);
}

TEST(WeightsUcxPullTest, AReaderDaemonWhoseUcxCannotReachTheSourcesGetsTheBytesOverGrpc) {
  Published g({}, {}, "unreach", 4);
  ASSERT_NE(g.t->plan, nullptr);
  // UCX starts there, but with no transport towards other processes.
  ReaderDaemon x({g.d0->peer_address(), g.d1->peer_address()}, {}, {"UCX_TLS=self"});
  ExpectReadersSee(x, *g.t->plan, 2, 4);
  const std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), 1);
  EXPECT_EQ(Value(m, kGrpcBytes), static_cast<double>(g.bytes));
  EXPECT_EQ(m.count(kUcxBytes), 0u);
  EXPECT_THAT(x.d->Log(), HasSubstr("over UCX failed"));
}

TEST(WeightsUcxPullTest, ASourceKilledWhileItsSharePendsHasItReadFromTheOther) {
  // Daemon 1 sends each descriptor at once, then holds its share back (it is killed first).
  Published g({}, {"--testing_weights_copy_pause=120s"}, "killeducx", 3);
  ASSERT_NE(g.t->plan, nullptr);
  ReaderDaemon x({g.d1->peer_address(), g.d0->peer_address()});
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = absl::UnknownError("unset");
  std::thread reading([&] { v = r->Open("gpt"); });
  // Whenever the kill lands (before the descriptor, or while daemon 1's share waits), the
  // copy completes from daemon 0 alone: no timing decides the outcome.
  absl::SleepFor(absl::Milliseconds(300));
  g.d1->Kill();
  reading.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, 1u);
  ExpectHolds(*g.t->plan, **v, 3);
  const std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), 1);
  EXPECT_EQ(Value(m, kUcxBytes), static_cast<double>(g.bytes));
  g.t->c.clear();
}

TEST(WeightsUcxPullTest, ASourceKilledDuringAUcxGetFromItHasItsRangeReadFromTheOther) {
  // Daemon 1's second rkey (version 2's share; the first, version 1's, connected the reader's
  // daemon to it) stalls its UCX worker: that get cannot finish until daemon 1 dies.
  Published g({}, {"--testing_weights_ucx_stall_after=2"}, "midget", 5, kOverTcp);
  ASSERT_NE(g.t->plan, nullptr);
  ReaderDaemon x({g.d1->peer_address(), g.d0->peer_address()}, {"--v=1"}, kOverTcp);
  ExpectReadersSee(x, *g.t->plan, 1, 5);
  ASSERT_EQ(Count(*x.d, InFlightLine(*g.d1)), 1) << x.d->Log();
  g.PublishStep(6);
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = absl::UnknownError("unset");
  std::thread reading([&] { v = r->Open("gpt"); });
  // Killed once the get of version 2 from it is posted (and cannot have finished).
  const bool posted = AwaitCount(*x.d, InFlightLine(*g.d1), 2, absl::Seconds(120));
  g.d1->Kill();
  reading.join();
  ASSERT_TRUE(posted) << x.d->Log();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, 2u);
  ExpectHolds(*g.t->plan, **v, 6);
  EXPECT_THAT(x.d->Log(), HasSubstr(absl::StrCat("from ", g.d1->peer_address(), " failed (")));
  const std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), 2);
  // Version 2's every byte counted once: the failed get's range counts as daemon 0's.
  EXPECT_EQ(Value(m, kUcxBytes), 2.0 * static_cast<double>(g.bytes));
  EXPECT_EQ(m.count(kGrpcBytes), 0u);
  g.t->c.clear();
}

TEST(WeightsUcxPullTest, TheOnlySourceKilledDuringAUcxGetFailsTheOpenByNameKeepingNothing) {
  Published g({}, {"--testing_weights_ucx_stall_after=1"}, "midget1", 7, kOverTcp);
  ASSERT_NE(g.t->plan, nullptr);
  ReaderDaemon x({g.d1->peer_address()}, {"--v=1"}, kOverTcp);
  const size_t segments = x.d->Segments().size();
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = absl::UnknownError("unset");
  std::thread reading([&] { v = r->Open("gpt"); });
  const bool posted = AwaitCount(*x.d, InFlightLine(*g.d1), 1, absl::Seconds(120));
  g.d1->Kill();
  reading.join();
  ASSERT_TRUE(posted) << x.d->Log();
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kUnavailable) << v.status();
  EXPECT_THAT(v.status().message(), HasSubstr(g.d1->peer_address()));
  EXPECT_THAT(v.status().message(), HasSubstr("nothing was kept"));
  // Nothing partial: no segment left, no version; the daemon still runs and answers.
  EXPECT_EQ(x.d->Segments().size(), segments);
  int status = 0;
  EXPECT_EQ(::waitpid(x.d->pid(), &status, WNOHANG), 0) << "the reader's daemon exited";
  absl::StatusOr<std::unique_ptr<WeightsVersion>> again = r->Open("gpt");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  const std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), 0);
  EXPECT_EQ(m.count(kUcxBytes), 0u);
  g.t->c.clear();
}

TEST(WeightsUcxPullTest, LaterPullsLandInTheNamesSpareSegmentElementForElement) {
  Published g({}, {}, "ucxspare", 1);
  ASSERT_NE(g.t->plan, nullptr);
  // --weights_keep=1: pull n >= 3 takes the segment of version n - 2 (released, trimmed).
  ReaderDaemon x({g.d0->peer_address(), g.d1->peer_address()}, {"--weights_keep=1"});
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  constexpr int kVersions = 4;
  for (int step = 1; step <= kVersions; ++step) {
    if (step > 1) g.PublishStep(step);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << "version " << step << ": " << v.status();
    EXPECT_EQ((*v)->info().version, static_cast<uint64_t>(step));
    // Not a byte of the spare's older version left: every element is this step's.
    ExpectHolds(*g.t->plan, **v, step);
    ASSERT_TRUE((*v)->Release().ok());
  }
  EXPECT_EQ(Count(*x.d, "into the name's spare segment"), kVersions - 2) << x.d->Log();
  const std::map<std::string, double> m = ParseMetrics(x.Metrics());
  EXPECT_EQ(Value(m, "flatshard_weights_pulls_total{code=\"OK\"}"), kVersions);
  EXPECT_EQ(Value(m, kUcxBytes), static_cast<double>(kVersions * g.bytes));
  // The group's other daemon (--weights_keep=2) copied the leader's version 4 into the
  // segment of its version 1, and holds each version element for element.
  EXPECT_EQ(Value(g.d1->Metrics(), "flatshard_weights_segment_reuses_total"), 1);
  std::unique_ptr<WeightsReader> r1 = Reader(*g.d1);
  ASSERT_NE(r1, nullptr);
  for (int step = kVersions - 1; step <= kVersions; ++step) {
    OpenWeightsOptions which;
    which.version = static_cast<uint64_t>(step);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r1->Open("gpt", which);
    ASSERT_TRUE(v.ok()) << "version " << step << " on the group's other daemon: " << v.status();
    ExpectHolds(*g.t->plan, **v, step);
  }
}

TEST(WeightsUcxPullTest, ABadTransportIsRefusedByName) {
  const std::string cmd = absl::StrCat("timeout 60 ", FS_BINARY_DIR,
                                       "/server/flatshardd --ephemeral --weights_transport=tcp "
                                       "--socket=/tmp/fswu-bad-",
                                       getpid(), ".sock 2>&1");
  FILE* f = ::popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
  const int status = ::pclose(f);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--weights_transport must be 'ucx' or 'grpc', got 'tcp'"));
}

}  // namespace
}  // namespace flatshard::client
