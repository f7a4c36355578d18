// HYBRID_SHARD and _HYBRID_SHARD_ZERO2 across daemons: two real flatshardd processes stand in
// for two nodes with two ranks each (ranks 0, 1 on daemon 0; 2, 3 on daemon 1), trainers are
// threads with their own Client. The plan shards within a daemon's ranks (shard_world_size 2)
// and replicates across daemons; summons (float32, bfloat16 compute, rank0_only), gradient
// reductions (sum and average, in float32), commits, checkpoint save and load, and publishing
// are checked to the element against references computed here. Values are small integers or
// quarters: every sum is exact in float32. A group whose daemons host non-consecutive ranks
// is refused at register, naming them.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::GroupOptions;
using ::flatshard::testing::JoinRanks;
using ::flatshard::testing::Layout;
using ::flatshard::testing::OnCluster;
using ::flatshard::testing::Rank;
using ::flatshard::testing::RegisterRanks;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

constexpr char kToken[] = "t0k";
constexpr char kGroup[] = "hybrid";
constexpr int kWorld = 4;
constexpr int kPerNode = 2;

::flatshard::testing::ClusterOptions Options() {
  ::flatshard::testing::ClusterOptions o;
  o.tag_prefix = "fshy";
  o.metrics = true;  // collective counts: what a summon or a reduction ran
  return o;
}

// bfloat16 compute (compute_precision summons), float32 shards and gradient reduction.
std::string Policy(const std::string& strategy) {
  return absl::StrCat(R"({"format": "flatshard.policy/1", "sharding_strategy": ")", strategy,
                      R"(", "auto_wrap": {"kind": "module_types", "types": ["Block"]},
 "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}})");
}

