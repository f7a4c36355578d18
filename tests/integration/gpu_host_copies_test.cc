// GPU daemons survive kill -9 (README "Restarts": GPU daemons): after each commit a simulated-GPU
// daemon (--simulate_gpus: the daemon's device code paths over host shared memory) copies its
// committed device shards to host segments on a thread of its own and records the copy once
// complete; a daemon killed with SIGKILL and restarted puts the newest complete copy back on the
// devices and every rank re-attaches at its generation, bit for bit. A kill while the copy of the
// last commit is half written (--testing_pause_host_copy) resumes from the copy before it. Real
// flatshardd processes, a state directory, two ranks of the example GPT model.

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/restart_testing.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixture and its helpers

TEST_F(RestartTest, GpuDaemonKilledAfterCommitsResumesFromTheNewestHostCopy) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 3);
  ASSERT_TRUE(WaitForLog(*d, HostCopyRecorded(3)));
  const std::vector<Snapshot> step3 = Expected(ranks);
  // An optimizer step that never committed: the restart must not keep it.
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 99); });
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("generation 3)"));
  // Gradient shards are not kept (as at SIGTERM); one more commit (4) works.
  ExpectReattached(*d, ranks, 3, step3, /*commit_after=*/true, /*grads_kept=*/false);
  ASSERT_TRUE(WaitForLog(*d, HostCopyRecorded(4)));
  const std::vector<Snapshot> step4 = Expected(ranks);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  ExpectReattached(*d, ranks, 4, step4, /*commit_after=*/false, /*grads_kept=*/false);
  // Killed again before any commit: the adopted copy is still the recorded one.
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  ExpectReattached(*d, ranks, 4, step4, /*commit_after=*/false, /*grads_kept=*/false);
}

// Killed right after commit 3, while its host copy is half written (rank 0's slot holds 3, rank
// 1's not yet; --testing_pause_host_copy): generation 3 was never recorded, so the daemon resumes
// from the complete copy of generation 2 on both ranks, never a mix.
TEST_F(RestartTest, GpuDaemonKilledBeforeTheLastHostCopyResumesFromThePreviousOne) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d =
      StartDaemon({"--simulate_gpus=2", "--testing_pause_host_copy=3:120s"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  ASSERT_TRUE(WaitForLog(*d, HostCopyRecorded(2)));
  const std::vector<Snapshot> step2 = Expected(ranks);
  Train(ranks, 3, 3);
  ASSERT_TRUE(WaitForLog(*d, "generation 3 paused"));
  ranks.clear();
  d->Kill();
  EXPECT_EQ(LogCount(*d, HostCopyRecorded(3)), 0);
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("generation 2)"));
  ExpectReattached(*d, ranks, 2, step2, /*commit_after=*/false, /*grads_kept=*/false);
}

// A model of zeros is committed at its registration (generation 0): its host copy is made then,
// so a kill -9 before the first Commit keeps the module too.
TEST_F(RestartTest, GpuDaemonKilledBeforeAnyCommitKeepsItsModelOfZeros) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  // Both ranks in one copy (a copy made while only rank 0 had registered holds rank 0 alone).
  ASSERT_TRUE(WaitForLog(*d, "host copy of generation 0 recorded (2 rank(s)"));
  const std::vector<Snapshot> zeros = Expected(ranks);
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 99); });  // not committed
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  ExpectReattached(*d, ranks, 0, zeros, /*commit_after=*/true, /*grads_kept=*/false);
}

// SIGTERM after the host copy of the last commit is recorded: it is not made again, and the
// next daemon puts it back on the devices.
TEST_F(RestartTest, GpuDaemonSigtermAfterItsHostCopyKeepsThatCopy) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  ASSERT_TRUE(WaitForLog(*d, HostCopyRecorded(2)));
  const std::vector<Snapshot> step2 = Expected(ranks);
  RunRanks(kWorld, [&](int r) { ASSERT_TRUE(ranks[r].client->Leave().ok()); });
  ranks.clear();
  EXPECT_EQ(d->Terminate(), 0);
  EXPECT_EQ(LogCount(*d, "kept host copies of the committed device shards"), 0);
  ASSERT_TRUE(Restart(*d));
  ExpectReattached(*d, ranks, 2, step2, /*commit_after=*/true, /*grads_kept=*/false);
}

