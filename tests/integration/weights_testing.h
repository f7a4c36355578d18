#pragma once
// Helpers of the published-weights integration tests (weights_test, weights_device_test): a
// group of trainers on one daemon with the gpt_tied model, a step pattern written into the
// live shards, and the element-for-element check of a version against a step.
// Test-only; each test binary includes it once.

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "common/checkpoint/checkpoint.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/integration/weights_pattern.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client::weights_testing {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::RunRanks;

inline constexpr char kToken[] = "w31ghts";

inline ClientOptions Options(const std::string& address) {
  ClientOptions o;
  o.address = address;
  o.call_timeout = absl::Seconds(10);
  o.join_timeout = absl::Seconds(10);
  return o;
}

// `simulated_gpus`: against flatshardd --simulate_gpus (device shards over host shm).
inline std::unique_ptr<Client> Connect(const std::string& address, bool simulated_gpus = false) {
  absl::StatusOr<std::unique_ptr<Client>> c =
      simulated_gpus
          ? internal::ConnectWithGpuApis(Options(address), ::flatshard::testing::SimulatedGpuApis())
          : Client::Connect(Options(address));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

inline std::unique_ptr<WeightsReader> Reader(const std::string& address) {
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = WeightsReader::Connect(Options(address));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

// A group of `world` ranks on one daemon with the gpt_tied model registered.
struct Trainers {
  std::vector<std::unique_ptr<Client>> c;
  std::shared_ptr<const Plan> plan;
  std::string manifest = ExampleModelFile("gpt_tied", "manifest");

  Trainers(const Cluster& d, int world, const std::string& group, bool simulated_gpus = false)
      : c(world) {
    RunRanks(world, [&](int r) {
      c[r] = Connect(d.AddressFor(r), simulated_gpus);
      ASSERT_NE(c[r], nullptr);
      ASSERT_TRUE(c[r]->Join(group, world, r, kToken, d.coordinator()).ok());
      absl::StatusOr<RegisteredModule> m =
          c[r]->Register("", manifest, ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
      ASSERT_TRUE(m.ok()) << m.status();
      if (r == 0) {
        plan = m->plan;
      }
    });
  }
  // Every rank writes step `s` into its live shards; commits when `commit`.
  void Step(int s, bool commit) {
    RunRanks(static_cast<int>(c.size()), [&](int r) {
      absl::StatusOr<ShardViews> v = c[r]->GetShardViews("");
      ASSERT_TRUE(v.ok()) << v.status();
      FillShards(*v, s);
      if (commit) {
        ASSERT_TRUE(c[r]->Commit("").ok());
      }
    });
  }
  std::vector<absl::StatusOr<PublishedVersion>> Publish(const std::string& name,
                                                        const PublishOptions& o = {}) {
    std::vector<absl::StatusOr<PublishedVersion>> out(c.size(), absl::UnknownError("unset"));
    RunRanks(static_cast<int>(c.size()), [&](int r) { out[r] = c[r]->Publish("", name, o); });
    return out;
  }
};

// Every parameter of `v` holds Pattern(.., step) (cast to bfloat16 when `bf16`); tied keys
// alias their parameter's bytes.
inline void ExpectHolds(const Plan& plan, const std::string& manifest_json, const WeightsVersion& v,
                        int step, bool bf16 = false) {
  size_t params = 0;
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      ++params;
      const WeightsTensor* t = v.Find(p.fqn);
      ASSERT_NE(t, nullptr) << p.fqn;
      EXPECT_EQ(t->shape, p.shape) << p.fqn;
      EXPECT_EQ(t->dtype, bf16 ? DType::kBFloat16 : DType::kFloat32) << p.fqn;
      ASSERT_EQ(t->bytes, p.numel * (bf16 ? 2 : 4)) << p.fqn;
      for (int64_t j = 0; j < p.numel; ++j) {
        const float want = Pattern(u.index, p.offset + j, step);
        if (bf16) {
          uint32_t bits = 0;
          std::memcpy(&bits, &want, 4);
          const uint16_t got = static_cast<const uint16_t*>(t->data)[j];
          ASSERT_EQ(got, static_cast<uint16_t>(bits >> 16)) << p.fqn << "[" << j << "]";
        } else {
          ASSERT_EQ(static_cast<const float*>(t->data)[j], want) << p.fqn << "[" << j << "]";
        }
      }
    }
  }
  absl::StatusOr<Manifest> manifest = ManifestFromJson(manifest_json);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  std::vector<SharedParam> tied = checkpoint::TiedAliases(*manifest, plan);
  for (const PlanUnit& u : plan.units) tied.insert(tied.end(), u.shared.begin(), u.shared.end());
  ASSERT_FALSE(tied.empty()) << "gpt_tied has tied parameters";
  for (const SharedParam& s : tied) {
    const WeightsTensor* a = v.Find(s.fqn);
    const WeightsTensor* b = v.Find(s.same_as);
    ASSERT_NE(a, nullptr) << s.fqn;
    ASSERT_NE(b, nullptr) << s.same_as;
    EXPECT_EQ(a->data, b->data) << s.fqn << " must alias " << s.same_as;
  }
  EXPECT_EQ(v.tensors().size(), params + tied.size());
}

inline OpenWeightsOptions At(uint64_t version) {
  OpenWeightsOptions o;
  o.version = version;
  return o;
}

inline std::vector<uint64_t> Versions(WeightsReader& r, const std::string& name) {
  std::vector<uint64_t> out;
  absl::StatusOr<std::vector<PublishedVersion>> l = r.List();
  EXPECT_TRUE(l.ok()) << l.status();
  if (!l.ok()) return out;
  for (const PublishedVersion& v : *l) {
    if (v.name == name) out.push_back(v.version);
  }
  return out;
}

}  // namespace flatshard::client::weights_testing
