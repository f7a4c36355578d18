// Published weights across daemons (issue 25, README "Published weights across daemons"): real
// flatshardd processes on this host stand in for nodes, peer ports over TCP; trainers are
// threads with a Client each on their rank's daemon (ranks 0, 2 on daemon 0; 1, 3 on daemon 1).
//   - a group on two daemons publishes; a reader on each daemon maps the committed step,
//     element for element, under the same version and generation;
//   - a third daemon with no rank of the group (--weights_sources) copies a version once for
//     four readers, and the next version on demand;
//   - a source daemon killed mid-copy: a named error, nothing kept, a retry copies;
//   - a publish only one daemon's ranks call fails by name and shifts nothing;
//   - a publisher killed with SIGKILL at random points leaves no partial version anywhere.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/checkpoint/checkpoint.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

constexpr char kToken[] = "mult1";
constexpr int kWorld = 4;

ClientOptions Options(const std::string& address, absl::Duration call_timeout = absl::Seconds(20)) {
  ClientOptions o;
  o.address = address;
  o.call_timeout = call_timeout;
  o.join_timeout = absl::Seconds(10);
  o.max_attempts = 1;
  return o;
}

std::unique_ptr<WeightsReader> Reader(const DaemonProcess& d) {
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = WeightsReader::Connect(Options(d.address()));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

// A daemon of the group: a peer port (fixed when `port` > 0, so a restart keeps it).
std::unique_ptr<DaemonProcess> GroupDaemon(int i, std::vector<std::string> flags = {}) {
  DaemonOptions o;
  o.tag_prefix = "fswm";
  o.peer = true;
  o.node_name = absl::StrCat("node", i);
  o.extra_flags = std::move(flags);
  return std::make_unique<DaemonProcess>(std::move(o));
}

// A daemon with no rank of the group that copies from `sources` (and serves metrics).
struct ReaderDaemon {
  std::string dir;
  std::unique_ptr<DaemonProcess> d;
  explicit ReaderDaemon(const std::vector<std::string>& sources) {
    char tmpl[] = "/tmp/fswm-reader.XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl), nullptr);
    dir = tmpl;
    DaemonOptions o;
    o.tag_prefix = "fswr";
    o.extra_flags = {"--weights_sources=" + absl::StrJoin(sources, ","),
                     "--metrics_address=127.0.0.1:0", "--metrics_address_file=" + dir + "/m"};
    d = std::make_unique<DaemonProcess>(std::move(o));
  }
  ~ReaderDaemon() {
    d.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  // GET /metrics.
  std::string Metrics() const {
    std::string host_port;
    std::getline(std::ifstream(dir + "/m"), host_port);
    int port = 0;
    if (!absl::SimpleAtoi(host_port.substr(host_port.rfind(':') + 1), &port)) return "";
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string out;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
      ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
      char buf[8192];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
    }
    ::close(fd);
    return out;
  }
};

// Element e of unit u's flat buffer at step s: small multiples of 0.5 (exact).
float Pattern(int32_t u, int64_t e, int s) {
  return static_cast<float>((e * 7 + u * 3 + s) % 64) * 0.5f;
}

void FillShards(const ShardViews& views, int step) {
  for (const UnitShardView& u : views) {
    ASSERT_EQ(u.dtype, DType::kFloat32);
    float* p = static_cast<float*>(u.data);
    for (int64_t i = 0; i < u.shard_numel; ++i) p[i] = Pattern(u.unit, u.shard_offset + i, step);
  }
}

// kWorld ranks of `group`, rank r on daemons[r % 2], gpt_tied registered.
struct Trainers {
  std::vector<std::unique_ptr<Client>> c;
  std::shared_ptr<const Plan> plan;

  Trainers(const std::vector<const DaemonProcess*>& daemons, const std::string& group,
           absl::Duration call_timeout = absl::Seconds(20))
      : c(kWorld) {
    RunRanks(kWorld, [&](int r) {
      const DaemonProcess& d = *daemons[r % daemons.size()];
      absl::StatusOr<std::unique_ptr<Client>> client =
          Client::Connect(Options(d.address(), call_timeout));
      ASSERT_TRUE(client.ok()) << client.status();
      c[r] = *std::move(client);
      absl::Status joined = c[r]->Join(group, kWorld, r, kToken, daemons[0]->peer_address());
      ASSERT_TRUE(joined.ok()) << "rank " << r << ": " << joined;
      absl::StatusOr<RegisteredModule> m =
          c[r]->Register("", ExampleModelFile("gpt_tied", "manifest"),
                         ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
      ASSERT_TRUE(m.ok()) << m.status();
      if (r == 0) plan = m->plan;
    });
  }
  void Step(int s) {
    RunRanks(kWorld, [&](int r) {
      absl::StatusOr<ShardViews> v = c[r]->GetShardViews("");
      ASSERT_TRUE(v.ok()) << v.status();
      FillShards(*v, s);
      ASSERT_TRUE(c[r]->Commit("").ok());
    });
  }
  std::vector<absl::StatusOr<PublishedVersion>> Publish(const std::string& name) {
    std::vector<absl::StatusOr<PublishedVersion>> out(kWorld, absl::UnknownError("unset"));
    RunRanks(kWorld, [&](int r) { out[r] = c[r]->Publish("", name, {}); });
    return out;
  }
};

// Every state_dict key of `v` holds step `step` of gpt_tied; tied keys alias their parameter.
void ExpectHolds(const Plan& plan, const WeightsVersion& v, int step) {
  size_t params = 0;
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      ++params;
      const WeightsTensor* t = v.Find(p.fqn);
      ASSERT_NE(t, nullptr) << p.fqn;
      EXPECT_EQ(t->shape, p.shape) << p.fqn;
      ASSERT_EQ(t->bytes, p.numel * 4) << p.fqn;
      for (int64_t j = 0; j < p.numel; ++j) {
        ASSERT_EQ(static_cast<const float*>(t->data)[j], Pattern(u.index, p.offset + j, step))
            << p.fqn << "[" << j << "]";
      }
    }
  }
  absl::StatusOr<Manifest> manifest = ManifestFromJson(ExampleModelFile("gpt_tied", "manifest"));
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  std::vector<SharedParam> tied = checkpoint::TiedAliases(*manifest, plan);
  for (const PlanUnit& u : plan.units) tied.insert(tied.end(), u.shared.begin(), u.shared.end());
  for (const SharedParam& s : tied) {
    const WeightsTensor* a = v.Find(s.fqn);
    const WeightsTensor* b = v.Find(s.same_as);
    ASSERT_NE(a, nullptr) << s.fqn;
    ASSERT_NE(b, nullptr) << s.same_as;
    EXPECT_EQ(a->data, b->data) << s.fqn << " must alias " << s.same_as;
  }
  EXPECT_EQ(v.tensors().size(), params + tied.size());
}

