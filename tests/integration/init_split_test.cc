// An init End whose local ranks split (README "Restarts", server/module/init_undo.cc): real
// flatshardd processes; every rank registers the example GPT model kFromRank0 and ends its init
// summon, and on one daemon one local rank's End fails although every rank agreed
// (--testing_init_end_fails: its agreement's all-gather fails on it alone, as when a peer
// daemon dies mid-collective and tears it). The daemon decides the initialisation once for all
// its local ranks: no local rank's End is OK there and no rank of it sees the module as usable
// (a never-initialised shard holds zeros, not the model). With two daemons (2 ranks each) the
// other daemon's ranks were answered "initialised"; after the group re-forms the
// initialisation is undone on every daemon. Then every rank's Register runs it again, every
// rank holds the initial values to the element, and the group trains on. Without and with a
// state directory (the End's copies batched with records).

#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/restart_testing.h"
#include "tests/testing/cluster.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: Connect, Rank, Value, WriteShards, LogCount
using ::flatshard::testing::Cluster;
using ::flatshard::testing::ClusterOptions;
using ::flatshard::testing::Layout;

// Every parameter element of the initial values rank 0 gives (never zero).
float InitValue(int64_t i) { return static_cast<float>(7 + i % 991); }

// (layout, with a state directory)
class InitSplitTest : public ::testing::TestWithParam<std::tuple<Layout, bool>> {
 protected:
  Layout layout() const { return std::get<0>(GetParam()); }
  bool durable() const { return std::get<1>(GetParam()); }
  bool multi() const { return layout() != Layout::kSingle; }
  // Two ranks per daemon: rank r on daemon r % daemons.
  int world() const { return multi() ? 4 : 2; }
  // The rank whose init End fails, on daemon 0 (with rank 0, whose End applies).
  int failing() const { return multi() ? 2 : 1; }

  void SetUp() override {
    ClusterOptions o;
    o.tag_prefix = "fsinitsplit";
    o.extra_flags = {"--peer_timeout=2s"};
    const int daemons = multi() ? 2 : 1;
    o.daemon_flags.resize(daemons);
    for (int i = 0; i < daemons; ++i) {
      if (durable()) {
        dirs_.push_back(std::filesystem::temp_directory_path() /
                        absl::StrCat("fsinitsplit-state.", getpid(), ".", counter_++));
        o.daemon_flags[i].push_back("--state_dir=" + dirs_.back().string());
      }
    }
    o.daemon_flags[0].push_back(absl::StrCat("--testing_init_end_fails=", failing()));
    cluster_ = std::make_unique<Cluster>(layout(), o);
  }
  void TearDown() override {
    ranks_.clear();
    cluster_.reset();
    std::error_code ignored;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ignored);
  }

  // Every rank (re-)joins; every rank leaves first when it had joined (the group re-forms).
  void JoinAll() {
    ranks_.resize(world());
    for (Rank& rank : ranks_) {
      if (rank.client != nullptr) (void)rank.client->Leave();
    }
    RunRanks(world(), [&](int r) {
      if (ranks_[r].client == nullptr) ranks_[r].client = Connect(cluster_->AddressFor(r));
      ASSERT_NE(ranks_[r].client, nullptr);
      absl::Status joined =
          ranks_[r].client->Join("g", world(), r, kToken, cluster_->coordinator());
      ASSERT_TRUE(joined.ok()) << "rank " << r << ": " << joined;
    });
  }
  // Every rank registers kFromRank0 (rank 0 fills its init summon) and ends its init summon;
  // each End's status.
  std::vector<absl::Status> RegisterAndEnd() {
    std::vector<absl::Status> ended(world(), absl::UnknownError("unset"));
    RunRanks(world(), [&](int r) {
      absl::StatusOr<RegisteredModule> m =
          ranks_[r].client->Register("", ExampleModelFile("gpt_tied", "manifest"),
                                     ExampleModelFile("gpt_tied", "policy"), InitMode::kFromRank0);
      ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
      ASSERT_NE(m->init_summon, nullptr) << "rank " << r;
      if (r == 0) {
        for (const PlanUnit& u : m->plan->units) {
          for (const PlanParam& p : u.params) {
            float* data = static_cast<float*>(m->init_summon->Find(p.fqn)->data);
            for (int64_t i = 0; i < p.numel; ++i) data[i] = InitValue(i);
          }
        }
      }
      ended[r] = m->init_summon->End();
      ranks_[r].model = *std::move(m);
    });
    return ended;
  }

  std::unique_ptr<Cluster> cluster_;
  std::vector<std::filesystem::path> dirs_;
  std::vector<Rank> ranks_;
  static inline int counter_ = 0;
};

