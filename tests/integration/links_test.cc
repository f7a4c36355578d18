// A group across emulated nodes (issue 27, README "Multi-node links"): two flatshardd, each in
// its own network namespace joined to the other by a shaped veth link
// (tests/testing/emulated_links.h: 1 Gbit/s per direction, 50 us one-way where the kernel has
// netem), their PeerService and UCX bound to the link's addresses only (UCX_NET_DEVICES=fsl0,
// UCX_TLS=tcp: shared memory would bypass the link). The trainers are threads of this test
// talking to their own rank's daemon over its Unix socket. The group forms across the
// namespaces, trains a few steps of the example GPT (summon, reduce-scatter of gradients,
// optimizer writes, commit), survives a SIGKILL of daemon 1 (restart with its --state_dir,
// re-join, re-attach) and every value is checked exactly. Skips, naming why, where namespaces
// cannot be made (not root, no iproute2).

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/emulated_links.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::ConnectClient;
using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::EmulatedLinks;
using ::flatshard::testing::GroupOptions;
using ::flatshard::testing::JoinRanks;
using ::flatshard::testing::LeaveSurvivors;
using ::flatshard::testing::LinkOptions;
using ::flatshard::testing::Rank;
using ::flatshard::testing::RegisterExample;
using ::flatshard::testing::RunRanks;
using ::testing::IsEmpty;
using ::testing::SizeIs;
using ::testing::StartsWith;

constexpr char kToken[] = "links-t0k";
constexpr int kWorld = 2;

// Parameter element k (of the unsharded flat buffer) of unit u after step g: exact in float32.
float Param(uint64_t g, int32_t u, int64_t k) {
  return g == 0 ? 0.0f : static_cast<float>(g * 10000 + u * 1000 + k % 997);
}
// Every rank's gradient in step g is g + rank: their sum, g + (g + 1), is what a reduce-scatter
// leaves in every gradient shard.
float GradSum(uint64_t g) { return static_cast<float>(2 * g + 1); }

class LinksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LinkOptions o;
    o.nodes = 2;
    o.rate = "1gbit";
    o.delay = "50us";
    absl::StatusOr<std::unique_ptr<EmulatedLinks>> links = EmulatedLinks::Create(o);
    if (!links.ok()) GTEST_SKIP() << "no emulated nodes here: " << links.status().message();
    links_ = *std::move(links);
    std::printf("links: %s\n", links_->Describe().c_str());
    for (int i = 0; i < kWorld; ++i) {
      dirs_.push_back(std::filesystem::temp_directory_path() /
                      absl::StrCat("fslinks-state.", getpid(), ".", i));
      DaemonOptions d;
      d.tag_prefix = "fslnk";
      d.peer = true;
      d.node_name = absl::StrCat("node", i);
      d.netns = links_->ns(i);
      d.peer_host = EmulatedLinks::address(i);
      d.env = {absl::StrCat("UCX_NET_DEVICES=", EmulatedLinks::kInterface), "UCX_TLS=tcp"};
      // No TLS: the link exists only between this test's private namespaces.
      d.extra_flags = {"--state_dir=" + dirs_.back().string(), "--peer_timeout=3s",
                       "--allow_insecure_tcp"};
      daemons_.push_back(std::make_unique<DaemonProcess>(d));
    }
  }
  void TearDown() override {
    daemons_.clear();  // before the namespaces go
    links_.reset();
    std::error_code ignored;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ignored);
  }

  // Every rank (re-)joins through its own daemon (no retries), naming daemon 0 as the
  // coordinator; survivors leave first.
  void JoinAll(std::vector<Rank>& ranks) {
    ranks.resize(kWorld);
    (void)LeaveSurvivors(ranks);
    GroupOptions g;
    g.token = kToken;
    g.coordinator = daemons_[0]->peer_address();
    g.connect = [&](int r) {
      return ConnectClient(daemons_[r]->address(), {absl::Seconds(30), absl::Seconds(30), 1});
    };
    JoinRanks(ranks, g);
  }
  // This rank's shards hold step g's parameters and the gradient sums of step `grad_step`
  // (0: no gradient yet), element for element.
  static void ExpectShards(Client& c, int rank, uint64_t g, uint64_t grad_step) {
    absl::StatusOr<ShardViews> views = c.GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    EXPECT_EQ(views->generation(), g) << "rank " << rank;
    for (const UnitShardView& u : *views) {
      const float* data = static_cast<const float*>(u.data);
      const float* grad = static_cast<const float*>(u.grad);
      int64_t bad = 0, bad_grad = 0;
      for (int64_t i = 0; i < u.shard_numel; ++i) {
        bad += data[i] != Param(g, u.unit, u.shard_offset + i);
        if (grad_step > 0 && grad != nullptr) bad_grad += grad[i] != GradSum(grad_step);
      }
      EXPECT_EQ(bad, 0) << "rank " << rank << " unit " << u.unit << ": parameters differ";
      if (grad_step > 0) {
        ASSERT_NE(grad, nullptr) << "rank " << rank << " unit " << u.unit << ": no gradient";
        EXPECT_EQ(bad_grad, 0) << "rank " << rank << " unit " << u.unit << ": gradient differs";
      }
    }
  }
  // Steps from..to of a training loop: a full summon (all-gather across the link) whose every
  // element is checked, a gradient for every unit (reduce-scatter across the link), the
  // optimizer's in-place update, a commit.
  void Train(std::vector<Rank>& ranks, uint64_t from, uint64_t to) {
    for (uint64_t g = from; g <= to; ++g) {
      RunRanks(kWorld, [&](int r) {
        Client& c = *ranks[r].client;
        SummonOptions read;
        read.writeback = false;
        absl::StatusOr<std::unique_ptr<SummonedParams>> s = c.Summon("", "", read);
        ASSERT_TRUE(s.ok()) << "rank " << r << " step " << g << ": " << s.status();
        int64_t checked = 0, bad = 0;
        for (const PlanUnit& u : ranks[r].model.plan->units) {
          for (const PlanParam& p : u.params) {
            const ParamView* v = (*s)->Find(p.fqn);
            ASSERT_NE(v, nullptr) << p.fqn;
            const float* x = static_cast<const float*>(v->data);
            for (int64_t j = 0; j < p.numel; ++j, ++checked) {
              bad += x[j] != Param(g - 1, u.index, p.offset + j);
            }
          }
        }
        EXPECT_GT(checked, 0);
        EXPECT_EQ(bad, 0) << "rank " << r << " step " << g << ": summoned values differ";
        ASSERT_TRUE((*s)->End().ok());
        for (const PlanUnit& u : ranks[r].model.plan->units) {
          absl::Status rs = c.ReduceScatterGrads("", u.index, ReduceOp::kSum, false,
                                                 [&](PendingReduceScatter& p) {
                                                   float* data = static_cast<float*>(p.data());
                                                   for (int64_t i = 0; i < p.numel(); ++i)
                                                     data[i] = static_cast<float>(g + r);
                                                   return absl::OkStatus();
                                                 });
          ASSERT_TRUE(rs.ok()) << "rank " << r << " unit " << u.index << ": " << rs;
        }
        absl::StatusOr<ShardViews> views = c.GetShardViews("");
        ASSERT_TRUE(views.ok()) << views.status();
        for (const UnitShardView& u : *views) {
          float* data = static_cast<float*>(u.data);
          for (int64_t i = 0; i < u.shard_numel; ++i) {
            data[i] = Param(g, u.unit, u.shard_offset + i);
          }
        }
        absl::StatusOr<uint64_t> committed = c.Commit("");
        ASSERT_TRUE(committed.ok()) << "rank " << r << ": " << committed.status();
        EXPECT_EQ(*committed, g);
      });
    }
  }

  std::unique_ptr<EmulatedLinks> links_;
  std::vector<std::filesystem::path> dirs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
};

