// A reader's daemon following its --weights_sources (issue 25, README "Readers on other
// nodes"): real flatshardd processes on this host stand in for nodes, peer ports over TCP.
//   - a reader watching on a daemon with no rank of the group gets each of 3 publishes,
//     copied there without an Open, element for element, one copy per version (metrics);
//   - the source killed and restarted while a reader waits: the name is followed again and
//     the next version arrives; a source that dies is replaced by the next one;
//   - the reader's daemon restarted with its state directory serves the newest copy without
//     copying it again, pulls a newer one, and keeps serving its copy when the source is gone.

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
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
using ::testing::HasSubstr;
using ::testing::Not;
using weights_testing::ExpectHolds;
using weights_testing::FreePort;
using weights_testing::GroupDaemon;
using weights_testing::kWorld;
using weights_testing::Reader;
using weights_testing::ReaderDaemon;
using weights_testing::Trainers;

constexpr absl::Duration kWait = absl::Seconds(90);  // generous: 2 loaded cores in CI

// A temp directory removed at the end.
struct TempDir {
  std::string path;
  explicit TempDir(const char* prefix) {
    std::string tmpl = absl::StrCat("/tmp/", prefix, ".XXXXXX");
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// A thread joined when it goes out of scope (also when an ASSERT returns early).
struct JoinedThread {
  std::thread t;
  template <typename F>
  explicit JoinedThread(F f) : t(std::move(f)) {}
  ~JoinedThread() { join(); }
  void join() {
    if (t.joinable()) t.join();
  }
};

OpenWeightsOptions AtVersion(uint64_t v) {
  OpenWeightsOptions o;
  o.version = v;
  return o;
}

void ExpectAllPublished(const std::vector<absl::StatusOr<PublishedVersion>>& p, uint64_t version) {
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(p[r].ok()) << "rank " << r << ": " << p[r].status();
    EXPECT_EQ(p[r]->version, version) << "rank " << r;
  }
}

// Polls `text()` until it holds `line` (the follower's state is asynchronous).
template <typename Text>
bool Shows(Text text, const std::string& line) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    if (text().find(line) != std::string::npos) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Whether `state_dir` holds a stored version of weights (`version`; 0: any), written after
// Publish or a copy is answered and renamed into place whole; polled until it does.
bool StoredWeights(const std::string& state_dir, uint64_t version = 0) {
  const std::filesystem::path dir = std::filesystem::path(state_dir) / "weights";
  const auto stored = [&] {
    std::error_code ec;
    for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
      if (f.path().extension() != ".weights") continue;
      if (version == 0) return true;
      std::string head(4096, '\0');  // the header (magic, JSON summary line) is in 4 KiB
      std::ifstream(f.path()).read(head.data(), head.size());
      for (const char* end : {",", "}"}) {
        if (head.find(absl::StrCat("\"version\":", version, end)) != std::string::npos) {
          return true;
        }
      }
    }
    return false;
  };
  for (const absl::Time deadline = absl::Now() + kWait; absl::Now() < deadline;) {
    if (stored()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

bool MetricsShow(const ReaderDaemon& x, const std::string& line) {
  return Shows([&] { return x.Metrics(); }, line);
}

// What the reader's daemon logs when its stream at `source` broke.
std::string BrokenStream(const std::string& source) {
  return absl::StrCat("following weights \"gpt\" of uid ", getuid(),
                      ": UNAVAILABLE: watching weights \"gpt\" of uid ", getuid(), " at daemon ",
                      source);
}

TEST(WeightsFollowTest, AWatchingReaderGetsEachPublishCopiedOnceWithoutAnOpen) {
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  std::unique_ptr<DaemonProcess> d1 = GroupDaemon(1);
  Trainers t({d0.get(), d1.get()}, "follow");
  ASSERT_NE(t.plan, nullptr);
  TempDir state("fswf-follower");
  ReaderDaemon x({d0->peer_address(), d1->peer_address()}, {"--state_dir=" + state.path});
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  for (int s = 1; s <= 3; ++s) {
    // The reader waits on its own daemon (which copies nothing until it hears of a version).
    absl::StatusOr<PublishedVersion> got = absl::UnknownError("unset");
    JoinedThread waiting([&] { got = r->WaitForVersion("gpt", s - 1, kWait); });
    t.Step(s);
    std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt");
    waiting.join();
    ExpectAllPublished(p, s);
    ASSERT_TRUE(got.ok()) << "step " << s << ": " << got.status();
    EXPECT_EQ(got->version, static_cast<uint64_t>(s));
    EXPECT_EQ(got->generation, p[0]->generation);
    // Already here: opened by number, no copy.
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt", AtVersion(s));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ((*v)->info().generation, p[0]->generation);
    ExpectHolds(*t.plan, **v, s);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // An Open of `latest` finds nothing newer at the sources: still one copy per version.
  absl::StatusOr<std::unique_ptr<WeightsVersion>> latest = r->Open("gpt");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ((*latest)->info().version, 3u);
  ExpectHolds(*t.plan, **latest, 3);
  // (A copy is counted just after its version appears: polled.)
  EXPECT_TRUE(MetricsShow(x, "\nflatshard_weights_pulls_total{code=\"OK\"} 3\n")) << x.Metrics();
  EXPECT_THAT(x.Metrics(), Not(HasSubstr("flatshard_weights_pulls_total{code=\"UNAVAILABLE\"}")));
  // No watch is left: the daemon stops following.
  EXPECT_TRUE(MetricsShow(x, "\nflatshard_weights_followed 0\n")) << x.Metrics();
  EXPECT_TRUE(MetricsShow(x, "\nflatshard_weights_follow_streams 0\n")) << x.Metrics();
  // The follower stored its copies: a restart serves version 3 with nothing copied.
  ASSERT_TRUE(StoredWeights(state.path, 3));
  latest->reset();
  std::filesystem::remove(x.dir + "/m");  // the restarted daemon writes its metrics address
  ASSERT_TRUE(x.d->Restart());
  r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<PublishedVersion> kept = r->WaitForVersion("gpt", 2, kWait);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->version, 3u);
  ASSERT_TRUE(MetricsShow(x, "\nflatshard_weights_versions 1\n")) << x.Metrics();
  EXPECT_THAT(x.Metrics(), Not(HasSubstr("flatshard_weights_pulls_total{")));
}

TEST(WeightsFollowTest, ASourceKilledAndRestartedWhileFollowedIsFollowedAgain) {
  TempDir state("fswf-source");
  // The source keeps its peer port and its versions (and numbering) across the restart.
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(
      0, {absl::StrCat("--peer_address=127.0.0.1:", FreePort()), "--state_dir=" + state.path});
  ReaderDaemon x({d0->peer_address()});
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  {
    Trainers t({d0.get()}, "before");
    ASSERT_NE(t.plan, nullptr);
    t.Step(1);
    ExpectAllPublished(t.Publish("gpt"), 1);
  }
  absl::StatusOr<PublishedVersion> first = r->WaitForVersion("gpt", 0, kWait);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->version, 1u);

  // A reader waits for the next version; its daemon follows the name at the source.
  absl::StatusOr<PublishedVersion> got = absl::UnknownError("unset");
  JoinedThread waiting([&] { got = r->WaitForVersion("gpt", 1, kWait); });
  // Its stream at the source is open (the source registered the watch) when the source dies.
  ASSERT_TRUE(MetricsShow(x, "\nflatshard_weights_follow_streams 1\n")) << x.Metrics();
  // Version 1 is stored after Publish returned: once it is, the restart keeps it (and the
  // numbering).
  ASSERT_TRUE(StoredWeights(state.path));
  d0->Kill();
  ASSERT_TRUE(d0->Restart());
  Trainers t({d0.get()}, "after");
  ASSERT_NE(t.plan, nullptr);
  t.Step(2);
  std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt");
  waiting.join();
  ExpectAllPublished(p, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->version, 2u);
  EXPECT_EQ(got->generation, p[0]->generation);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt", AtVersion(2));
  ASSERT_TRUE(v.ok()) << v.status();
  ExpectHolds(*t.plan, **v, 2);
  EXPECT_TRUE(MetricsShow(x, "\nflatshard_weights_pulls_total{code=\"OK\"} 2\n")) << x.Metrics();
  // The broken stream was logged, naming the source.
  EXPECT_THAT(x.d->Log(), HasSubstr(BrokenStream(d0->peer_address())));
  t.c.clear();
  d0.reset();
}

TEST(WeightsFollowTest, AFollowedSourceThatDiesIsReplacedByTheNextOne) {
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  std::unique_ptr<DaemonProcess> d1 = GroupDaemon(1);
  ReaderDaemon x({d1->peer_address(), d0->peer_address()});  // followed at d1 first
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  {
    Trainers t({d0.get(), d1.get()}, "first");
    ASSERT_NE(t.plan, nullptr);
    t.Step(1);
    ExpectAllPublished(t.Publish("gpt"), 1);
  }
  absl::StatusOr<PublishedVersion> got = absl::UnknownError("unset");
  JoinedThread waiting([&] { got = r->WaitForVersion("gpt", 1, kWait); });
  // Following at d1: version 1 copied (not reported: the reader waits for a newer one).
  ASSERT_TRUE(MetricsShow(x, "\nflatshard_weights_pulls_total{code=\"OK\"} 1\n")) << x.Metrics();
  ASSERT_TRUE(MetricsShow(x, "\nflatshard_weights_follow_streams 1\n")) << x.Metrics();
  const std::string dead = d1->peer_address();
  d1->Kill();
  // The stream at d1 broke (logged by name); the follower now streams from d0.
  EXPECT_TRUE(Shows([&] { return x.d->Log(); }, BrokenStream(dead))) << x.d->Log();
  EXPECT_TRUE(MetricsShow(x, "\nflatshard_weights_follow_streams 1\n")) << x.Metrics();
  // d1 back (a new peer address, not among the sources): the next publish comes through d0.
  ASSERT_TRUE(d1->Restart());
  Trainers t({d0.get(), d1.get()}, "second");
  ASSERT_NE(t.plan, nullptr);
  t.Step(2);
  std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt");
  waiting.join();
  ExpectAllPublished(p, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->version, 2u);
  EXPECT_EQ(got->generation, p[0]->generation);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt", AtVersion(2));
  ASSERT_TRUE(v.ok()) << v.status();
  ExpectHolds(*t.plan, **v, 2);
}

TEST(WeightsFollowTest, AReaderDaemonRestartedWithItsStateDirServesItsCopyWithoutAPull) {
  TempDir state("fswf-reader");
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  Trainers t({d0.get()}, "kept");
  ASSERT_NE(t.plan, nullptr);
  t.Step(1);
  ExpectAllPublished(t.Publish("gpt"), 1);
  ReaderDaemon x({d0->peer_address()}, {"--state_dir=" + state.path});
  {
    std::unique_ptr<WeightsReader> r = Reader(*x.d);
    ASSERT_NE(r, nullptr);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    ExpectHolds(*t.plan, **v, 1);
  }
  // The copy is written after the reader was answered: wait for its file, then kill the
  // daemon.
  ASSERT_TRUE(StoredWeights(state.path));
  std::filesystem::remove(x.dir + "/m");  // the restarted daemon writes its metrics address
  ASSERT_TRUE(x.d->Restart());

  // Restarted: the copy serves `latest` (the source has nothing newer); nothing is copied.
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, 1u);
  ExpectHolds(*t.plan, **v, 1);
  ASSERT_TRUE(MetricsShow(x, "\nflatshard_weights_versions 1\n")) << x.Metrics();
  EXPECT_THAT(x.Metrics(), Not(HasSubstr("flatshard_weights_pulls_total{")));

  // A newer one at the source is pulled.
  t.Step(2);
  ExpectAllPublished(t.Publish("gpt"), 2);
  v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, 2u);
  ExpectHolds(*t.plan, **v, 2);
  EXPECT_THAT(x.Metrics(), HasSubstr("\nflatshard_weights_pulls_total{code=\"OK\"} 1\n"));

  // The source gone: the local copy still serves `latest`.
  t.c.clear();
  d0->Kill();
  v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, 2u);
  ExpectHolds(*t.plan, **v, 2);
}

}  // namespace
}  // namespace flatshard::client