TEST_P(InitSplitTest, NoRankOfTheDaemonSeesTheModuleInitialisedAndRegisteringAgainWorks) {
  JoinAll();
  std::vector<absl::Status> ended = RegisterAndEnd();
  for (int r = 0; r < world(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    if (r == failing()) {
      EXPECT_THAT(ended[r].message(), HasSubstr("--testing_init_end_fails"));
    } else if (cluster_->SameDaemon(r, failing())) {
      // Its own writeback applied, but not every local rank's: not OK, named.
      EXPECT_TRUE(absl::IsFailedPrecondition(ended[r])) << ended[r];
      EXPECT_THAT(ended[r].message(),
                  HasSubstr("did not commit on every rank of this daemon (rank " +
                            std::to_string(failing()) + "'s init End failed"));
    } else {
      EXPECT_TRUE(ended[r].ok()) << ended[r];  // the other daemon initialised it
    }
  }
  // No rank of the split daemon sees the module as usable: never its zeros as the model.
  for (int k = 0; k < world(); ++k) {
    const int r = (failing() + k) % world();  // the rank whose init End failed first
    if (!cluster_->SameDaemon(r, failing())) continue;
    absl::StatusOr<ShardViews> views = ranks_[r].client->GetShardViews("");
    ASSERT_FALSE(views.ok()) << "rank " << r << " sees the module usable after its daemon's "
                             << "init End split (unit 0 element 0: "
                             << static_cast<const float*>(views->begin()->data)[0] << ")";
    EXPECT_TRUE(absl::IsFailedPrecondition(views.status())) << views.status();
    EXPECT_THAT(views.status().message(), HasSubstr("is not initialised"));
  }
  if (multi()) {
    // The group fails (the torn all-gather's sticky error; here every rank leaves) and
    // re-forms: daemon 1 held the module initialised, daemon 0 did not, so the initialisation
    // is undone on every daemon and nothing is lost.
    for (Rank& rank : ranks_) rank.model = RegisteredModule();
    JoinAll();
    for (int r = 0; r < world(); ++r) {
      EXPECT_THAT(ranks_[r].client->lost_modules(), IsEmpty()) << "rank " << r;
    }
    EXPECT_GE(LogCount(cluster_->daemon(1), "its initialisation was undone"), 1);
  }
  // Every rank registers again: the initialisation runs again and commits everywhere.
  ended = RegisterAndEnd();
  for (int r = 0; r < world(); ++r) ASSERT_TRUE(ended[r].ok()) << "rank " << r << ": " << ended[r];
  RunRanks(world(), [&](int r) {
    SummonOptions read;
    read.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks_[r].client->Summon("", "", read);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const PlanUnit& u : ranks_[r].model.plan->units) {
      for (const PlanParam& p : u.params) {
        const float* data = static_cast<const float*>((*s)->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(data[i], InitValue(i)) << "rank " << r << " " << p.fqn << " " << i;
        }
      }
    }
    ASSERT_TRUE((*s)->End().ok());
  });
  // And the group trains on, to the element.
  RunRanks(world(), [&](int r) {
    WriteShards(*ranks_[r].client, r, 1);
    absl::StatusOr<uint64_t> c = ranks_[r].client->Commit("");
    ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
    EXPECT_EQ(*c, 1u);
    absl::StatusOr<ShardViews> views = ranks_[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    EXPECT_EQ(views->generation(), 1u);
    for (const UnitShardView& u : *views) {
      const float* data = static_cast<const float*>(u.data);
      for (int64_t i = 0; i < u.shard_numel; ++i) {
        ASSERT_EQ(data[i], Value(1, r, u.unit, i)) << "rank " << r << " unit " << u.unit;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, InitSplitTest,
                         ::testing::Combine(::testing::Values(Layout::kSingle, Layout::kTwoDaemons),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<Layout, bool>>& info) {
                           return absl::StrCat(
                               ::flatshard::testing::LayoutName(std::get<0>(info.param)),
                               std::get<1>(info.param) ? "WithAStateDirectory" : "Ephemeral");
                         });

}  // namespace
}  // namespace flatshard::client
