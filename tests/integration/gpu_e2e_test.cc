// The GPU backend end to end: real flatshardd processes, trainers as threads with their own
// Clients opening the daemons' device memory from another process, as in production.
// Layouts: one daemon (world 1 over NCCL, world 2 with both ranks on GPU 0 staged between
// them), and two daemons sharing GPU 0 (device memory staged over UCX: NCCL cannot put two
// ranks of one communicator on one GPU).
//
// Built twice:
// - gpu_e2e_test (CTest label "gpu"): daemons with --gpus=0, CUDA IPC, cudaMemcpy; every test
//   skips where no GPU is usable (CI, the development machines);
// - simulated_gpu_e2e_test (FS_SIMULATED_GPU, the default run): daemons with
//   --simulate_gpus=1, whose "device memory" is host shared memory that the trainers open
//   through tests/testing/simulated_gpu.h. The daemon's and the client's GPU code paths
//   (placement, staging over inproc and UCX, offload, rank0_only copies per device, device
//   reduce-scatter, the IPC open-once cache, event plumbing) run here; CUDA itself does not.

#if !FS_SIMULATED_GPU
#include <cuda_runtime.h>
#endif
#include <cstring>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/gpu/cuda_util.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#if FS_SIMULATED_GPU
#include "client/client_internal.h"
#include "tests/testing/simulated_gpu.h"
#endif

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::Layout;
using ::testing::HasSubstr;

constexpr char kToken[] = "gpu-t0k";

#if FS_SIMULATED_GPU
#define SKIP_WITHOUT_GPU() \
  do {                     \
  } while (0)
constexpr char kGpuFlag[] = "--simulate_gpus=1";

absl::StatusOr<std::unique_ptr<Client>> ConnectClient(ClientOptions options) {
  return internal::ConnectWithGpuApis(std::move(options), ::flatshard::testing::SimulatedGpuApis());
}
// Simulated device memory is host memory.
void CopyBytes(void* dst, const void* src, size_t bytes, int /*device*/) {
  std::memcpy(dst, src, bytes);
}
#else
#define SKIP_WITHOUT_GPU()                                                 \
  do {                                                                     \
    absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();    \
    if (!gpus.ok()) GTEST_SKIP() << "no GPU: " << gpus.status().message(); \
  } while (0)
constexpr char kGpuFlag[] = "--gpus=0";

absl::StatusOr<std::unique_ptr<Client>> ConnectClient(ClientOptions options) {
  return Client::Connect(std::move(options));
}
void CopyBytes(void* dst, const void* src, size_t bytes, int device) {
  if (device < 0) {
    std::memcpy(dst, src, bytes);
    return;
  }
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), cudaSuccess);
}
#endif

::flatshard::testing::ClusterOptions GpuOptions(std::vector<std::string> more = {}) {
  ::flatshard::testing::ClusterOptions o;
  o.tag_prefix = FS_SIMULATED_GPU ? "fssimgpu" : "fsgpu";
  o.extra_flags = {kGpuFlag};
  for (std::string& f : more) o.extra_flags.push_back(std::move(f));
  return o;
}

std::vector<float> Read(const void* data, int device, int64_t numel) {
  std::vector<float> out(static_cast<size_t>(numel));
  CopyBytes(out.data(), data, out.size() * sizeof(float), device);
  return out;
}

void Fill(const ParamView& v, const std::function<float(int64_t)>& value) {
  std::vector<float> host(static_cast<size_t>(v.numel));
  for (int64_t i = 0; i < v.numel; ++i) host[i] = value(i);
  CopyBytes(v.data, host.data(), host.size() * sizeof(float), v.device);
}

// A value that differs per parameter and element.
float ValueOf(const std::string& fqn, int64_t i, float scale = 1.0f) {
  return scale * (static_cast<float>(std::hash<std::string>{}(fqn) % 97) + 0.25f * (i % 13));
}

// Tied FQNs alias one view: each view's values are named by the first FQN at its address.
std::map<const void*, std::string> FirstFqns(const ParamViews& views) {
  std::map<const void*, std::string> first;
  for (const ParamView& v : views) first.emplace(v.data, v.fqn);
  return first;
}

// Fills every distinct view of `views` with ValueOf(its first FQN, i, scale).
void FillAll(const ParamViews& views, float scale) {
  const std::map<const void*, std::string> first = FirstFqns(views);
  for (const ParamView& v : views) {
    if (first.at(v.data) != v.fqn) continue;  // a tied alias
    Fill(v, [&](int64_t i) { return ValueOf(v.fqn, i, scale); });
  }
}

