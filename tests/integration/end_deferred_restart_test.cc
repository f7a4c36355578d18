// A writeback End with a state directory answers before its own ranges reach the committed
// copies (issue 24; server/module/pending_committed.h): the "done" record names the summon
// segment that holds them (state::DeferredRecord) and the copy runs after the answer. Real
// flatshardd processes: the copy is held (--testing_pause_end_vote=deferred_copy:G), every
// trainer steps its shard in place as an optimizer would, the daemon is killed with SIGKILL,
// and after the restart every rank reads exactly the End's generation, element by element:
// the restart copied the own ranges from the summon segments, never from the stepped shards.
// One daemon (two local ranks) and two daemons (the vote path, daemon 1 killed); and SIGTERM
// while the copies are held.

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/restart_testing.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixtures and their helpers

// Every parameter element after the writeback End of generation `g` (the same on every rank,
// distinct per generation and element, never zero).
float EndValue(uint64_t g, int64_t i) { return static_cast<float>(g * 1000 + 1 + i % 997); }

// The optimizer's step after the End: never a value the End wrote.
constexpr uint64_t kStepped = 77;

// A writeback summon on `rank` whose every view gets generation `g`'s values, ended.
void SummonWriteEnd(Rank& rank, int r, uint64_t g) {
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = rank.client->Summon("", "", {});
  ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
  for (const PlanUnit& u : rank.model.plan->units) {
    for (const PlanParam& p : u.params) {
      float* data = static_cast<float*>((*s)->Find(p.fqn)->data);
      for (int64_t i = 0; i < p.numel; ++i) data[i] = EndValue(g, i);
    }
  }
  absl::Status ended = (*s)->End();
  ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
}

// The record names the held copy's segment (base or journal of the state directory).
bool RecordListsDeferred(const std::filesystem::path& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (::flatshard::testing::ReadFile(entry.path()).find("\"deferred\"") != std::string::npos) {
      return true;
    }
  }
  return false;
}

TEST_F(RestartTest, KillNineWhileAnEndsOwnRangesAreStillToCopyRestoresThemFromTheSummon) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--testing_pause_end_vote=deferred_copy:1:120s"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  RunRanks(kWorld, [&](int r) { SummonWriteEnd(ranks[r], r, 1); });
  // Answered: both ranks' copies are recorded and held.
  ASSERT_TRUE(WaitForLog(*d, "paused at deferred_copy", kWorld)) << d->Log();
  EXPECT_TRUE(RecordListsDeferred(state_dir_));
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, kStepped); });
  d->Kill();
  ranks.clear();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("deferred copy(ies) into committed copies from"));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 1);
  for (Rank& rank : ranks) EXPECT_THAT(rank.client->lost_modules(), IsEmpty());
  ExpectEveryElement(ranks, [](int64_t i) { return EndValue(1, i); });
  // And it goes on: the next End copies in the background unpaused (another generation).
  RunRanks(kWorld, [&](int r) { SummonWriteEnd(ranks[r], r, 2); });
  ExpectEveryElement(ranks, [](int64_t i) { return EndValue(2, i); });
}

// SIGTERM (shards kept for the next daemon) unlinks the summon segments: the held copies are
// finished first (Records::KeepDeviceShards; the exit also waits for the held worker, whose
// mappings outlive the names), so the next daemon finds every committed copy complete. (Held
// for 5 s: a test slower than that between the pause and the SIGTERM finds the copy done on
// its own, with the same values.)
TEST_F(RestartTest, SigtermWhileAnEndsOwnRangesAreStillToCopyFinishesThemFirst) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--testing_pause_end_vote=deferred_copy:1:5s"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  RunRanks(kWorld, [&](int r) { SummonWriteEnd(ranks[r], r, 1); });
  ASSERT_TRUE(WaitForLog(*d, "paused at deferred_copy", kWorld)) << d->Log();
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, kStepped); });
  EXPECT_EQ(d->Terminate(), 0);
  ranks.clear();
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 1);
  for (Rank& rank : ranks) EXPECT_THAT(rank.client->lost_modules(), IsEmpty());
  ExpectEveryElement(ranks, [](int64_t i) { return EndValue(1, i); });
}

class EndDeferredTwoDaemonTest : public TwoDaemonRestartTest {
 protected:
  void SetUp() override {
    daemon1_flags_ = {"--testing_pause_end_vote=deferred_copy:2:120s"};
    TwoDaemonRestartTest::SetUp();
  }
};

TEST_F(EndDeferredTwoDaemonTest, KillNineWhileAnEndsOwnRangesAreStillToCopyLosesNothing) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  RunRanks(2, [&](int r) { SummonWriteEnd(ranks[r], r, 1); });
  RunRanks(2, [&](int r) { SummonWriteEnd(ranks[r], r, 2); });
  ASSERT_TRUE(WaitForLog(*daemons_[1], "paused at deferred_copy")) << daemons_[1]->Log();
  EXPECT_TRUE(RecordListsDeferred(dirs_[1]));
  RunRanks(2, [&](int r) { WriteShards(*ranks[r].client, r, kStepped); });
  daemons_[1]->Kill();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  EXPECT_THAT(daemons_[1]->Log(), HasSubstr("deferred copy(ies) into committed copies from"));
  JoinAll(ranks);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(ranks[r].client->lost_modules(), IsEmpty()) << "rank " << r;
  }
  Register(ranks, 2);
  ExpectEveryElement(ranks, [](int64_t i) { return EndValue(2, i); });
  Commit(ranks, 3);
  RunRanks(2, [&](int r) { SummonWriteEnd(ranks[r], r, 4); });
  ExpectEveryElement(ranks, [](int64_t i) { return EndValue(4, i); });
}

}  // namespace
}  // namespace flatshard::client
