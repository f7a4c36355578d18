#pragma once
// What the C++ client's end-to-end tests against real flatshardd processes
// (client_e2e_test.cc, client_overlap_test.cc) share: their token and deadlines, and every
// rank of a group joined with an example model registered (tests/testing/client_ranks.h).

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "flatshard/client.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"

namespace flatshard::client::e2e {

using ::flatshard::testing::Rank;

inline constexpr char kToken[] = "t0k";

inline std::unique_ptr<Client> Connect(const std::string& address) {
  return ::flatshard::testing::ConnectClient(address);  // 10 s deadlines, retries
}

// Connects `world` clients, joins them to `group` and registers examples/models/<model>
// (zeros) on every rank.
inline std::vector<Rank> JoinAndRegister(const ::flatshard::testing::Cluster& d,
                                         const std::string& group, int world,
                                         const std::string& model = "gpt_tied") {
  std::vector<Rank> ranks =
      ::flatshard::testing::JoinRanks(world, ::flatshard::testing::OnCluster(d, group, kToken));
  ::flatshard::testing::RegisterExample(ranks, model);
  return ranks;
}

inline SummonOptions ReadOnly(bool with_grads = false) {
  SummonOptions o;
  o.writeback = false;
  o.with_grads = with_grads;
  return o;
}

}  // namespace flatshard::client::e2e