std::string MetricLine(const std::string& name, double value) {
  return absl::StrCat("\n", name, " ", value, "\n");
}

TEST(WeightsMultiTest, TwoDaemonsPublishAndAThirdCopiesOnceForFourReaders) {
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  std::unique_ptr<DaemonProcess> d1 = GroupDaemon(1);
  Trainers t({d0.get(), d1.get()}, "spread");
  ASSERT_NE(t.plan, nullptr);
  t.Step(1);
  std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt");
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(p[r].ok()) << "rank " << r << ": " << p[r].status();
    EXPECT_EQ(p[r]->version, 1u) << "rank " << r;
    EXPECT_EQ(p[r]->generation, p[0]->generation) << "rank " << r;
  }
  // Every daemon of the group maps a complete copy: the same version and generation.
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    std::unique_ptr<WeightsReader> r = Reader(*d);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ((*v)->info().version, 1u);
    EXPECT_EQ((*v)->info().generation, p[0]->generation);
    ExpectHolds(*t.plan, **v, 1);
  }

  // A third daemon: four readers at once, one copy.
  ReaderDaemon x({d0->peer_address(), d1->peer_address()});
  std::vector<std::unique_ptr<WeightsVersion>> open(4);
  RunRanks(4, [&](int i) {
    std::unique_ptr<WeightsReader> r = Reader(*x.d);
    ASSERT_NE(r, nullptr);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << "reader " << i << ": " << v.status();
    open[i] = *std::move(v);
  });
  for (const auto& v : open) {
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(v->info().version, 1u);
    EXPECT_EQ(v->info().generation, p[0]->generation);
    ExpectHolds(*t.plan, *v, 1);
  }
  std::string m = x.Metrics();
  EXPECT_THAT(m, HasSubstr("\nflatshard_weights_pulls_total{code=\"OK\"} 1\n"));
  EXPECT_THAT(m, HasSubstr(MetricLine("flatshard_weights_pulled_bytes_total", p[0]->bytes)));
  EXPECT_THAT(m, HasSubstr(MetricLine("flatshard_weights_versions", 1)));
  EXPECT_THAT(m, HasSubstr(MetricLine("flatshard_weights_readers", 4)));

  // The next version: copied when a reader asks for the latest; once.
  t.Step(2);
  p = t.Publish("gpt");
  ASSERT_TRUE(p[0].ok()) << p[0].status();
  EXPECT_EQ(p[0]->version, 2u);
  for (int k = 0; k < 2; ++k) {
    std::unique_ptr<WeightsReader> r = Reader(*x.d);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ((*v)->info().version, 2u);
    EXPECT_EQ((*v)->info().generation, p[0]->generation);
    ExpectHolds(*t.plan, **v, 2);
  }
  m = x.Metrics();
  EXPECT_THAT(m, HasSubstr("\nflatshard_weights_pulls_total{code=\"OK\"} 2\n"));
  // Version 1 stays readable while its readers hold it.
  ExpectHolds(*t.plan, *open[0], 1);

  // Unknown names: the sources' NOT_FOUND, named.
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> none = r->Open("nothing");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
  EXPECT_THAT(none.status().message(), HasSubstr("\"nothing\""));
}

