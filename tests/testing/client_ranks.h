#pragma once
// Trainers of the integration tests as threads of the test, each rank with a Client of its own
// daemon: connect, join every rank of a group at once, register a module on every rank, write
// and check every element of it. A test passes what is particular to it (deadlines, retries,
// group, token, where each rank connects) and keeps only its own checks.
// Thread safety: each function runs the ranks on threads of its own (RunRanks) and returns
// when all are done; call them from the test thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"

namespace flatshard::testing {

// How a test trainer's Client is made.
struct ConnectOptions {
  ConnectOptions() = default;
  ConnectOptions(absl::Duration call, absl::Duration join,
                 int attempts = client::ClientOptions().max_attempts,
                 client::internal::GpuApis (*apis)() = nullptr)
      : call_timeout(call), join_timeout(join), max_attempts(attempts), gpu_apis(apis) {}

  absl::Duration call_timeout = absl::Seconds(10);
  absl::Duration join_timeout = absl::Seconds(10);
  // Attempts per call; 1 where a test looks at each call's own outcome (no retry).
  int max_attempts = client::ClientOptions().max_attempts;
  // Stand-ins for the CUDA APIs (SimulatedGpuApis for flatshardd --simulate_gpus,
  // tests/testing/simulated_gpu.h); nullptr: the real ones.
  client::internal::GpuApis (*gpu_apis)() = nullptr;
};

// A Client of the daemon at `address`; nullptr, and a failed EXPECT, if Connect failed.
inline std::unique_ptr<client::Client> ConnectClient(const std::string& address,
                                                     const ConnectOptions& o = {}) {
  client::ClientOptions options;
  options.address = address;
  options.call_timeout = o.call_timeout;
  options.join_timeout = o.join_timeout;
  options.max_attempts = o.max_attempts;
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      o.gpu_apis == nullptr ? client::Client::Connect(options)
                            : client::internal::ConnectWithGpuApis(options, o.gpu_apis());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// One rank: its Client and its registration of the module.
struct Rank {
  std::unique_ptr<::flatshard::client::Client> client;
  ::flatshard::client::RegisteredModule model;
};

// Where and how the ranks of a group join.
struct GroupOptions {
  std::string group = "g";
  std::string token;
  // The coordinator's peer address every rank names; "": all ranks join one daemon.
  std::string coordinator;
  // Rank r's Client, of its daemon (ConnectClient), for a rank that has none.
  std::function<std::unique_ptr<client::Client>(int rank)> connect;
};

// Every rank on its daemon of `c` (Cluster::AddressFor), naming c's coordinator.
inline GroupOptions OnCluster(const Cluster& c, std::string group, std::string token,
                              ConnectOptions connect = {}) {
  GroupOptions g;
  g.group = std::move(group);
  g.token = std::move(token);
  g.coordinator = c.coordinator();
  g.connect = [&c, connect](int r) { return ConnectClient(c.AddressFor(r), connect); };
  return g;
}

// Joins every rank of `ranks` (world: its size) at once; a rank without a Client connects
// first. A failed connect or join fails the test, naming the rank.
inline void JoinRanks(std::vector<Rank>& ranks, const GroupOptions& g) {
  const int world = static_cast<int>(ranks.size());
  RunRanks(world, [&](int r) {
    if (ranks[r].client == nullptr && g.connect) ranks[r].client = g.connect(r);
    ASSERT_NE(ranks[r].client, nullptr) << "rank " << r;
    absl::Status joined = ranks[r].client->Join(g.group, world, r, g.token, g.coordinator);
    ASSERT_TRUE(joined.ok()) << "rank " << r << ": " << joined;
  });
}
inline std::vector<Rank> JoinRanks(int world, const GroupOptions& g) {
  std::vector<Rank> ranks(world);
  JoinRanks(ranks, g);
  return ranks;
}

// The ranks' Clients alone (for tests that keep no registration).
inline std::vector<std::unique_ptr<client::Client>> ClientsOf(std::vector<Rank> ranks) {
  std::vector<std::unique_ptr<client::Client>> clients;
  for (Rank& r : ranks) clients.push_back(std::move(r.client));
  return clients;
}

// The survivors (ranks that still have a Client) leave, before any rank joins again (README
// "Groups over several daemons": a survivor's leave after the replacement joined fails the
// re-formed group once more, and the replacement's join may then complete at a table the
// survivors never reported to). OK, or the code of the first failed Leave and every failed
// one, each naming its rank.
inline absl::Status LeaveSurvivors(std::vector<Rank>& ranks) {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string failed;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].client == nullptr) continue;
    const absl::Status left = ranks[r].client->Leave();
    if (left.ok()) continue;
    if (code == absl::StatusCode::kOk) code = left.code();
    absl::StrAppend(&failed, failed.empty() ? "" : "; ", "rank ", r, " Leave: ", left.ToString());
  }
  return absl::Status(code, failed);
}