struct Rank {
  std::unique_ptr<Client> client;
  RegisteredModule model;
};

// Joins `world` ranks and registers gpt_tied with FROM_EVERY_RANK init values ValueOf(scale).
std::vector<Rank> JoinAndInit(const Cluster& d, const std::string& group, int world,
                              float scale = 1.0f) {
  std::vector<Rank> ranks(world);
  const std::string manifest = ExampleModelFile("gpt_tied", "manifest");
  const std::string policy = ExampleModelFile("gpt_tied", "policy");
  ::flatshard::testing::RunRanks(world, [&](int r) {
    ClientOptions options;
    options.address = d.AddressFor(r);
    options.call_timeout = absl::Seconds(30);
    options.join_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> client = ConnectClient(options);
    ASSERT_TRUE(client.ok()) << client.status();
    ranks[r].client = *std::move(client);
    ASSERT_TRUE(ranks[r].client->Join(group, world, r, kToken, d.coordinator()).ok());
    absl::StatusOr<RegisteredModule> reg =
        ranks[r].client->Register("", manifest, policy, InitMode::kFromEveryRank);
    ASSERT_TRUE(reg.ok()) << reg.status();
    ranks[r].model = *std::move(reg);
    ASSERT_NE(ranks[r].model.init_summon, nullptr);
    for (const ParamView& v : ranks[r].model.init_summon->params()) {
      EXPECT_GE(v.device, 0) << v.fqn << ": init views live on the GPU";
    }
    FillAll(ranks[r].model.init_summon->params(), scale);
    absl::Status ended = ranks[r].model.init_summon->End();
    ASSERT_TRUE(ended.ok()) << ended;
  });
  return ranks;
}

// Every rank summons the whole model with `options` and checks each view against `want`.
void ExpectValues(std::vector<Rank>& ranks, SummonOptions options,
                  const std::function<float(const std::string&, int64_t)>& want) {
  ::flatshard::testing::RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", options);
    ASSERT_TRUE(s.ok()) << s.status();
    if (options.rank0_only && r != 0) {
      EXPECT_FALSE((*s)->has_views());
    } else {
      const std::map<const void*, std::string> first = FirstFqns((*s)->params());
      for (const ParamView& v : (*s)->params()) {
        EXPECT_EQ(v.device < 0, options.offload_to_cpu) << v.fqn;
        const std::vector<float> got = Read(v.data, v.device, v.numel);
        const std::string& named = first.at(v.data);
        for (int64_t i = 0; i < v.numel; ++i) {
          ASSERT_EQ(got[i], want(named, i)) << "rank " << r << " " << v.fqn << "[" << i << "]";
        }
      }
    }
    ASSERT_TRUE((*s)->End().ok());
  });
}

class GpuE2ETest : public ::testing::TestWithParam<Layout> {};

TEST_P(GpuE2ETest, InitValuesComeBackOnTheDeviceAndOffloaded) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "init", 2);
  auto want = [](const std::string& fqn, int64_t i) { return ValueOf(fqn, i); };
  SummonOptions read_only;
  read_only.writeback = false;
  ExpectValues(ranks, read_only, want);
  SummonOptions offload = read_only;
  offload.offload_to_cpu = true;  // pinned host views, all-gathered on the GPU
  ExpectValues(ranks, offload, want);
  SummonOptions rank0 = read_only;
  rank0.rank0_only = true;
  ExpectValues(ranks, rank0, want);
}

TEST_P(GpuE2ETest, WritebackFromDeviceAndFromOffloadedViewsReachesTheShards) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "writeback", 2);
  for (bool offload : {false, true}) {
    const float scale = offload ? 3.0f : 2.0f;
    ::flatshard::testing::RunRanks(2, [&](int r) {
      SummonOptions o;
      o.offload_to_cpu = offload;
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", o);
      ASSERT_TRUE(s.ok()) << s.status();
      FillAll((*s)->params(), scale);
      ASSERT_TRUE((*s)->End().ok());
    });
    SummonOptions read_only;
    read_only.writeback = false;
    ExpectValues(ranks, read_only,
                 [&](const std::string& fqn, int64_t i) { return ValueOf(fqn, i, scale); });
  }
}

TEST_P(GpuE2ETest, Rank0OnlyWritebackReachesEveryRank) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "rank0", 2);
  ::flatshard::testing::RunRanks(2, [&](int r) {
    SummonOptions o;
    o.rank0_only = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", o);
    ASSERT_TRUE(s.ok()) << s.status();
    if (r == 0) FillAll((*s)->params(), 5.0f);
    ASSERT_TRUE((*s)->End().ok());
  });
  SummonOptions read_only;
  read_only.writeback = false;
  ExpectValues(ranks, read_only,
               [](const std::string& fqn, int64_t i) { return ValueOf(fqn, i, 5.0f); });
}

