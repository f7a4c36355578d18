// Hierarchical all-gather and reduce-scatter between real daemons (issue 27): 2 flatshardd
// processes x 2 ranks each (rank r on daemon r % 2), trainers as threads with their own Client.
// The same training step runs on daemons with hierarchical collectives (the default) and on
// daemons started with --ucx_hierarchical=false (the flat ring): summoned parameters and
// reduced gradient shards are equal to the element and to the exact values.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/shard_snapshot.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::Layout;
using ::flatshard::testing::RunRanks;
using ::flatshard::testing::SnapshotShards;

constexpr int kWorld = 4;

// Parameter values and gradients: small multiples of 0.25, so every sum is exact in float32.
float ParamValue(int64_t i) { return static_cast<float>(i % 61) * 0.25f; }
float GradValue(int rank, int64_t i) { return static_cast<float>((i * 3 + rank * 5) % 17) * 0.5f; }

struct Outcome {
  std::vector<std::vector<std::vector<float>>> shards;  // by rank: SnapshotShards
  std::vector<std::vector<float>> summoned;             // by rank: every parameter, in plan order
  std::vector<std::string> logs;                        // by daemon
};

// One step on a fresh 2-daemon cluster: write parameters (writeback summon), summon them
// read-only (all-gather), reduce-scatter a gradient for every unit.
Outcome RunStep(const std::vector<std::string>& daemon_flags) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fshier";
  options.extra_flags = daemon_flags;
  Cluster c(Layout::kTwoDaemons, options);
  Outcome out;
  out.shards.resize(kWorld);
  out.summoned.resize(kWorld);
  std::vector<std::unique_ptr<Client>> clients(kWorld);
  std::vector<RegisteredModule> models(kWorld);
  RunRanks(kWorld, [&](int r) {
    ClientOptions o;
    o.address = c.AddressFor(r);
    o.call_timeout = absl::Seconds(60);
    o.join_timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    clients[r] = *std::move(client);
    ASSERT_TRUE(clients[r]->Join("g", kWorld, r, "t0k", c.coordinator()).ok());
    absl::StatusOr<RegisteredModule> m =
        clients[r]->Register("", ExampleModelFile("gpt_tied", "manifest"),
                             ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
    models[r] = *std::move(m);
    // Every rank writes the same values and keeps its own range.
    SummonOptions writeback;
    writeback.writeback = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> w = clients[r]->Summon("", "", writeback);
    ASSERT_TRUE(w.ok()) << "rank " << r << ": " << w.status();
    for (const PlanUnit& u : models[r].plan->units) {
      for (const PlanParam& p : u.params) {
        float* data = static_cast<float*>((*w)->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) data[i] = ParamValue(i);
      }
    }
    ASSERT_TRUE((*w)->End().ok());
  });
  RunRanks(kWorld, [&](int r) {
    ASSERT_NE(clients[r], nullptr);
    SummonOptions read_only;
    read_only.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = clients[r]->Summon("", "", read_only);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const PlanUnit& u : models[r].plan->units) {
      for (const PlanParam& p : u.params) {
        const float* data = static_cast<const float*>((*s)->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(data[i], ParamValue(i)) << "rank " << r << " " << p.fqn << "[" << i << "]";
        }
        out.summoned[r].insert(out.summoned[r].end(), data, data + p.numel);
      }
    }
    ASSERT_TRUE((*s)->End().ok());
    for (const PlanUnit& u : models[r].plan->units) {
      absl::Status rs = clients[r]->ReduceScatterGrads(
          "", u.index, ReduceOp::kSum, false, [&](PendingReduceScatter& pending) {
            float* data = static_cast<float*>(pending.data());
            for (int64_t i = 0; i < pending.numel(); ++i) data[i] = GradValue(r, i);
            return absl::OkStatus();
          });
      ASSERT_TRUE(rs.ok()) << "rank " << r << " unit " << u.index << ": " << rs;
    }
    out.shards[r] = SnapshotShards(*clients[r]);
  });
  clients.clear();
  for (int d = 0; d < c.daemon_count(); ++d) out.logs.push_back(c.daemon(d).Log());
  return out;
}

TEST(HierarchicalCollectivesTest, TwoDaemonsOfTwoRanksEqualTheFlatRingToTheElement) {
  const Outcome hier = RunStep({});
  const Outcome flat = RunStep({"--ucx_hierarchical=false"});
  if (::testing::Test::HasFatalFailure()) return;
  // Chosen automatically (2 daemons x 2 ranks), and only where not turned off.
  for (int d = 0; d < 2; ++d) {
    EXPECT_TRUE(absl::StrContains(hier.logs[d],
                                  "hierarchical all-gather and reduce-scatter, "
                                  "2 daemons x 2 ranks"))
        << "daemon " << d;
    EXPECT_FALSE(absl::StrContains(flat.logs[d], "hierarchical all-gather")) << "daemon " << d;
  }
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(hier.summoned[r].size(), flat.summoned[r].size());
    ASSERT_FALSE(hier.summoned[r].empty());
    EXPECT_EQ(hier.summoned[r], flat.summoned[r]) << "rank " << r;
    ASSERT_EQ(hier.shards[r].size(), flat.shards[r].size()) << "rank " << r;
    for (size_t k = 0; k < hier.shards[r].size(); ++k) {
      ASSERT_EQ(hier.shards[r][k], flat.shards[r][k]) << "rank " << r << " entry " << k;
    }
    // Gradient shard j of rank r: the sum over ranks of GradValue at r * shard_numel + j.
    for (size_t u = 0; u < hier.shards[r].size() / 2; ++u) {
      const std::vector<float>& grad = hier.shards[r][2 * u + 1];
      const int64_t n = static_cast<int64_t>(grad.size());
      ASSERT_GT(n, 0) << "rank " << r << " unit " << u;
      for (int64_t j = 0; j < n; ++j) {
        float want = 0;
        for (int k = 0; k < kWorld; ++k) want += GradValue(k, r * n + j);
        ASSERT_EQ(grad[j], want) << "rank " << r << " unit " << u << " element " << j;
      }
    }
  }
}

