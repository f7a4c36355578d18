// No module lost to a single daemon kill during a writeback End over two daemons (issue 24;
// README "Restarts", server/durable/commit_votes.cc): real flatshardd processes, rank r on
// daemon r, each with a state directory. Daemon 1 is killed with SIGKILL at each point of
// generation 2's writeback End (--testing_pause_end_vote): after its rank wrote back but
// before its vote is recorded, after the vote is recorded but before it went out, and after
// every rank voted but before its intent (daemon 0 committed 2 and answered); each with a
// plain writeback and a rank0_only one (rank 0's buffers broadcast first). After the restart
// and the re-join every rank finds one generation, to the element (1 when daemon 1's vote
// never went out, 2 when it did), nothing is lost, and the group goes on.

#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/restart_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixture and its helpers

// Every parameter element after the writeback End of generation `g` (the same on every rank,
// distinct per generation and element, never zero).
float EndValue(uint64_t g, int64_t i) { return static_cast<float>(g * 1000 + 1 + i % 997); }

// Opens a writeback summon on `rank` (number `r`) and writes generation `g`'s values into
// every view (`rank0_only`: rank 0 alone writes, its buffers are broadcast at the End).
std::unique_ptr<SummonedParams> SummonAndWrite(Rank& rank, int r, uint64_t g,
                                               bool rank0_only = false) {
  SummonOptions options;
  options.rank0_only = rank0_only;
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = rank.client->Summon("", "", options);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  if (rank0_only && r != 0) return *std::move(s);
  for (const PlanUnit& u : rank.model.plan->units) {
    for (const PlanParam& p : u.params) {
      float* data = static_cast<float*>((*s)->Find(p.fqn)->data);
      for (int64_t i = 0; i < p.numel; ++i) data[i] = EndValue(g, i);
    }
  }
  return *std::move(s);
}

// (kill point, rank0_only)
class EndVoteRestartTest : public TwoDaemonRestartTest,
                           public ::testing::WithParamInterface<std::tuple<const char*, bool>> {
 protected:
  void SetUp() override {
    daemon1_flags_ = {absl::StrCat("--testing_pause_end_vote=", std::get<0>(GetParam()), ":2:60s")};
    TwoDaemonRestartTest::SetUp();
  }
  // Every rank's writeback End of generation `g`, answered with `g` everywhere.
  void EndAll(std::vector<Rank>& ranks, uint64_t g) {
    RunRanks(2, [&](int r) {
      std::unique_ptr<SummonedParams> s = SummonAndWrite(ranks[r], r, g);
      ASSERT_NE(s, nullptr);
      absl::Status ended = s->End();
      ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
    });
  }
  // Every rank finds generation `g`'s values in every element (a read-only summon).
  void ExpectEveryElement(std::vector<Rank>& ranks, uint64_t g) {
    for (Rank& rank : ranks) EXPECT_THAT(rank.client->lost_modules(), IsEmpty());
    restart_testing::ExpectEveryElement(ranks, [g](int64_t i) { return EndValue(g, i); });
  }
};

TEST_P(EndVoteRestartTest, ADaemonKilledInsideAWritebackEndLosesNothing) {
  const std::string point = std::get<0>(GetParam());
  const bool rank0_only = std::get<1>(GetParam());
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  EndAll(ranks, 1);
  std::vector<std::unique_ptr<SummonedParams>> summons(2);
  RunRanks(2, [&](int r) { summons[r] = SummonAndWrite(ranks[r], r, 2, rank0_only); });
  ASSERT_NE(summons[0], nullptr);
  ASSERT_NE(summons[1], nullptr);
  absl::Status answers[2];
  std::thread rank1([&] { answers[1] = summons[1]->End(); });
  std::thread rank0([&] { answers[0] = summons[0]->End(); });
  const std::string paused = absl::StrCat("paused at ", point);
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (daemons_[1]->Log().find(paused) == std::string::npos && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_THAT(daemons_[1]->Log(), HasSubstr(paused));
  if (point == "before_intent") {
    // Every rank voted: daemon 0 commits 2 and answers its trainer, whatever daemon 1 does.
    rank0.join();
    EXPECT_TRUE(answers[0].ok()) << answers[0];
  }
  daemons_[1]->Kill();
  if (rank0.joinable()) rank0.join();
  rank1.join();
  EXPECT_FALSE(answers[1].ok());
  const uint64_t want = point == "before_intent" ? 2 : 1;
  if (want == 1) {
    // Daemon 1's vote never went out: no daemon copied, and the survivor's trainer is told so.
    EXPECT_FALSE(answers[0].ok());
    EXPECT_THAT(answers[0].message(), HasSubstr("did not complete on this rank"));
  }
  summons.clear();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  if (point != "before_vote") {
    EXPECT_THAT(daemons_[1]->Log(), HasSubstr("voted 2"));
  }
  JoinAll(ranks);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(ranks[r].client->lost_modules(), IsEmpty()) << "rank " << r;
    EXPECT_THAT(ranks[r].client->registered_modules(), SizeIs(1)) << "rank " << r;
  }
  Register(ranks, want);
  ExpectEveryElement(ranks, want);
  if (want == 2) {
    EXPECT_THAT(daemons_[1]->Log(), HasSubstr("rolled forward to generation 2"));
  } else if (point == "before_vote") {
    // Daemon 0's rank voted (1|2), daemon 1's did not (1): the re-form resolves to 1.
    EXPECT_THAT(daemons_[0]->Log(), HasSubstr("resolved to generation 1"));
  }
  // And the group goes on (a Commit first: the restarted daemon 1 would pause at generation
  // 2's End again).
  Commit(ranks, want + 1);
  EndAll(ranks, want + 2);
  ExpectEveryElement(ranks, want + 2);
}

INSTANTIATE_TEST_SUITE_P(KillPoints, EndVoteRestartTest,
                         ::testing::Combine(::testing::Values("before_vote", "after_vote",
                                                              "before_intent"),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<const char*, bool>>& info) {
                           const std::string p = std::get<0>(info.param);
                           return std::string(p == "before_vote"  ? "BeforeItsVote"
                                              : p == "after_vote" ? "AfterItsVoteBeforeItWentOut"
                                                                  : "AfterEveryVoteBeforeIntent") +
                                  (std::get<1>(info.param) ? "Rank0Only" : "");
                         });

}  // namespace
}  // namespace flatshard::client
