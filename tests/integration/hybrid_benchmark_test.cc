// Label "bench": HYBRID_SHARD on 2 real daemons x 2 ranks, a read-only summon + End and a
// gradient reduction of one unit of FS_HYBRID_BENCH_NUMEL float32 elements (default 4M), the
// median of FS_HYBRID_BENCH_ITERS iterations (default 5, after one warm-up). Rows in one run:
// this build's FULL_SHARD (world all-gather / reduce-scatter: the network baseline), this
// build's HYBRID_SHARD and, when FS_HYBRID_BENCH_BASELINE names another flatshardd (e.g. the
// main branch's build, before the shard-group summon), that daemon's HYBRID_SHARD; ratios are
// against the first row. Times include the trainer threads' fill of the gradient.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::Layout;
using ::flatshard::testing::RunRanks;

constexpr int kWorld = 4;
constexpr int kPerNode = 2;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t out = 0;
  return v != nullptr && absl::SimpleAtoi(v, &out) && out > 0 ? out : fallback;
}

struct Row {
  std::string name;
  double summon_ms = 0;
  double grads_ms = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double TimeMs(Fn fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// One row: a fresh cluster of `daemon` ("": this build's), `strategy`, timed.
Row Measure(const std::string& name, const std::string& daemon, const std::string& strategy,
            int64_t numel, int iters) {
  Row row{name};
  if (daemon.empty()) {
    unsetenv("FS_TEST_FLATSHARDD");
  } else {
    setenv("FS_TEST_FLATSHARDD", daemon.c_str(), 1);
  }
  ::flatshard::testing::ClusterOptions o;
  o.tag_prefix = "fshb";
  Cluster cluster(Layout::kTwoDaemons, o);
  unsetenv("FS_TEST_FLATSHARDD");
  const std::string manifest =
      absl::StrCat(R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Linear", )",
                   R"("bases": ["Module"], "params": [{"name": "weight", "id": 0, "shape": [)",
                   numel, R"(], "dtype": "float32", "requires_grad": true}], "children": []}})");
  const std::string policy =
      absl::StrCat(R"({"format": "flatshard.policy/1", "sharding_strategy": ")", strategy, R"("})");
  std::vector<std::unique_ptr<Client>> c(kWorld);
  RunRanks(kWorld, [&](int r) {
    ClientOptions co;
    co.address = cluster.daemon(r / kPerNode).address();
    co.call_timeout = absl::Seconds(120);
    co.join_timeout = absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(co);
    ASSERT_TRUE(client.ok()) << client.status();
    c[r] = *std::move(client);
    ASSERT_TRUE(c[r]->Join("bench", kWorld, r, "tok", cluster.coordinator()).ok());
    absl::StatusOr<RegisteredModule> m = c[r]->Register("", manifest, policy, InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << m.status();
  });
  std::vector<double> summon, grads;
  for (int i = 0; i <= iters; ++i) {
    const double s = TimeMs([&] {
      RunRanks(kWorld, [&](int r) {
        SummonOptions read_only;
        read_only.writeback = false;
        absl::StatusOr<std::unique_ptr<SummonedParams>> v = c[r]->Summon("", "", read_only);
        ASSERT_TRUE(v.ok()) << v.status();
        ASSERT_TRUE((*v)->End().ok());
      });
    });
    const double g = TimeMs([&] {
      RunRanks(kWorld, [&](int r) {
        absl::Status st = c[r]->ReduceScatterGrads(
            "", 0, ReduceOp::kAvg, /*accumulate=*/false, [&](PendingReduceScatter& p) {
              float* data = static_cast<float*>(p.data());
              std::fill(data, data + p.numel(), static_cast<float>(r + 1));
              return absl::OkStatus();
            });
        ASSERT_TRUE(st.ok()) << st;
      });
    });
    if (i == 0) continue;  // warm-up
    summon.push_back(s);
    grads.push_back(g);
  }
  row.summon_ms = Median(summon);
  row.grads_ms = Median(grads);
  return row;
}

TEST(HybridBenchmark, ShardGroupSummonAndGradientsAgainstTheWorldCollectives) {
  const int64_t numel = EnvInt("FS_HYBRID_BENCH_NUMEL", int64_t{4} << 20);
  const int iters = static_cast<int>(EnvInt("FS_HYBRID_BENCH_ITERS", 5));
  std::vector<Row> rows;
  rows.push_back(Measure("FULL_SHARD (this build)", "", "FULL_SHARD", numel, iters));
  if (const char* before = std::getenv("FS_HYBRID_BENCH_BASELINE"); before && *before) {
    rows.push_back(
        Measure("HYBRID_SHARD (FS_HYBRID_BENCH_BASELINE)", before, "HYBRID_SHARD", numel, iters));
  }
  rows.push_back(Measure("HYBRID_SHARD (this build)", "", "HYBRID_SHARD", numel, iters));
  std::printf("2 daemons x 2 ranks, one unit of %lld float32 (%.1f MiB), median of %d\n",
              static_cast<long long>(numel), numel * 4.0 / (1 << 20), iters);
  std::printf(
      "| row | summon+End ms | x row 1 | gradients ms | x row 1 |\n|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.1f | %.2f | %.1f | %.2f |\n", r.name.c_str(), r.summon_ms,
                r.summon_ms / rows[0].summon_ms, r.grads_ms, r.grads_ms / rows[0].grads_ms);
  }
}

}  // namespace
}  // namespace flatshard::client