// `v` rounded to bfloat16 (to nearest, ties to even), as a float.
float RoundToBFloat16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// A bfloat16 element as a float.
float FromBFloat16(uint16_t h) {
  const uint32_t bits = uint32_t{h} << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Joins every rank (no retries); rank r on daemon daemon_of(r).
std::vector<Rank> JoinAll(Cluster& c, const std::function<int(int)>& daemon_of) {
  GroupOptions g = OnCluster(c, kGroup, kToken);
  g.connect = [&](int r) {
    return ConnectClient(c.daemon(daemon_of(r)).address(),
                         {absl::Seconds(60), absl::Seconds(60), 1});
  };
  return JoinRanks(kWorld, g);
}

int Consecutive(int r) { return r / kPerNode; }

// Element i of parameter `fqn` at step `step`, exact in float32.
float Value(const std::string& fqn, int64_t i, int step) {
  uint32_t h = 2166136261u;
  for (unsigned char ch : fqn) h = (h ^ ch) * 16777619u;
  return static_cast<float>(1 + h % 61 + step) + static_cast<float>(i % 64) * 0.25f;
}

// Rank r's gradient, element k of the padded unit: a small integer.
float Given(int r, int64_t k) { return static_cast<float>((r + 1) * (k % 7 + 1)); }

// The flat element `k` of unit `u` at `step` (0 in the padding).
float FlatValue(const PlanUnit& u, int64_t k, int step) {
  for (const PlanParam& p : u.params) {
    if (k >= p.offset && k < p.offset + p.numel) return Value(p.fqn, k - p.offset, step);
  }
  return 0.0f;
}

class HybridTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<Cluster>(Layout::kTwoDaemons, Options());
    ranks_ = JoinAll(*cluster_, Consecutive);
    ASSERT_EQ(ranks_.size(), static_cast<size_t>(kWorld));
    RegisterRanks(ranks_, ExampleModelFile("gpt_tied", "manifest"), Policy(GetParam()));
  }

  const Plan& plan() const { return *ranks_[0].model.plan; }

  // Every rank writes step `step`'s values into a writeback summon of the whole model.
  void WriteValues(int step) {
    RunRanks(kWorld, [&](int r) {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s =
          ranks_[r].client->Summon("", "", SummonOptions{});
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
      for (const PlanUnit& u : plan().units) {
        for (const PlanParam& p : u.params) {
          const ParamView* v = (*s)->Find(p.fqn);
          ASSERT_NE(v, nullptr) << p.fqn;
          float* data = static_cast<float*>(v->data);
          for (int64_t i = 0; i < p.numel; ++i) data[i] = Value(p.fqn, i, step);
        }
      }
      absl::Status ended = (*s)->End();
      ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
    });
  }

  // Every rank's read-only summon shows step `step`'s values, and its shards hold their part.
  void ExpectValues(int step) {
    RunRanks(kWorld, [&](int r) {
      SummonOptions read_only;
      read_only.writeback = false;
      absl::StatusOr<std::unique_ptr<SummonedParams>> s =
          ranks_[r].client->Summon("", "", read_only);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
      for (const PlanUnit& u : plan().units) {
        for (const PlanParam& p : u.params) {
          const ParamView* v = (*s)->Find(p.fqn);
          ASSERT_NE(v, nullptr) << p.fqn;
          const float* data = static_cast<const float*>(v->data);
          for (int64_t i = 0; i < p.numel; ++i) {
            ASSERT_EQ(data[i], Value(p.fqn, i, step))
                << "rank " << r << " " << p.fqn << "[" << i << "]";
          }
        }
      }
      EXPECT_TRUE((*s)->End().ok()) << "rank " << r;
      absl::StatusOr<ShardViews> views = ranks_[r].client->GetShardViews("");
      ASSERT_TRUE(views.ok()) << "rank " << r << ": " << views.status();
      for (const UnitShardView& v : *views) {
        const PlanUnit& u = plan().units[v.unit];
        EXPECT_EQ(v.shard_offset, (r % kPerNode) * u.shard_numel) << "rank " << r;
        const float* data = static_cast<const float*>(v.data);
        for (int64_t j = 0; j < v.shard_numel; ++j) {
          ASSERT_EQ(data[j], FlatValue(u, v.shard_offset + j, step))
              << "rank " << r << " unit " << v.unit << " shard element " << j;
        }
      }
    });
  }

  void TearDown() override {
    ranks_.clear();
    cluster_.reset();
  }

  std::unique_ptr<Cluster> cluster_;
  std::vector<Rank> ranks_;
};

TEST_P(HybridTest, PlanShardsWithinADaemonAndSummonsGatherTheShardGroup) {
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(ranks_[r].model.plan->shard_world_size, kPerNode) << "rank " << r;
  }
  WriteValues(0);
  ExpectValues(0);
  // A compute summon: each local rank's shard cast to bfloat16 into its block of the node's
  // copy (the shard group is the daemon's ranks: no collective).
  RunRanks(kWorld, [&](int r) {
    SummonOptions compute;
    compute.writeback = false;
    compute.compute_precision = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks_[r].client->Summon("", "", compute);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const PlanUnit& u : plan().units) {
      for (const PlanParam& p : u.params) {
        const ParamView* v = (*s)->Find(p.fqn);
        ASSERT_NE(v, nullptr) << p.fqn;
        ASSERT_EQ(v->dtype, DType::kBFloat16) << p.fqn;
        const uint16_t* data = static_cast<const uint16_t*>(v->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(FromBFloat16(data[i]), RoundToBFloat16(Value(p.fqn, i, 0)))
              << "rank " << r << " " << p.fqn << "[" << i << "]";
        }
      }
    }
    EXPECT_TRUE((*s)->End().ok()) << "rank " << r;
  });
  // rank0_only with writeback: a world gather to rank 0, whose edits reach every replica.
  RunRanks(kWorld, [&](int r) {
    SummonOptions rank0;
    rank0.rank0_only = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks_[r].client->Summon("", "", rank0);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const PlanUnit& u : plan().units) {
      for (const PlanParam& p : u.params) {
        const ParamView* v = (*s)->Find(p.fqn);
        if (r != 0) {
          EXPECT_EQ(v, nullptr) << "rank " << r << " " << p.fqn;
          continue;
        }
        ASSERT_NE(v, nullptr) << p.fqn;
        float* data = static_cast<float*>(v->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(data[i], Value(p.fqn, i, 0)) << p.fqn << "[" << i << "]";
          data[i] = Value(p.fqn, i, 3);
        }
      }
    }
    absl::Status ended = (*s)->End();
    ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
  });
  ExpectValues(3);
}