TEST_P(GpuE2ETest, ReduceScatterSumsAveragesAndAccumulatesOnTheDevice) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "grads", 2);
  const Plan& plan = *ranks[0].model.plan;
  auto reduce = [&](ReduceOp op, bool accumulate) {
    for (const PlanUnit& u : plan.units) {
      ::flatshard::testing::RunRanks(2, [&](int r) {
        absl::Status s = ranks[r].client->ReduceScatterGrads(
            "", u.index, op, accumulate, [&](PendingReduceScatter& p) -> absl::Status {
              EXPECT_GE(p.device(), 0);
              std::vector<float> g(static_cast<size_t>(p.numel()), 1.0f + r);
              CopyBytes(p.data(), g.data(), g.size() * sizeof(float), p.device());
              return absl::OkStatus();
            });
        ASSERT_TRUE(s.ok()) << s;
      });
    }
  };
  reduce(ReduceOp::kSum, false);  // 1 + 2 = 3
  reduce(ReduceOp::kAvg, true);   // + 1.5 = 4.5
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<ShardViews> views = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    for (const UnitShardView& u : *views) {
      ASSERT_NE(u.grad, nullptr) << "unit " << u.unit;
      ASSERT_GE(u.device, 0);
      const std::vector<float> g = Read(u.grad, u.device, u.shard_numel);
      EXPECT_FLOAT_EQ(g.front(), 4.5f) << "rank " << r << " unit " << u.unit;
    }
  }
  SummonOptions o;
  o.writeback = false;
  o.with_grads = true;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", o);
    ASSERT_TRUE(s.ok()) << s.status();
    const ParamView* g = (*s)->FindGrad("wte.weight");
    ASSERT_NE(g, nullptr);
    const std::vector<float> got = Read(g->data, g->device, g->numel);
    EXPECT_FLOAT_EQ(got[got.size() / 2], 4.5f);
    ASSERT_TRUE((*s)->End().ok());
  });
}

TEST_P(GpuE2ETest, SteadyStateSummonsOpenNoIpcHandles) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "steady", 2);
  SummonOptions o;
  o.writeback = false;
  std::vector<int64_t> after_first(2);
  for (int step = 0; step < 6; ++step) {
    ::flatshard::testing::RunRanks(2, [&](int r) {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", o);
      ASSERT_TRUE(s.ok()) << s.status();
      ASSERT_TRUE((*s)->End().ok());
      if (step == 0) after_first[r] = ranks[r].client->ipc_open_calls();
    });
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_GT(after_first[r], 0);
    EXPECT_EQ(ranks[r].client->ipc_open_calls(), after_first[r]) << "rank " << r;
  }
}

// Writes ValueOf(.., scale) into every parameter on the device: a writeback summon of the
// whole model, ended (collective: every rank calls it).
void WriteValuesOnDevice(Client& c, float scale) {
  absl::StatusOr<std::unique_ptr<SummonedParams>> w = c.Summon("", "", SummonOptions());
  ASSERT_TRUE(w.ok()) << w.status();
  FillAll((*w)->params(), scale);
  ASSERT_TRUE((*w)->End().ok());
}

// A read-only summon of one unit (not its children), as a trainer's forward makes.
SummonOptions OneUnitReadOnly() {
  SummonOptions o;
  o.writeback = false;
  o.recurse = false;
  return o;
}

// Reads every device view of `s` back and checks it against ValueOf(.., scale).
void ExpectDeviceValues(const SummonedParams& s, int rank, float scale) {
  const std::map<const void*, std::string> first = FirstFqns(s.params());
  for (const ParamView& v : s.params()) {
    EXPECT_GE(v.device, 0) << v.fqn;
    const std::vector<float> got = Read(v.data, v.device, v.numel);
    for (int64_t i = 0; i < v.numel; ++i) {
      ASSERT_EQ(got[i], ValueOf(first.at(v.data), i, scale))
          << "rank " << rank << " " << v.fqn << "[" << i << "]";
    }
  }
}