// Daemons started with different --ucx_hierarchical would run different algorithms for one
// all-gather: the group does not form, and every rank's Join names both daemons and settings.
TEST(HierarchicalCollectivesTest, DaemonsThatDisagreeOnHierarchicalDoNotFormAGroup) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fshiermix";
  options.daemon_flags = {{}, {"--ucx_hierarchical=false"}};
  Cluster c(Layout::kTwoDaemons, options);
  std::vector<absl::Status> joined(kWorld);
  RunRanks(kWorld, [&](int r) {
    ClientOptions o;
    o.address = c.AddressFor(r);
    o.call_timeout = absl::Seconds(60);
    o.join_timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    joined[r] = (*client)->Join("g", kWorld, r, "t0k", c.coordinator());
  });
  RecordProperty("rank0", std::string(joined[0].message()));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(joined[r].code(), absl::StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << joined[r];
    EXPECT_THAT(joined[r].message(),
                ::testing::AllOf(::testing::HasSubstr("group g: its daemons disagree"),
                                 ::testing::HasSubstr("daemon node0 ("),
                                 ::testing::HasSubstr("ranks 0, 2) has hierarchical=on"),
                                 ::testing::HasSubstr("daemon node1 ("),
                                 ::testing::HasSubstr("ranks 1, 3) has hierarchical=off"),
                                 ::testing::HasSubstr("--ucx_hierarchical")))
        << "rank " << r;
  }
}

// The re-form path: daemon node1 crashes and comes back with --ucx_hierarchical=false while
// the survivors keep their sessions. Its ranks' joins fail naming both settings, and daemon
// node0, handed the new epoch's table by the coordinator (Membership::OnTable), aborts the
// group instead of connecting it: the survivors' next op fails, it does not hang.
TEST(HierarchicalCollectivesTest, ADaemonRestartedWithTheOtherSettingDoesNotReFormTheGroup) {
  ::flatshard::testing::ClusterOptions options;
  options.tag_prefix = "fshierre";
  Cluster c(Layout::kTwoDaemons, options);
  std::vector<std::unique_ptr<Client>> clients(kWorld);
  auto connect = [&](int r) {
    ClientOptions o;
    o.address = c.AddressFor(r);
    o.call_timeout = absl::Seconds(60);
    o.join_timeout = absl::Seconds(60);
    o.max_attempts = 1;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    if (client.ok()) clients[r] = *std::move(client);
  };
  RunRanks(kWorld, [&](int r) {
    connect(r);
    ASSERT_NE(clients[r], nullptr);
    ASSERT_TRUE(clients[r]->Join("g", kWorld, r, "t0k", c.coordinator()).ok());
    absl::StatusOr<RegisteredModule> m =
        clients[r]->Register("", ExampleModelFile("gpt_tied", "manifest"),
                             ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
  });
  if (::testing::Test::HasFatalFailure()) return;

  c.Kill(1);
  clients[1] = nullptr;
  clients[3] = nullptr;
  ASSERT_TRUE(c.Restart(1, {"--ucx_hierarchical=false"}));
  std::vector<absl::Status> joined(kWorld);
  RunRanks(kWorld, [&](int r) {
    if (c.DaemonOf(r) != 1) return;  // survivors keep their sessions
    connect(r);
    ASSERT_NE(clients[r], nullptr);
    joined[r] = clients[r]->Join("g", kWorld, r, "t0k", c.coordinator());
  });
  for (int r : {1, 3}) {
    EXPECT_EQ(joined[r].code(), absl::StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << joined[r];
    EXPECT_THAT(joined[r].message(),
                ::testing::AllOf(::testing::HasSubstr("group g: its daemons disagree"),
                                 ::testing::HasSubstr("ranks 0, 2) has hierarchical=on"),
                                 ::testing::HasSubstr("ranks 1, 3) has hierarchical=off")))
        << "rank " << r;
  }
  // The coordinator's table reaches node0 on its own stream, in no fixed order with the joins'
  // answers: wait (generously) for node0 to refuse it.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!absl::StrContains(c.daemon(0).Log(), "group=g cannot re-form at epoch") &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::string log = c.daemon(0).Log();
  ASSERT_THAT(log, ::testing::HasSubstr("group=g cannot re-form at epoch"));
  EXPECT_THAT(log.substr(log.find("group=g cannot re-form at epoch")),
              ::testing::HasSubstr("ranks 1, 3) has hierarchical=off"));
  RunRanks(kWorld, [&](int r) {
    if (c.DaemonOf(r) != 0) return;
    SummonOptions read_only;
    read_only.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = clients[r]->Summon("", "", read_only);
    EXPECT_FALSE(s.ok()) << "rank " << r << ": the group was not re-formed, yet its summon worked";
  });
}

}  // namespace
}  // namespace flatshard::client
