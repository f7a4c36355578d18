// Client::AllReduce and Client::Broadcast (README "Group collectives") against real flatshardd
// processes: one daemon for 3 ranks, and two daemons (ranks 0 and 2 on daemon 0, rank 1 on
// daemon 1, over the transport).
//   - every rank gets the same reduction, bit for bit, equal to the rank-order reduction;
//   - sum, max and min, float32 and float64; broadcast from any root, zero bytes too;
//   - a rank passing another size, dtype or root fails every rank naming it, and the group
//     works on afterwards; a rank that does not call is named at the deadline.

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::ClientsOf;
using ::flatshard::testing::Cluster;
using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::JoinRanks;
using ::flatshard::testing::Layout;
using ::flatshard::testing::OnCluster;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

constexpr int kWorld = 3;
constexpr char kToken[] = "c0ll";

class GroupCollectivesTest : public ::testing::TestWithParam<Layout> {
 protected:
  // Every rank's client joined to group `group`.
  std::vector<std::unique_ptr<Client>> Joined(const std::string& group,
                                              absl::Duration timeout = absl::Seconds(10)) {
    ::flatshard::testing::ClusterOptions o;
    o.tag_prefix = "fsgc";
    cluster_ = std::make_unique<Cluster>(GetParam(), o);
    return ClientsOf(
        JoinRanks(kWorld, OnCluster(*cluster_, group, kToken, {timeout, absl::Seconds(10)})));
  }

  std::unique_ptr<Cluster> cluster_;
};

// Values whose float sums depend on the order: the result must be the rank-order one.
std::vector<float> FloatsOf(int rank) {
  return {1e8f * (rank == 0 ? 1 : -1), 0.1f * (rank + 1), -3.5f + rank, rank == 1 ? 7.f : -7.f};
}

TEST_P(GroupCollectivesTest, AllReduceGivesEveryRankTheRankOrderReduction) {
  std::vector<std::unique_ptr<Client>> c = Joined("allreduce");
  for (ValuesReduceOp op : {ValuesReduceOp::kSum, ValuesReduceOp::kMax, ValuesReduceOp::kMin}) {
    std::vector<float> want = FloatsOf(0);
    for (int r = 1; r < kWorld; ++r) {
      const std::vector<float> v = FloatsOf(r);
      for (size_t i = 0; i < want.size(); ++i) {
        want[i] = op == ValuesReduceOp::kSum   ? want[i] + v[i]
                  : op == ValuesReduceOp::kMax ? std::max(want[i], v[i])
                                               : std::min(want[i], v[i]);
      }
    }
    std::vector<std::vector<float>> got(kWorld);
    RunRanks(kWorld, [&](int r) {
      got[r] = FloatsOf(r);
      absl::Status s = c[r]->AllReduce(got[r].data(), got[r].size(), op);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
    });
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(std::memcmp(got[r].data(), want.data(), want.size() * sizeof(float)), 0)
          << "rank " << r << " op " << static_cast<int>(op);
    }
  }
  // float64, and no values at all.
  std::vector<std::vector<double>> d(kWorld);
  RunRanks(kWorld, [&](int r) {
    d[r] = {0.1 * r, 1.0 / (r + 1)};
    ASSERT_TRUE(c[r]->AllReduce(d[r].data(), d[r].size()).ok());
    ASSERT_TRUE(c[r]->AllReduce(static_cast<double*>(nullptr), 0).ok());
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(d[r][0], (0.0 + 0.1) + 0.2);
    EXPECT_EQ(d[r][1], (1.0 + 0.5) + 1.0 / 3);
  }
}

TEST_P(GroupCollectivesTest, BroadcastGivesEveryRankTheRootsBytes) {
  std::vector<std::unique_ptr<Client>> c = Joined("broadcast");
  for (int root = 0; root < kWorld; ++root) {
    std::vector<std::string> got(kWorld);
    RunRanks(kWorld, [&](int r) {
      got[r] = std::string(100000, static_cast<char>('a' + r));
      got[r][7] = '\0';
      absl::Status s = c[r]->Broadcast(got[r].data(), got[r].size(), root);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      ASSERT_TRUE(c[r]->Broadcast(nullptr, 0, root).ok());
    });
    std::string want(100000, static_cast<char>('a' + root));
    want[7] = '\0';
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(got[r], want) << "rank " << r;
  }
}

TEST_P(GroupCollectivesTest, DifferingInputFailsEveryRankNamingItAndTheGroupGoesOn) {
  std::vector<std::unique_ptr<Client>> c = Joined("mismatch");
  std::vector<absl::Status> status(kWorld);
  RunRanks(kWorld, [&](int r) {
    std::vector<float> v(r == 2 ? 3 : 2, 1.0f);
    status[r] = c[r]->AllReduce(v.data(), v.size());
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument) << status[r];
    EXPECT_THAT(status[r].message(), HasSubstr("AllReduce: rank 2 passed 12 bytes, rank 0 8"));
  }
  RunRanks(kWorld, [&](int r) {
    double v = 1;
    status[r] = r == 1 ? c[r]->AllReduce(&v, 1) : [&] {
      float f = 1;
      return c[r]->AllReduce(&f, 1);
    }();
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_THAT(status[r].message(), HasSubstr("rank 1 passed"));
  RunRanks(kWorld, [&](int r) {
    char b = 0;
    status[r] = c[r]->Broadcast(&b, 1, r == 0 ? 5 : 0);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument) << status[r];
    EXPECT_THAT(status[r].message(), HasSubstr("rank 0 root 5 is out of range [0, 3)"));
  }
  RunRanks(kWorld, [&](int r) {
    float f = 1;
    status[r] = r == 2 ? c[r]->Broadcast(&f, sizeof(f), 0) : c[r]->AllReduce(&f, 1);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(status[r].message(), HasSubstr("rank 2 called Broadcast, rank 0 AllReduce"));
  }
  // Nothing broke: the next collective works on every rank.
  std::vector<float> sum(kWorld);
  RunRanks(kWorld, [&](int r) {
    sum[r] = static_cast<float>(r);
    status[r] = c[r]->AllReduce(&sum[r], 1);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(sum[r], 3.0f);
  }
}

TEST_P(GroupCollectivesTest, ARankThatDoesNotCallIsNamedAtTheDeadline) {
  std::vector<std::unique_ptr<Client>> c = Joined("late", absl::Seconds(2));
  std::vector<absl::Status> status(kWorld);
  RunRanks(kWorld - 1, [&](int r) {
    float f = 1;
    status[r] = c[r]->AllReduce(&f, 1);
  });
  for (int r = 0; r < kWorld - 1; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kDeadlineExceeded) << status[r];
    EXPECT_THAT(status[r].message(), HasSubstr("rank 2"));
  }
  // Not joined: refused at once.
  std::unique_ptr<Client> lone =
      ConnectClient(cluster_->AddressFor(0), {absl::Seconds(2), absl::Seconds(10)});
  float f = 1;
  EXPECT_EQ(lone->AllReduce(&f, 1).code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Layouts, GroupCollectivesTest,
                         ::testing::Values(Layout::kSingle, Layout::kTwoDaemons),
                         ::flatshard::testing::LayoutParamName());

}  // namespace
}  // namespace flatshard::client