TEST_P(GpuE2ETest, StartedSummonsHandBackDeviceViewsOrderedOnTheTrainersStream) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "started", 2);
  const float scale = 5.0f;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // New values written on the device, then a started summon of every unit, last first,
    // each waited for in turn and read on the device.
    WriteValuesOnDevice(c, scale);
    const SummonOptions o = OneUnitReadOnly();
    const Plan& plan = *ranks[r].model.plan;
    std::vector<std::unique_ptr<PendingSummon>> started;
    for (size_t k = plan.units.size(); k-- > 0;) {
      absl::StatusOr<std::unique_ptr<PendingSummon>> p = c.StartSummon("", plan.units[k].module, o);
      ASSERT_TRUE(p.ok()) << p.status();
      started.push_back(*std::move(p));
    }
    for (std::unique_ptr<PendingSummon>& p : started) {
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = p->Wait();
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
      ExpectDeviceValues(**s, r, scale);
      ASSERT_TRUE((*s)->End().ok());
    }
  });
}

TEST_P(GpuE2ETest, TransitionsEndDeviceViewsInTheNextSummonsRoundTrip) {
  SKIP_WITHOUT_GPU();
  Cluster d(GetParam(), GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "transition", 2);
  const float scale = 3.0f;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    WriteValuesOnDevice(c, scale);
    const SummonOptions o = OneUnitReadOnly();
    const Plan& plan = *ranks[r].model.plan;
    // Every unit, last first, twice; each summon (synchronous and started alternately) ends
    // the one before in its own RPC, the End ordered after the trainer's reads by the event
    // the summon sends.
    std::unique_ptr<SummonedParams> held;
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t k = plan.units.size(); k-- > 0;) {
        absl::StatusOr<std::unique_ptr<SummonedParams>> s;
        if (k % 2 == 0) {
          s = c.Summon("", plan.units[k].module, o, std::move(held));
        } else {
          absl::StatusOr<std::unique_ptr<PendingSummon>> p =
              c.StartSummon("", plan.units[k].module, o, std::move(held));
          ASSERT_TRUE(p.ok()) << p.status();
          s = (*p)->Wait();
        }
        ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
        ExpectDeviceValues(**s, r, scale);
        held = *std::move(s);
      }
    }
    // Nothing is left summoned once the last one ended: a writeback summon goes through.
    absl::StatusOr<std::unique_ptr<SummonedParams>> all =
        c.Summon("", "", SummonOptions(), std::move(held));
    ASSERT_TRUE(all.ok()) << "rank " << r << ": " << all.status();
    ASSERT_TRUE((*all)->End().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuE2ETest,
                         ::testing::Values(Layout::kSingle, Layout::kTwoDaemons),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return ::flatshard::testing::LayoutName(info.param);
                         });

TEST(GpuE2E, WorldOneOverNcclRoundTrips) {
  SKIP_WITHOUT_GPU();
  if (FS_SIMULATED_GPU) GTEST_SKIP() << "simulated GPUs have no NCCL";
  Cluster d(Layout::kSingle, GpuOptions({"--gpu_collectives=nccl"}));
  std::vector<Rank> ranks = JoinAndInit(d, "nccl1", 1, 7.0f);
  SummonOptions o;
  o.writeback = false;
  ExpectValues(ranks, o, [](const std::string& fqn, int64_t i) { return ValueOf(fqn, i, 7.0f); });
}

TEST(GpuE2E, RanksLiveOnTheirOwnGpusOfOneDaemon) {
  SKIP_WITHOUT_GPU();
  if (!FS_SIMULATED_GPU) GTEST_SKIP() << "needs two GPUs: run against --simulate_gpus=2";
  Cluster d(Layout::kSingle, GpuOptions({"--simulate_gpus=2"}));
  std::vector<Rank> ranks = JoinAndInit(d, "two-gpus", 2, 9.0f);
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<ShardViews> views = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    for (const UnitShardView& u : *views)
      EXPECT_EQ(u.device, r) << "rank " << r << " unit " << u.unit;
  }
  SummonOptions o;
  o.writeback = false;
  ExpectValues(ranks, o, [](const std::string& fqn, int64_t i) { return ValueOf(fqn, i, 9.0f); });
}

TEST(GpuE2E, MissingRankFailsTheSummonAtItsDeadlineNamingIt) {
  SKIP_WITHOUT_GPU();
  Cluster d(Layout::kSingle, GpuOptions());
  std::vector<Rank> ranks = JoinAndInit(d, "deadline", 2);
  // Rank 1 never summons: rank 0's all-gather waits for it until the deadline (the
  // daemon's --default_wait of 10 s comes before the client's 30 s).
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[0].client->Summon("", "", {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("rank 1 did not arrive"));
}

}  // namespace
}  // namespace flatshard::client