// The committed optimizer state is copied with the shards: after kill -9 every rank finds the
// state of the newest recorded copy bit for bit, not the uncommitted writes on top.
TEST_F(StateRestartTest, GpuDaemonKilledAfterCommitsKeepsItsCommittedOptimizerState) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  RegisterStateAll(ranks);
  TrainWithState(ranks, 1, 2);
  ASSERT_TRUE(WaitForLog(*d, HostCopyRecorded(2)));
  const std::vector<std::vector<std::string>> state = StateOf(ranks);
  RunRanks(kWorld, [&](int r) { optstate::WriteState(*ranks[r].client, r, 55); });
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 2);
  ExpectStateReattached(ranks, 2, state);
  TrainWithState(ranks, 3, 3);
}

// --gpu_host_copies=false: nothing of a device module is recorded, so kill -9 loses it (the
// daemon before issue 24's host copies).
TEST_F(RestartTest, GpuDaemonWithoutHostCopiesLosesItsShardsToKillNine) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2", "--gpu_host_copies=false"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  EXPECT_EQ(LogCount(*d, "host copy of generation"), 0);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 0);
}

// Two daemons, daemon 1 on simulated GPUs: killed after its host copy of commit 2 is recorded,
// it comes back at generation 2 and the group re-forms with both daemons' shards intact.
class GpuTwoDaemonTest : public TwoDaemonRestartTest {
 protected:
  void SetUp() override {
    daemon1_flags_ = extra_;
    daemon1_flags_.push_back("--simulate_gpus=1");
    simulated_gpu1_ = true;
    TwoDaemonRestartTest::SetUp();
  }
  std::vector<std::string> extra_;
};

TEST_F(GpuTwoDaemonTest, TheGroupReformsAtTheRestartedGpuDaemonsHostCopy) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  Commit(ranks, 1);
  Commit(ranks, 2);
  ASSERT_TRUE(WaitForLog(*daemons_[1], HostCopyRecorded(2)));
  std::vector<Snapshot> committed;
  for (Rank& r : ranks) committed.push_back(Take(*r.client));
  daemons_[1]->Kill();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  JoinAll(ranks);
  ExpectEveryRankKeptItsModule(ranks);
  Register(ranks, 2);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    Snapshot now = Take(*ranks[r].client);
    EXPECT_EQ(now.generation, 2u);
    ASSERT_EQ(now.shards.size(), committed[r].shards.size());
    for (size_t u = 0; u < now.shards.size(); ++u) {
      EXPECT_TRUE(now.shards[u] == committed[r].shards[u]) << "unit " << u;
    }
  }
  Commit(ranks, 3);
}

// Killed between commit 2 and the end of its host copy: daemon 1 can offer generation 1 only,
// daemon 0 (a host daemon) holds 2 and keeps no older copy, so the module is dropped as lost,
// naming both (README "Restarts", GPU daemons: a group of GPU daemons resumes at 1, below).
class GpuTwoDaemonPausedTest : public GpuTwoDaemonTest {
 protected:
  void SetUp() override {
    extra_ = {"--testing_pause_host_copy=2:120s"};
    GpuTwoDaemonTest::SetUp();
  }
};

TEST_F(GpuTwoDaemonPausedTest, KilledBeforeItsHostCopyTheModuleIsLostNamingTheGenerations) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  Commit(ranks, 1);
  ASSERT_TRUE(WaitForLog(*daemons_[1], HostCopyRecorded(1)));
  Commit(ranks, 2);
  ASSERT_TRUE(WaitForLog(*daemons_[1], "generation 2 paused"));
  daemons_[1]->Kill();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  JoinAll(ranks);
  ExpectEveryRankLostItsModule(
      ranks, {"generation 1: rank 1 (daemon node1)", "generation 2: rank 0 (daemon node0)"});
}