TEST(WeightsMultiTest, APublishOnlyOneDaemonsRanksCalledFailsByNameAndTheNextOneWorks) {
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  std::unique_ptr<DaemonProcess> d1 = GroupDaemon(1);
  Trainers t({d0.get(), d1.get()}, "half", absl::Seconds(3));
  ASSERT_NE(t.plan, nullptr);
  t.Step(1);
  // Only daemon 1's ranks (1, 3) call: they time out naming the leader; nothing is published.
  std::vector<absl::StatusOr<PublishedVersion>> half(kWorld, absl::UnknownError("unset"));
  RunRanks(2, [&](int i) { half[2 * i + 1] = t.c[2 * i + 1]->Publish("", "gpt", {}); });
  for (int r : {1, 3}) {
    EXPECT_EQ(half[r].status().code(), absl::StatusCode::kDeadlineExceeded) << half[r].status();
    EXPECT_THAT(half[r].status().message(), HasSubstr("leader (rank 0's daemon)"));
  }
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    absl::StatusOr<std::vector<PublishedVersion>> l = Reader(*d)->List();
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_TRUE(l->empty());
  }
  // The abandoned batch does not shift the next publish: every daemon gets version 1.
  t.Step(2);
  std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt");
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(p[r].ok()) << "rank " << r << ": " << p[r].status();
    EXPECT_EQ(p[r]->version, 1u);
  }
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = Reader(*d)->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    ExpectHolds(*t.plan, **v, 2);
  }
}

// A free TCP port on loopback (for a daemon that must get the same one after a restart).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

TEST(WeightsMultiTest, ASourceKilledMidCopyIsNamedLeavesNothingAndARetryCopies) {
  char tmpl[] = "/tmp/fswm-state.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string state = tmpl;
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  // Daemon 1 keeps its peer port and its published versions across a restart.
  std::unique_ptr<DaemonProcess> d1 =
      GroupDaemon(1, {absl::StrCat("--peer_address=127.0.0.1:", FreePort()), "--state_dir=" + state,
                      "--testing_weights_copy_pause=1500ms"});
  Trainers t({d0.get(), d1.get()}, "killed");
  ASSERT_NE(t.plan, nullptr);
  t.Step(3);
  std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt");
  ASSERT_TRUE(p[0].ok()) << p[0].status();
  ASSERT_TRUE(p[1].ok()) << p[1].status();

  ReaderDaemon x({d1->peer_address()});
  const size_t segments = x.d->Segments().size();
  std::unique_ptr<WeightsReader> r = Reader(*x.d);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = absl::UnknownError("unset");
  std::thread reading([&] { v = r->Open("gpt"); });
  absl::SleepFor(absl::Milliseconds(700));  // the descriptor came; the bytes wait
  d1->Kill();
  reading.join();
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kUnavailable) << v.status();
  EXPECT_THAT(v.status().message(), HasSubstr(d1->peer_address()));
  EXPECT_THAT(v.status().message(), HasSubstr("\"gpt\""));
  EXPECT_THAT(v.status().message(), HasSubstr("nothing was kept"));  // died during the bytes
  // Nothing partial: no version, no segment left.
  absl::StatusOr<std::vector<PublishedVersion>> l = r->List();
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->empty());
  EXPECT_EQ(x.d->Segments().size(), segments);

  // The source is back (its version adopted from its state directory): a retry copies.
  ASSERT_TRUE(d1->Restart());
  v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().version, p[1]->version);
  EXPECT_EQ((*v)->info().generation, p[1]->generation);
  ExpectHolds(*t.plan, **v, 3);
  t.c.clear();
  d1.reset();
  std::error_code ignored;
  std::filesystem::remove_all(state, ignored);
}