TEST_P(HybridTest, GradientsAreReducedOverEveryRankIntoEachShard) {
  WriteValues(0);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    for (const PlanUnit& u : plan().units) {
      RunRanks(kWorld, [&](int r) {
        absl::Status s = ranks_[r].client->ReduceScatterGrads(
            "", u.index, op, /*accumulate=*/false, [&](PendingReduceScatter& pending) {
              EXPECT_EQ(pending.numel(), u.padded_numel);
              float* data = static_cast<float*>(pending.data());
              for (int64_t k = 0; k < pending.numel(); ++k) data[k] = Given(r, k);
              return absl::OkStatus();
            });
        ASSERT_TRUE(s.ok()) << "rank " << r << " unit " << u.index << ": " << s;
      });
    }
    // Shard k of every rank: the sum over all 4 ranks of their gradients' shard k (replicas
    // identical), divided by the world size for AVG.
    RunRanks(kWorld, [&](int r) {
      absl::StatusOr<ShardViews> views = ranks_[r].client->GetShardViews("");
      ASSERT_TRUE(views.ok()) << "rank " << r << ": " << views.status();
      for (const UnitShardView& v : *views) {
        ASSERT_NE(v.grad, nullptr) << "rank " << r << " unit " << v.unit;
        const float* grad = static_cast<const float*>(v.grad);
        for (int64_t j = 0; j < v.shard_numel; ++j) {
          float want = 0;
          for (int q = 0; q < kWorld; ++q) want += Given(q, v.shard_offset + j);
          if (op == ReduceOp::kAvg) want /= kWorld;
          ASSERT_EQ(grad[j], want) << "rank " << r << " unit " << v.unit << " element " << j;
        }
      }
      // A summon with gradients shows the whole reduced gradient on every rank.
      SummonOptions with_grads;
      with_grads.writeback = false;
      with_grads.with_grads = true;
      absl::StatusOr<std::unique_ptr<SummonedParams>> s =
          ranks_[r].client->Summon("", "", with_grads);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
      for (const PlanUnit& u : plan().units) {
        for (const PlanParam& p : u.params) {
          const ParamView* g = (*s)->FindGrad(p.fqn);
          ASSERT_NE(g, nullptr) << p.fqn;
          const float* data = static_cast<const float*>(g->data);
          for (int64_t i = 0; i < p.numel; ++i) {
            float want = 0;
            for (int q = 0; q < kWorld; ++q) want += Given(q, p.offset + i);
            if (op == ReduceOp::kAvg) want /= kWorld;
            ASSERT_EQ(data[i], want) << "rank " << r << " grad " << p.fqn << "[" << i << "]";
          }
        }
      }
      EXPECT_TRUE((*s)->End().ok()) << "rank " << r;
    });
  }
}