// After a re-join: no rank has a module registered and each has its one module lost, for a
// reason that names each of `why`. A fatal failure where a rank lost another number.
inline void ExpectEveryRankLostItsModule(const std::vector<Rank>& ranks,
                                         const std::vector<std::string>& why) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_THAT(ranks[r].client->registered_modules(), ::testing::IsEmpty());
    ASSERT_THAT(ranks[r].client->lost_modules(), ::testing::SizeIs(1));
    for (const std::string& w : why) {
      EXPECT_THAT(ranks[r].client->lost_modules()[0], ::testing::HasSubstr(w));
    }
  }
}

// Registers `manifest` under `policy` (zeros) as module "" on every rank at once.
// `generation`: what every registration must report (a re-attach), when given.
inline void RegisterRanks(std::vector<Rank>& ranks, const std::string& manifest,
                          const std::string& policy,
                          std::optional<uint64_t> generation = std::nullopt) {
  RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    ASSERT_NE(ranks[r].client, nullptr) << "rank " << r;
    absl::StatusOr<client::RegisteredModule> m =
        ranks[r].client->Register("", manifest, policy, client::InitMode::kZeros);
    ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
    if (generation.has_value()) {
      EXPECT_EQ(m->generation, *generation) << "rank " << r;
    }
    ranks[r].model = *std::move(m);
  });
}
// The same with examples/models/<model>.
inline void RegisterExample(std::vector<Rank>& ranks, const std::string& model = "gpt_tied",
                            std::optional<uint64_t> generation = std::nullopt) {
  RegisterRanks(ranks, ExampleModelFile(model, "manifest"), ExampleModelFile(model, "policy"),
                generation);
}

// Element i of parameter `fqn` (float32 models).
using ParamValue = std::function<float(const std::string& fqn, int64_t i)>;

// Every rank writes value() into every element of a writeback summon of module "" and ends it.
inline void WriteParams(std::vector<Rank>& ranks, const ParamValue& value) {
  RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> s =
        ranks[r].client->Summon("", "", client::SummonOptions());
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const PlanUnit& u : ranks[r].model.plan->units) {
      for (const PlanParam& p : u.params) {
        const client::ParamView* v = (*s)->Find(p.fqn);
        ASSERT_NE(v, nullptr) << "rank " << r << " " << p.fqn;
        float* data = static_cast<float*>(v->data);
        for (int64_t i = 0; i < p.numel; ++i) data[i] = value(p.fqn, i);
      }
    }
    absl::Status ended = (*s)->End();
    ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
  });
}

// Every rank summons module "" read-only and finds value() in every element.
inline void ExpectParams(std::vector<Rank>& ranks, const ParamValue& value) {
  RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    client::SummonOptions read;
    read.writeback = false;
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> s =
        ranks[r].client->Summon("", "", read);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const PlanUnit& u : ranks[r].model.plan->units) {
      for (const PlanParam& p : u.params) {
        const client::ParamView* v = (*s)->Find(p.fqn);
        ASSERT_NE(v, nullptr) << "rank " << r << " " << p.fqn;
        const float* data = static_cast<const float*>(v->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(data[i], value(p.fqn, i)) << "rank " << r << " " << p.fqn << "[" << i << "]";
        }
      }
    }
    absl::Status ended = (*s)->End();
    ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
  });
}

}  // namespace flatshard::testing
