// Ordering between the trainer's stream and the daemon's (issue 23), on simulated GPUs whose
// streams are asynchronous (common/gpu/simulated_stream.h): real flatshardd processes with
// --simulate_gpus=1 and a delayed daemon stream (--simulate_gpu_delay), trainers whose
// cuda_stream is a delayed SimulatedStream. The trainer writes its shards on its stream (an
// optimizer step, still queued when it summons) and reads the summon's views through it: a
// daemon that does not wait for the trainer's event reads the old shards, one that answers
// before its copies are ordered before `ready` hands out old views. Both show as wrong values.
// World 1 (device copies only: device-side ordering) and world 2 (a collective: the host
// waits for the trainer's event), with --gpu_device_ordering on and off.

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/gpu/simulated_stream.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::Layout;

constexpr char kToken[] = "order-t0k";
// Long against a daemon's copy of a few KiB: a read not ordered after the trainer's queued
// writes runs well before them. Correctness never depends on it.
constexpr absl::Duration kTrainerDelay = absl::Milliseconds(60);

struct Rank {
  std::unique_ptr<gpu::SimulatedStream> stream;
  std::unique_ptr<Client> client;
  RegisteredModule model;
};

// Writes `value` into every element of `bytes / 4` floats at `dst` on `stream` (queued: the
// source lives in `keep` until the caller synchronizes the stream).
void EnqueueFill(gpu::SimulatedStream& stream, void* dst, int64_t numel, float value,
                 std::vector<std::vector<float>>* keep) {
  keep->emplace_back(static_cast<size_t>(numel), value);
  stream.EnqueueCopy(dst, keep->back().data(), keep->back().size() * sizeof(float));
}

// Reads `numel` floats at `src` through `stream` (after everything queued on it).
std::vector<float> ReadThrough(gpu::SimulatedStream& stream, const void* src, int64_t numel) {
  std::vector<float> out(static_cast<size_t>(numel));
  stream.EnqueueCopy(out.data(), src, out.size() * sizeof(float));
  EXPECT_TRUE(stream.Synchronize(absl::Minutes(1)).ok());
  return out;
}

class DeviceOrderingTest : public ::testing::TestWithParam<std::tuple<bool, int>> {
 protected:
  bool device_ordering() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }

  ::flatshard::testing::ClusterOptions Options() const {
    ::flatshard::testing::ClusterOptions o;
    o.tag_prefix = "fsorder";
    o.extra_flags = {"--simulate_gpus=1", "--simulate_gpu_delay=5ms",
                     absl::StrCat("--gpu_device_ordering=", device_ordering())};
    return o;
  }

  // Joins, registers gpt_tied with FROM_EVERY_RANK init values 1.0 (written on each rank's
  // stream).
  std::vector<Rank> JoinAndInit(const Cluster& d, const std::string& group) {
    std::vector<Rank> ranks(world());
    const std::string manifest = ::flatshard::testing::ExampleModelFile("gpt_tied", "manifest");
    const std::string policy = ::flatshard::testing::ExampleModelFile("gpt_tied", "policy");
    ::flatshard::testing::RunRanks(world(), [&](int r) {
      Rank& rank = ranks[r];
      rank.stream = std::make_unique<gpu::SimulatedStream>(absl::StrCat("trainer ", r));
      ClientOptions options;
      options.address = d.AddressFor(r);
      options.call_timeout = absl::Seconds(60);
      options.join_timeout = absl::Seconds(60);
      options.cuda_stream = rank.stream.get();
      absl::StatusOr<std::unique_ptr<Client>> client = internal::ConnectWithGpuApis(
          std::move(options), ::flatshard::testing::SimulatedGpuApis());
      ASSERT_TRUE(client.ok()) << client.status();
      rank.client = *std::move(client);
      ASSERT_TRUE(rank.client->Join(group, world(), r, kToken, d.coordinator()).ok());
      absl::StatusOr<RegisteredModule> reg =
          rank.client->Register("", manifest, policy, InitMode::kFromEveryRank);
      ASSERT_TRUE(reg.ok()) << reg.status();
      rank.model = *std::move(reg);
      ASSERT_NE(rank.model.init_summon, nullptr);
      std::vector<std::vector<float>> keep;
      for (const ParamView& v : rank.model.init_summon->params()) {
        ASSERT_GE(v.device, 0) << v.fqn;
        EnqueueFill(*rank.stream, v.data, v.numel, 1.0f, &keep);
      }
      ASSERT_TRUE(rank.stream->Synchronize(absl::Minutes(1)).ok());
      absl::Status ended = rank.model.init_summon->End();
      ASSERT_TRUE(ended.ok()) << ended;
    });
    return ranks;
  }

  // Every rank queues writes of 10 + step + unit into each of its shards on its delayed
  // stream (not waited for), summons the whole model read-only and reads every view
  // through its stream: each element must be its unit's new value.
  void StepThenSummon(std::vector<Rank>& ranks, int step) {
    ::flatshard::testing::RunRanks(world(), [&](int r) {
      Rank& rank = ranks[r];
      absl::StatusOr<ShardViews> shards = rank.client->GetShardViews("");
      ASSERT_TRUE(shards.ok()) << shards.status();
      std::vector<std::vector<float>> keep;
      rank.stream->set_delay(kTrainerDelay);
      for (const UnitShardView& u : *shards) {
        ASSERT_GE(u.device, 0);
        EnqueueFill(*rank.stream, u.data, u.shard_numel, 10.0f + step + u.unit, &keep);
      }
      SummonOptions read_only;
      read_only.writeback = false;
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = rank.client->Summon("", "", read_only);
      ASSERT_TRUE(s.ok()) << s.status();
      rank.stream->set_delay(absl::ZeroDuration());
      // Tied FQNs alias the first FQN's view (its unit holds the values).
      std::map<const void*, int32_t> unit_at;
      for (const ParamView& v : (*s)->params()) unit_at.emplace(v.data, v.unit);
      for (const ParamView& v : (*s)->params()) {
        ASSERT_GE(v.device, 0) << v.fqn;
        const std::vector<float> got = ReadThrough(*rank.stream, v.data, v.numel);
        const float want = 10.0f + step + unit_at.at(v.data);
        for (int64_t i = 0; i < v.numel; ++i) {
          ASSERT_EQ(got[i], want) << "rank " << r << " step " << step << " " << v.fqn << "[" << i
                                  << "]";
        }
      }
      ASSERT_TRUE((*s)->End().ok());
      ASSERT_TRUE(rank.stream->Synchronize(absl::Minutes(1)).ok());
    });
  }
};

TEST_P(DeviceOrderingTest, SummonReadsTheWritesStillQueuedOnTheTrainersStream) {
  Cluster d(Layout::kSingle, Options());
  std::vector<Rank> ranks = JoinAndInit(d, "order");
  for (int step = 0; step < 2; ++step) StepThenSummon(ranks, step);
  for (Rank& r : ranks) ASSERT_TRUE(r.client->Leave().ok());
}

INSTANTIATE_TEST_SUITE_P(OrderingAndWorld, DeviceOrderingTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<std::tuple<bool, int>>& info) {
                           return absl::StrCat(
                               std::get<0>(info.param) ? "DeviceOrdered" : "HostWait", "World",
                               std::get<1>(info.param));
                         });

}  // namespace
}  // namespace flatshard::client
