#pragma once
// What the tests of published weights across daemons share (weights_multi_test.cc,
// weights_follow_test.cc): real flatshardd processes on this host stand in for nodes, peer
// ports over TCP; trainers are threads with a Client each on their rank's daemon (rank r on
// daemons[r % daemons.size()]); readers check values element for element.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "common/checkpoint/checkpoint.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/integration/weights_pattern.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/metrics_scrape.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client::weights_testing {

using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::RunRanks;

inline constexpr char kToken[] = "mult1";
inline constexpr int kWorld = 4;

inline ClientOptions Options(const std::string& address,
                             absl::Duration call_timeout = absl::Seconds(20)) {
  ClientOptions o;
  o.address = address;
  o.call_timeout = call_timeout;
  o.join_timeout = absl::Seconds(10);
  o.max_attempts = 1;
  return o;
}

inline std::unique_ptr<WeightsReader> Reader(const DaemonProcess& d) {
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = WeightsReader::Connect(Options(d.address()));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

// A daemon of the group: a peer port (fixed when `port` > 0, so a restart keeps it); with
// `metrics`, DaemonProcess::Metrics scrapes it; `env`: "NAME=value" entries added to its
// environment.
inline std::unique_ptr<DaemonProcess> GroupDaemon(int i, std::vector<std::string> flags = {},
                                                  bool metrics = false,
                                                  std::vector<std::string> env = {}) {
  DaemonOptions o;
  o.env = std::move(env);
  o.metrics = metrics;
  o.tag_prefix = "fswm";
  o.peer = true;
  o.node_name = absl::StrCat("node", i);
  o.extra_flags = std::move(flags);
  return std::make_unique<DaemonProcess>(std::move(o));
}

// A daemon with no rank of the group that copies from `sources` (and serves metrics); `env`:
// "NAME=value" entries added to its environment.
struct ReaderDaemon {
  std::string dir;
  std::unique_ptr<DaemonProcess> d;
  explicit ReaderDaemon(const std::vector<std::string>& sources,
                        const std::vector<std::string>& flags = {},
                        const std::vector<std::string>& env = {}) {
    char tmpl[] = "/tmp/fswm-reader.XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl), nullptr);
    dir = tmpl;
    DaemonOptions o;
    o.tag_prefix = "fswr";
    o.extra_flags = {"--weights_sources=" + absl::StrJoin(sources, ","),
                     "--metrics_address=127.0.0.1:0", "--metrics_address_file=" + dir + "/m"};
    o.extra_flags.insert(o.extra_flags.end(), flags.begin(), flags.end());
    o.env = env;
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
    return ::flatshard::testing::ScrapeMetrics(host_port);
  }
};

// kWorld ranks of `group`, rank r on daemons[r % 2], gpt_tied registered.
struct Trainers {
  std::vector<std::unique_ptr<Client>> c;
  std::shared_ptr<const Plan> plan;

  // `simulated_gpus`: daemons with --simulate_gpus (the trainers open device shards through
  // the test harness).
  Trainers(const std::vector<const DaemonProcess*>& daemons, const std::string& group,
           absl::Duration call_timeout = absl::Seconds(20), bool simulated_gpus = false)
      : c(kWorld) {
    RunRanks(kWorld, [&](int r) {
      const DaemonProcess& d = *daemons[r % daemons.size()];
      absl::StatusOr<std::unique_ptr<Client>> client =
          simulated_gpus ? internal::ConnectWithGpuApis(Options(d.address(), call_timeout),
                                                        ::flatshard::testing::SimulatedGpuApis())
                         : Client::Connect(Options(d.address(), call_timeout));
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
  std::vector<absl::StatusOr<PublishedVersion>> Publish(const std::string& name,
                                                        const PublishOptions& options = {}) {
    std::vector<absl::StatusOr<PublishedVersion>> out(kWorld, absl::UnknownError("unset"));
    RunRanks(kWorld, [&](int r) { out[r] = c[r]->Publish("", name, options); });
    return out;
  }
};

// Every state_dict key of `v` holds step `step` of gpt_tied; tied keys alias their parameter.
inline void ExpectHolds(const Plan& plan, const WeightsVersion& v, int step) {
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

inline std::string MetricLine(const std::string& name, double value) {
  return absl::StrCat("\n", name, " ", value, "\n");
}

// A free TCP port on loopback (for a daemon that must get the same one after a restart).
inline int FreePort() {
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

}  // namespace flatshard::client::weights_testing