// Both daemons on simulated GPUs; daemon 1's host copy of generation 2 is held half written
// (--testing_pause_host_copy) and it is killed there: it comes back at generation 1, daemon 0
// (whose copy of 2 is recorded) reports that it can go back to 1 from its previous host slot,
// the group resolves to 1 and every rank holds generation 1 to the element, nothing lost; the
// group then trains on, and a later kill resumes at the newer copy.
class GpuGroupTest : public TwoDaemonRestartTest {
 protected:
  void SetUp() override {
    daemon0_flags_ = {"--simulate_gpus=1"};
    daemon0_flags_.insert(daemon0_flags_.end(), extra0_.begin(), extra0_.end());
    daemon1_flags_ = {"--simulate_gpus=1", "--testing_pause_host_copy=2:600s"};
    simulated_gpu0_ = simulated_gpu1_ = true;
    TwoDaemonRestartTest::SetUp();
  }
  // Commits 1 and 2; daemon 1 killed while its host copy of 2 is half written. Returns every
  // rank's state at generation 1.
  std::vector<Snapshot> KillDaemon1BeforeItsCopyOf2(std::vector<Rank>& ranks,
                                                    const std::string& daemon0_waits_for) {
    JoinAll(ranks);
    Register(ranks, 0);
    Commit(ranks, 1);
    for (auto& d : daemons_) EXPECT_TRUE(WaitForLog(*d, HostCopyRecorded(1)));
    std::vector<Snapshot> step1;
    for (Rank& r : ranks) step1.push_back(Take(*r.client));
    Commit(ranks, 2);
    EXPECT_TRUE(WaitForLog(*daemons_[0], daemon0_waits_for));
    EXPECT_TRUE(WaitForLog(*daemons_[1], "generation 2 paused"));
    daemons_[1]->Kill();
    EXPECT_EQ(LogCount(*daemons_[1], HostCopyRecorded(2)), 0);
    ranks[1] = Rank();
    EXPECT_TRUE(RestartDaemon1({"--testing_pause_host_copy="}));  // its next copy of 2 runs
    JoinAll(ranks);
    ExpectEveryRankKeptItsModule(ranks);
    return step1;
  }
  void ExpectAt(std::vector<Rank>& ranks, uint64_t generation,
                const std::vector<Snapshot>& expected) {
    Register(ranks, generation);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      Snapshot now = Take(*ranks[r].client);
      EXPECT_EQ(now.generation, generation);
      ASSERT_EQ(now.shards.size(), expected[r].shards.size());
      for (size_t u = 0; u < now.shards.size(); ++u) {
        EXPECT_TRUE(now.shards[u] == expected[r].shards[u]) << "unit " << u;
      }
    }
  }
  std::vector<std::string> extra0_;
};

TEST_F(GpuGroupTest, KilledBeforeItsHostCopyTheGroupResumesAtTheCommonGeneration) {
  std::vector<Rank> ranks;
  const std::vector<Snapshot> step1 = KillDaemon1BeforeItsCopyOf2(ranks, HostCopyRecorded(2));
  EXPECT_TRUE(WaitForLog(*daemons_[0], "rolled back to generation 1 from their host copy"));
  EXPECT_THAT(daemons_[0]->Log(), HasSubstr("resolved to generation 1"));
  ExpectAt(ranks, 1, step1);
  // It trains on: commit 2 again (other values), and daemon 1's next copy is recorded.
  Commit(ranks, 2);
  Commit(ranks, 3);
  ASSERT_TRUE(WaitForLog(*daemons_[0], HostCopyRecorded(3)));
  ASSERT_TRUE(WaitForLog(*daemons_[1], HostCopyRecorded(3)));
  std::vector<Snapshot> step3;
  for (Rank& r : ranks) step3.push_back(Take(*r.client));
  // Killed after its copy of 3 is recorded: no rollback, the group re-forms at 3.
  daemons_[1]->Kill();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  JoinAll(ranks);
  ExpectEveryRankKeptItsModule(ranks);
  ExpectAt(ranks, 3, step3);
  EXPECT_EQ(LogCount(*daemons_[0], "rolled back to generation 1 from their host copy"), 1);
  EXPECT_EQ(LogCount(*daemons_[0], "rolled back to generation 2 from their host copy"), 0);
}

// Daemon 0's own copy of 2 is still under way too (held): its recorded slot holds 1, which is
// what it goes back to.
class GpuGroupBothPausedTest : public GpuGroupTest {
 protected:
  void SetUp() override {
    extra0_ = {"--testing_pause_host_copy=2:600s"};
    GpuGroupTest::SetUp();
  }
};

TEST_F(GpuGroupBothPausedTest, TheSurvivorGoesBackToItsRecordedHostCopy) {
  std::vector<Rank> ranks;
  const std::vector<Snapshot> step1 = KillDaemon1BeforeItsCopyOf2(ranks, "generation 2 paused");
  EXPECT_TRUE(WaitForLog(*daemons_[0], "rolled back to generation 1 from their host copy"));
  ExpectAt(ranks, 1, step1);
}

}  // namespace
}  // namespace flatshard::client
