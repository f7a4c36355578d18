// A reader's daemon pulling versions over UCX (issue 25, README "Published weights across
// daemons", --weights_transport): real flatshardd processes on this host stand in for nodes.
//   - four readers on a daemon with no rank of the group: one copy, read with UCX gets from
//     both sources, element for element; the bytes counted under transport="ucx"; the
//     group's other daemon copies the leader's version over UCX too;
//   - a source (or the reader's daemon) with --weights_transport=grpc: its share comes over
//     the gRPC stream (the other source's over UCX), values exact, both counted;
//   - a reader's daemon whose UCX reaches no source: every range again over gRPC;
//   - a source killed while its share is pending: the share is read from the other source;
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
  Published(const std::vector<std::string>& flags0, const std::vector<std::string>& flags1,
            const std::string& group, int step) {
    d0 = GroupDaemon(0, flags0);
    d1 = GroupDaemon(1, flags1, /*metrics=*/true);
    t = std::make_unique<Trainers>(std::vector<const DaemonProcess*>{d0.get(), d1.get()}, group);
    if (t->plan == nullptr) return;
    t->Step(step);
    std::vector<absl::StatusOr<PublishedVersion>> p = t->Publish("gpt");
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(p[r].ok()) << "rank " << r << ": " << p[r].status();
      if (p[r].ok()) bytes = p[r]->bytes;
    }
  }
};

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