TEST_P(HybridTest, CommitsCheckpointsAndPublishesTheReplicatedShards) {
  WriteValues(0);
  // A step: every rank moves its own shard to step 1's values and commits.
  RunRanks(kWorld, [&](int r) {
    absl::StatusOr<ShardViews> views = ranks_[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << "rank " << r << ": " << views.status();
    for (const UnitShardView& v : *views) {
      const PlanUnit& u = plan().units[v.unit];
      float* data = static_cast<float*>(v.data);
      for (int64_t j = 0; j < v.shard_numel; ++j) data[j] = FlatValue(u, v.shard_offset + j, 1);
    }
    absl::StatusOr<uint64_t> committed = ranks_[r].client->Commit("");
    ASSERT_TRUE(committed.ok()) << "rank " << r << ": " << committed.status();
  });
  ExpectValues(1);

  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("fshy_ckpt_", getpid());
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  absl::StatusOr<Client::CheckpointInfo> saved = ranks_[0].client->SaveCheckpoint("", dir.string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->files, kWorld);  // rank 0's daemon asks the other one to write its ranks

  WriteValues(2);
  ExpectValues(2);
  absl::StatusOr<Client::CheckpointInfo> loaded =
      ranks_[3].client->LoadCheckpoint("", dir.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectValues(1);
  std::filesystem::remove_all(dir, ignored);

  // Publishing: each daemon holds both shards of every unit; every daemon maps the full model.
  std::vector<absl::StatusOr<PublishedVersion>> published(kWorld, absl::UnknownError("unset"));
  RunRanks(kWorld, [&](int r) { published[r] = ranks_[r].client->Publish("", "gpt"); });
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(published[r].ok()) << published[r].status();
  for (int d = 0; d < 2; ++d) {
    ClientOptions o;
    o.address = cluster_->daemon(d).address();
    absl::StatusOr<std::unique_ptr<WeightsReader>> reader = WeightsReader::Connect(o);
    ASSERT_TRUE(reader.ok()) << reader.status();
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = (*reader)->Open("gpt");
    ASSERT_TRUE(v.ok()) << "daemon " << d << ": " << v.status();
    for (const PlanUnit& u : plan().units) {
      for (const PlanParam& p : u.params) {
        const WeightsTensor* t = (*v)->Find(p.fqn);
        ASSERT_NE(t, nullptr) << p.fqn;
        ASSERT_EQ(t->bytes, p.numel * 4) << p.fqn;
        const float* data = static_cast<const float*>(t->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(data[i], Value(p.fqn, i, 1))
              << "daemon " << d << " " << p.fqn << "[" << i << "]";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, HybridTest,
                         ::testing::Values("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
                         [](const auto& info) {
                           return info.param[0] == '_' ? std::string("HybridShardZero2")
                                                       : std::string("HybridShard");
                         });

// Ranks of one daemon that are not consecutive (rank r on daemon r % 2): no node is a block of
// the device mesh, so every rank's register is refused (FAILED_PRECONDITION, the refusing
// rank's code), naming the daemons and their ranks.
// flatshard_collectives_total by kind (summed over statuses) and the UCX collective bytes.
std::map<std::string, double> CollectiveCounts(const ::flatshard::testing::DaemonProcess& d) {
  std::map<std::string, double> out;
  for (const auto& [name, value] : d.Metrics()) {
    if (absl::StartsWith(name, "flatshard_collectives_total{")) {
      const size_t k = name.find("kind=\"") + 6;
      out[name.substr(k, name.find('"', k) - k)] += value;
    } else if (name == "flatshard_collective_bytes_total{backend=\"ucx\"}") {
      out["bytes"] += value;
    }
  }
  return out;
}

TEST_P(HybridTest, ReadOnlySummonsRunNoCollectiveAndGradientsOneAllReducePerUnit) {
  WriteValues(0);  // a writeback summon: the world all-gather (kRegroup)
  std::vector<std::map<std::string, double>> before;
  for (int d = 0; d < 2; ++d) before.push_back(CollectiveCounts(cluster_->daemon(d)));
  ASSERT_GT(before[0]["AllGather"], 0);  // the counters are there
  // Read-only summons, full and compute precision: assembled on each daemon from its local
  // ranks' shards, no collective at all, so no byte between the daemons.
  ExpectValues(0);
  RunRanks(kWorld, [&](int r) {
    SummonOptions compute;
    compute.writeback = false;
    compute.compute_precision = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks_[r].client->Summon("", "", compute);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    EXPECT_TRUE((*s)->End().ok()) << "rank " << r;
  });
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(CollectiveCounts(cluster_->daemon(d)), before[d]) << "daemon " << d;
  }
  // Gradients: one all-reduce of the padded unit per rank and unit (its halves hierarchical:
  // each daemon sends the other 2 * 1/2 of the unit, collective_hierarchical_algorithms_test).
  double unit_bytes = 0;
  for (const PlanUnit& u : plan().units) {
    RunRanks(kWorld, [&](int r) {
      absl::Status s = ranks_[r].client->ReduceScatterGrads(
          "", u.index, ReduceOp::kSum, /*accumulate=*/false, [&](PendingReduceScatter& pending) {
            float* data = static_cast<float*>(pending.data());
            for (int64_t k = 0; k < pending.numel(); ++k) data[k] = Given(r, k);
            return absl::OkStatus();
          });
      ASSERT_TRUE(s.ok()) << "rank " << r << " unit " << u.index << ": " << s;
    });
    unit_bytes += static_cast<double>((u.padded_numel + kWorld - 1) / kWorld * kWorld * 4);
  }
  const double units = static_cast<double>(plan().units.size());
  for (int d = 0; d < 2; ++d) {
    std::map<std::string, double> after = CollectiveCounts(cluster_->daemon(d));
    EXPECT_EQ(after["AllReduce"] - before[d]["AllReduce"], kPerNode * units) << "daemon " << d;
    EXPECT_EQ(after["AllGather"], before[d]["AllGather"]) << "daemon " << d;
    EXPECT_EQ(after["ReduceScatter"], before[d]["ReduceScatter"]) << "daemon " << d;
    EXPECT_EQ(after["bytes"] - before[d]["bytes"], kPerNode * unit_bytes) << "daemon " << d;
  }
}

TEST_P(HybridTest, ALocalRankThatLeavesFailsTheOtherLocalRanksSummonNamingIt) {
  // Rank 0 summons read-only; rank 1, its daemon's other rank, leaves instead. The node copy
  // can never be whole: rank 0 is answered at once (waiting: the session's end fails it;
  // not arrived yet: the summon is refused), not at its deadline.
  absl::Status summoned;
  std::thread rank0([&] {
    SummonOptions read_only;
    read_only.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks_[0].client->Summon("", "", read_only);
    summoned = s.status();
  });
  ranks_[1].client.reset();  // its session ends
  rank0.join();
  EXPECT_TRUE(absl::IsUnavailable(summoned)) << summoned;
  EXPECT_THAT(summoned.message(), HasSubstr("rank 1")) << summoned;
}

TEST(HybridRefusedTest, NonConsecutiveRanksOfADaemonAreRefusedAtRegister) {
  Cluster c(Layout::kTwoDaemons, Options());
  std::vector<Rank> ranks = JoinAll(c, [](int r) { return r % 2; });
  const std::string manifest = ExampleModelFile("gpt_tied", "manifest");
  RunRanks(kWorld, [&](int r) {
    ASSERT_NE(ranks[r].client, nullptr);
    absl::StatusOr<RegisteredModule> m =
        ranks[r].client->Register("", manifest, Policy("HYBRID_SHARD"), InitMode::kZeros);
    ASSERT_FALSE(m.ok()) << "rank " << r;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
    EXPECT_THAT(m.status().message(), HasSubstr("node0: ranks 0, 2; node1: ranks 1, 3"));
  });
  // Nothing was registered: FULL_SHARD registers on the same group.
  RunRanks(kWorld, [&](int r) {
    absl::StatusOr<RegisteredModule> m =
        ranks[r].client->Register("", manifest, Policy("FULL_SHARD"), InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
    EXPECT_EQ(m->plan->shard_world_size, kWorld);
  });
}

}  // namespace
}  // namespace flatshard::client