TEST_F(LinksTest, GroupAcrossNamespacesTrainsAndSurvivesADaemonKill) {
  for (int i = 0; i < kWorld; ++i) {
    ASSERT_TRUE(daemons_[i]->running()) << "daemon " << i;
    // Bound to the link's address, not loopback: the peers can only meet over the link.
    EXPECT_THAT(daemons_[i]->peer_address(), StartsWith(EmulatedLinks::address(i) + ":"));
  }
  std::vector<Rank> ranks;
  JoinAll(ranks);
  RegisterExample(ranks, "gpt_tied", 0);
  Train(ranks, 1, 3);
  for (int r = 0; r < kWorld; ++r) ExpectShards(*ranks[r].client, r, 3, 3);

  // Daemon 1 (not the coordinator) crashes; it comes back in its namespace with its state.
  daemons_[1]->Kill();
  ranks[1] = Rank();
  const size_t log_before = daemons_[1]->Log().size();
  ASSERT_TRUE(daemons_[1]->Restart());
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (daemons_[1]->Log().find("restart: adopted", log_before) == std::string::npos &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_NE(daemons_[1]->Log().find("restart: adopted", log_before), std::string::npos);
  EXPECT_THAT(daemons_[1]->peer_address(), StartsWith(EmulatedLinks::address(1) + ":"));

  JoinAll(ranks);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(ranks[r].client->lost_modules(), IsEmpty()) << "rank " << r;
    EXPECT_THAT(ranks[r].client->registered_modules(), SizeIs(1)) << "rank " << r;
  }
  RegisterExample(ranks, "gpt_tied", 3);  // re-attach at the last commit on both daemons
  for (int r = 0; r < kWorld; ++r) ExpectShards(*ranks[r].client, r, 3, 3);
  Train(ranks, 4, 5);  // the group works across the link again
  for (int r = 0; r < kWorld; ++r) ExpectShards(*ranks[r].client, r, 5, 5);
}

}  // namespace
}  // namespace flatshard::client