// ---- A publisher killed at random points ----

// Child: kWorld ranks over FS_W_A0/FS_W_A1 (coordinator FS_W_PEER) publishing in a loop.
TEST(WeightsMultiChild, DISABLED_PublishLoop) {
  const char* a0 = std::getenv("FS_W_A0");
  const char* a1 = std::getenv("FS_W_A1");
  const char* peer = std::getenv("FS_W_PEER");
  const char* group = std::getenv("FS_W_GROUP");
  ASSERT_TRUE(a0 != nullptr && a1 != nullptr && peer != nullptr && group != nullptr);
  std::vector<std::unique_ptr<Client>> c(kWorld);
  std::vector<uint64_t> generation(kWorld);
  RunRanks(kWorld, [&](int r) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(Options(r % 2 ? a1 : a0));
    ASSERT_TRUE(client.ok()) << client.status();
    c[r] = *std::move(client);
    ASSERT_TRUE(c[r]->Join(group, kWorld, r, kToken, peer).ok());
    absl::StatusOr<RegisteredModule> m =
        c[r]->Register("", ExampleModelFile("gpt_tied", "manifest"),
                       ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << m.status();
    generation[r] = m->generation;
  });
  for (int s = static_cast<int>(generation[0]) + 1;; ++s) {
    RunRanks(kWorld, [&](int r) {
      absl::StatusOr<ShardViews> v = c[r]->GetShardViews("");
      ASSERT_TRUE(v.ok()) << v.status();
      FillShards(*v, s);
      ASSERT_TRUE(c[r]->Commit("").ok());
      ASSERT_TRUE(c[r]->Publish("", "gpt", {}).ok());
    });
  }
}

TEST(WeightsMultiTest, APublisherKilledAtRandomPointsLeavesNoPartialVersionAnywhere) {
  std::unique_ptr<DaemonProcess> d0 = GroupDaemon(0);
  std::unique_ptr<DaemonProcess> d1 = GroupDaemon(1);
  std::mt19937 rng(2525);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<std::string> env = {
        "FS_W_A0=" + d0->address(), "FS_W_A1=" + d1->address(), "FS_W_PEER=" + d0->peer_address(),
        absl::StrCat("FS_W_GROUP=kill", trial), "GTEST_ALSO_RUN_DISABLED_TESTS=1"};
    const pid_t child =
        ::flatshard::testing::SpawnSelf("WeightsMultiChild.DISABLED_PublishLoop", env);
    ASSERT_GT(child, 0);
    absl::SleepFor(absl::Milliseconds(800 + rng() % 1200));
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  absl::SleepFor(absl::Milliseconds(300));  // builds that were under way end
  // Every version on either daemon is whole and holds the committed step it names, and a
  // version number means the same generation on both.
  std::shared_ptr<const Plan> plan;
  {
    Trainers t({d0.get(), d1.get()}, "plan");
    plan = t.plan;
  }
  ASSERT_NE(plan, nullptr);
  std::map<uint64_t, uint64_t> generation_of;  // version -> generation
  std::vector<size_t> versions;                // per daemon
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    std::unique_ptr<WeightsReader> r = Reader(*d);
    absl::StatusOr<std::vector<PublishedVersion>> all = r->List();
    ASSERT_TRUE(all.ok()) << all.status();
    versions.push_back(all->size());
    for (const PublishedVersion& pv : *all) {
      auto [it, added] = generation_of.emplace(pv.version, pv.generation);
      EXPECT_EQ(it->second, pv.generation) << "version " << pv.version;
      absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open(pv.name, [&] {
        OpenWeightsOptions o;
        o.version = pv.version;
        return o;
      }());
      ASSERT_TRUE(v.ok()) << v.status();
      ExpectHolds(*plan, **v, static_cast<int>(pv.generation));
    }
  }
  // Both daemons hold versions (kept: --weights_keep of the one name "gpt").
  EXPECT_GT(versions[0], 0u) << "no trainer published before it was killed";
  EXPECT_GT(versions[1], 0u) << "daemon 1 copied no version";
}

}  // namespace
}  // namespace flatshard::client
