#pragma once
// Helpers of the C++ client's end-to-end tests against real flatshardd processes
// (client_e2e_test.cc, client_overlap_test.cc): connect a Client, join every rank of a group
// and register an example model on each.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client::e2e {

inline constexpr char kToken[] = "t0k";

inline std::unique_ptr<Client> Connect(const std::string& address) {
  ClientOptions options;
  options.address = address;
  options.call_timeout = absl::Seconds(10);
  options.join_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// One rank: its Client and its registration of the whole model (module "").
struct Rank {
  std::unique_ptr<Client> client;
  RegisteredModule model;
};

// Connects `world` clients, joins them to `group` and registers examples/models/<model>
// (zeros) on every rank.
inline std::vector<Rank> JoinAndRegister(const ::flatshard::testing::Cluster& d,
                                         const std::string& group, int world,
                                         const std::string& model = "gpt_tied") {
  std::vector<Rank> ranks(world);
  const std::string manifest = ::flatshard::testing::ExampleModelFile(model, "manifest");
  const std::string policy = ::flatshard::testing::ExampleModelFile(model, "policy");
  ::flatshard::testing::RunRanks(world, [&](int r) {
    ranks[r].client = Connect(d.AddressFor(r));
    ASSERT_NE(ranks[r].client, nullptr);
    absl::Status joined = ranks[r].client->Join(group, world, r, kToken, d.coordinator());
    ASSERT_TRUE(joined.ok()) << joined;
    absl::StatusOr<RegisteredModule> registered =
        ranks[r].client->Register("", manifest, policy, InitMode::kZeros);
    ASSERT_TRUE(registered.ok()) << registered.status();
    ranks[r].model = *std::move(registered);
  });
  return ranks;
}

inline SummonOptions ReadOnly(bool with_grads = false) {
  SummonOptions o;
  o.writeback = false;
  o.with_grads = with_grads;
  return o;
}

}  // namespace flatshard::client::e2e
