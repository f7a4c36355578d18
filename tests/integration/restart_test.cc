// A daemon restart loses nothing (README "Restarts"), with real flatshardd processes and a
// state directory: kill -9 after commits (and with uncommitted in-place writes on top), kill -9
// while a commit's copy into the committed copies is torn (--testing_commit_copy_pause), SIGTERM
// with --keep_shards and without; every rank re-joins, re-registers the same model and finds
// the last committed generation bit for bit, with its gradient shards. Records or segments that
// do not check out (a flipped byte, a truncated or missing segment) are refused with a log line
// naming the file and the check, and the group is not adopted; segments no record references
// are removed at start. Two daemons: the restarted one keeps its ranks' shards and the group
// re-forms with them; daemons whose generations differ drop the module as lost, by name.

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "common/shm_segment.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durable/journal.h"
#include "server/durable/state_dir.h"
#include "tests/integration/restart_testing.h"
#include "tests/testing/cluster.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixture and its helpers

TEST_F(RestartTest, KillNineAfterCommitsKeepsEveryShardBitForBit) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 3);
  const std::vector<Snapshot> committed = Expected(ranks);
  // An optimizer step that never committed: the restart must not keep it.
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 99); });
  const size_t segments = d->Segments().size();
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("group=g adopted from"));
  EXPECT_THAT(d->Log(), HasSubstr("generation 3"));
  // Shards, committed copies and gradient shards, and the kept staging buffers the record
  // lists that still held their pages (adopted, not copied); nothing new.
  EXPECT_GE(d->Segments().size(), kWorld * committed[0].shards.size() * 3);
  EXPECT_LE(d->Segments().size(), segments);
  ExpectReattached(*d, ranks, 3, committed);
}

TEST_F(RestartTest, KillNineWhileACommitCopyIsTornFinishesTheCommitFromTheShards) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--testing_commit_copy_pause=30s"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  // The registration's zeros are generation 0; no copy runs until the first commit.
  RegisterAll(ranks, 0);
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 1); });
  const std::vector<Snapshot> step1 = Expected(ranks);
  // The first rank's copy has torn its committed copy (unit 0 copied) and paused; the other
  // rank's copy waits behind it (host ranks copy on the agreement's completion thread), so
  // its record says only that every rank agreed.
  ASSERT_NO_FATAL_FAILURE(KillDuringACommitCopyAndRestart(*d, ranks, 1));
  // Every unit holds generation 1 (the torn copy was finished, never adopted as it was); no
  // gradient was ever reduced.
  ExpectReattached(*d, ranks, 1, step1, /*commit_after=*/false);  // commits pause here
}

// A writeback End commits too (host daemons with a state directory: every local rank writes
// back into its shards first, then one record says all are ready and the copies into the
// committed copies run). Killed while those copies are torn, the restart finishes every rank's
// copy from its shards: every rank comes back at the End's generation with its values.
TEST_F(RestartTest, KillNineDuringAWritebackEndsCopiesFinishesThemFromTheShards) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--testing_commit_copy_pause=30s"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  auto value = [](int64_t i) { return 3.0f + static_cast<float>(i % 101) * 0.25f; };
  std::vector<std::thread> ending;
  std::vector<std::unique_ptr<SummonedParams>> summons(kWorld);
  RunRanks(kWorld, [&](int r) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", {});
    ASSERT_TRUE(s.ok()) << s.status();
    for (const PlanUnit& u : ranks[r].model.plan->units) {
      for (const PlanParam& p : u.params) {
        float* data = static_cast<float*>((*s)->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) data[i] = value(i);
      }
    }
    summons[r] = *std::move(s);
  });
  for (int r = 0; r < kWorld; ++r) {
    ending.emplace_back([&, r] { (void)summons[r]->End(); });
  }
  const bool was_paused = KillOnceACommitCopyPaused(*d);
  for (std::thread& t : ending) t.join();
  summons.clear();
  ranks.clear();
  ASSERT_TRUE(was_paused) << d->Log();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("rank=0: finished the end of generation 1 from its shards"));
  EXPECT_THAT(d->Log(), HasSubstr("rank=1: finished the end of generation 1 from its shards"));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 1);
  RunRanks(kWorld, [&](int r) {
    EXPECT_THAT(ranks[r].client->lost_modules(), IsEmpty());
    SummonOptions read;
    read.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", read);
    ASSERT_TRUE(s.ok()) << s.status();
    for (const PlanUnit& u : ranks[r].model.plan->units) {
      for (const PlanParam& p : u.params) {
        const float* data = static_cast<const float*>((*s)->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) ASSERT_EQ(data[i], value(i)) << p.fqn << " " << i;
      }
    }
    ASSERT_TRUE((*s)->End().ok());
  });
}

// A daemon whose record has a module's local ranks at different generations (as if it had died
// between their copies of one commit) refuses the module as lost, named with each rank's
// generation, never adopted as a mix.
TEST_F(RestartTest, LocalRanksAtDifferentGenerationsAreDroppedAsLostNamingThem) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 1);
  ranks.clear();
  d->Kill();
  {
    std::unique_ptr<server::state::StateDir> dir =
        *server::state::StateDir::Open(state_dir_.string());
    server::state::GroupRecord rec = dir->LoadAll().groups.at(0);
    rec.modules[0].ranks[1].generation = 0;
    rec.sequence += 1;
    ASSERT_TRUE(dir->Write(rec).ok());
  }
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 0);
  ASSERT_NO_FATAL_FAILURE(ExpectEveryRankLostItsModule(
      ranks, {"its ranks hold different committed generations (rank 1: generation 0; rank 0: "
              "generation 1)"}));
  RegisterAll(ranks, 0);  // afresh
}

TEST_F(RestartTest, DrainThenSigtermKeepsShardsForTheNextDaemonByDefault) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  const std::vector<Snapshot> committed = Expected(ranks);
  RunRanks(kWorld, [&](int r) { ASSERT_TRUE(ranks[r].client->Leave().ok()); });
  ranks.clear();
  // The planned restart: drain, then SIGTERM.
  const std::string drain = absl::StrCat(FS_BINARY_DIR, "/client/flatshardctl drain --socket ",
                                         d->socket(), " --timeout-ms=10000 > /dev/null 2>&1");
  EXPECT_EQ(std::system(drain.c_str()), 0) << drain;
  EXPECT_EQ(d->Terminate(), 0);
  EXPECT_THAT(d->Segments(), Not(IsEmpty()));
  EXPECT_THAT(d->Log(), HasSubstr("kept for the next daemon"));
  ASSERT_TRUE(Restart(*d));
  ExpectReattached(*d, ranks, 2, committed);
}

TEST_F(RestartTest, SigtermWithoutKeepShardsFreesEverythingAndRemovesTheRecords) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--keep_shards=false"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 1);
  // The group's record: its base file and its journal.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(state_dir_),
                          std::filesystem::directory_iterator()),
            2);
  RunRanks(kWorld, [&](int r) { ASSERT_TRUE(ranks[r].client->Leave().ok()); });
  ranks.clear();
  EXPECT_EQ(d->Terminate(), 0);
  EXPECT_THAT(d->Segments(), IsEmpty());
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(state_dir_),
                          std::filesystem::directory_iterator()),
            0);
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 0);  // nothing to re-attach to: registered afresh
  RegisterAll(ranks, 0);
}

TEST_F(RestartTest, DeleteGroupRemovesTheRecord) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  const std::filesystem::path record = state_dir_ / server::state::RecordFileName("g");
  EXPECT_TRUE(std::filesystem::exists(record));
  RunRanks(kWorld, [&](int r) { ASSERT_TRUE(ranks[r].client->Leave().ok()); });
  const std::string ctl = std::string(FS_BINARY_DIR) + "/client/flatshardctl";
  const std::string cmd =
      absl::StrCat(ctl, " delete-group g --socket ", d->socket(), " > /dev/null 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  EXPECT_FALSE(std::filesystem::exists(record));
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Segments(), IsEmpty());
}

// A GPU daemon (simulated GPUs: the daemon's device code paths over host shared memory): its
// device memory dies with it, so SIGTERM with --keep_shards copies each rank's committed device
// shards into host segments and the next daemon copies them into fresh device memory. Without
// the host copies made at each commit (--gpu_host_copies=false; gpu_host_copies_test has them)
// a kill -9 keeps nothing of a device module.
TEST_F(RestartTest, GpuDaemonKeepsHostCopiesOfItsCommittedShardsOnSigterm) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2", "--gpu_host_copies=false"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  const std::vector<Snapshot> committed = Expected(ranks);
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 55); });  // not committed
  RunRanks(kWorld, [&](int r) { ASSERT_TRUE(ranks[r].client->Leave().ok()); });
  ranks.clear();
  EXPECT_EQ(d->Terminate(), 0);
  EXPECT_THAT(d->Log(), HasSubstr("kept host copies of the committed device shards of 2 rank(s)"));
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("group=g adopted from"));
  // The shards are back on the (simulated) devices at generation 2; gradients are not kept.
  ExpectReattached(*d, ranks, 2, committed, /*commit_after=*/true, /*grads_kept=*/false);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 0);  // device memory died with the process
}

// Breaks the record or a segment of a trained group, restarts, and checks that the group was
// refused with `log_text` and not adopted.
class RefusedTest : public RestartTest {
 protected:
  void Run(const std::function<void(DaemonProcess&)>& breakit, const std::string& log_text,
           bool segments_left_alone) {
    std::unique_ptr<DaemonProcess> d = StartDaemon();
    std::vector<Rank> ranks;
    JoinAll(*d, ranks, 0);
    RegisterAll(ranks, 0);
    Train(ranks, 1, 1);
    ranks.clear();
    d->Kill();
    // The record's segments (staging buffers are not recorded: removed at start).
    // (The record is its base file and its journal.)
    std::vector<std::string> recorded;
    for (const std::string& file :
         {server::state::RecordFileName("g"), server::state::JournalFileName("g")}) {
      std::ifstream in(state_dir_ / file, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      for (const std::string& name : server::state::SegmentNamesIn(ss.str(), d->tag())) {
        recorded.push_back("/dev/shm" + name);
      }
    }
    breakit(*d);
    std::vector<std::string> before;
    for (const std::string& s : recorded) {
      if (std::filesystem::exists(s)) before.push_back(s);
    }
    std::sort(before.begin(), before.end());
    before.erase(std::unique(before.begin(), before.end()), before.end());
    ASSERT_TRUE(Restart(*d));
    const std::string log = d->Log();
    EXPECT_THAT(log, HasSubstr(log_text));
    EXPECT_THAT(log, HasSubstr(server::state::RecordFileName("g")));
    EXPECT_THAT(log, HasSubstr("not adopted"));
    EXPECT_THAT(log, Not(HasSubstr("group=g adopted")));
    if (segments_left_alone) {
      std::vector<std::string> after = d->Segments();
      std::sort(after.begin(), after.end());
      EXPECT_EQ(after, before);
    }
    JoinAll(*d, ranks, 0);  // nothing adopted
  }
  std::string ASegment() {
    server::state::StateDir::Loaded l =
        (*server::state::StateDir::Open(state_dir_.string()))->LoadAll();
    EXPECT_THAT(l.groups, SizeIs(1));
    return "/dev/shm" + l.groups[0].modules[0].ranks[1].units[2].buffers[0].segment;
  }
};

TEST_F(RefusedTest, AFlippedRecordByte) {
  Run(
      [&](DaemonProcess&) {
        const std::filesystem::path p = state_dir_ / server::state::RecordFileName("g");
        std::ifstream in(p, std::ios::binary);
        std::stringstream ss;
        ss << in.rdbuf();
        std::string bytes = ss.str();
        bytes.back() ^= 0x04;  // the body's closing brace: no segment name changes
        std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
      },
      "checksum:", /*segments_left_alone=*/true);
}

TEST_F(RefusedTest, ATruncatedSegment) {
  Run(
      [&](DaemonProcess&) {
        const std::string seg = ASegment();
        ASSERT_EQ(::truncate(seg.c_str(), 8), 0) << seg;
      },
      "has 8 bytes, the record says", /*segments_left_alone=*/true);
}

TEST_F(RefusedTest, AMissingSegment) {
  Run(
      [&](DaemonProcess&) {
        const std::string seg = ASegment();
        ASSERT_EQ(::unlink(seg.c_str()), 0) << seg;
      },
      "No such file", /*segments_left_alone=*/true);
}

TEST_F(RestartTest, SegmentsNoRecordReferencesAreRemovedAtStart) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  const std::vector<Snapshot> zeros = Expected(ranks);
  ranks.clear();
  d->Kill();
  // A segment of a dead daemon that no record names.
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_GT(dead, 0);
  waitpid(dead, nullptr, 0);
  const std::string garbage = absl::StrCat("/", d->tag(), ".", dead, ".7");
  {
    absl::StatusOr<ShmSegment> s = ShmSegment::Create(garbage, 4096);
    ASSERT_TRUE(s.ok()) << s.status();
    s->Disown();
  }
  ASSERT_TRUE(std::filesystem::exists("/dev/shm" + garbage));
  ASSERT_TRUE(Restart(*d));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + garbage));
  EXPECT_THAT(d->Log(), HasSubstr(absl::StrCat("removed segment ", garbage,
                                               " (4096 bytes): no state record references it")));
  ExpectReattached(*d, ranks, 0, zeros);
}

// Two daemons (rank r on daemon r), each with its own state directory; daemon 1 (not the
// coordinator) is killed with SIGKILL after two commits and restarted.
TEST_F(TwoDaemonRestartTest, TheGroupReformsWithTheRestartedDaemonsShardsIntact) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  Commit(ranks, 1);
  Commit(ranks, 2);
  std::vector<Snapshot> committed;
  for (Rank& r : ranks) committed.push_back(Take(*r.client));
  WriteShards(*ranks[0].client, 0, 77);  // uncommitted on the survivor: rolled back
  daemons_[1]->Kill();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  JoinAll(ranks);
  ExpectEveryRankKeptItsModule(ranks);
  Register(ranks, 2);  // re-attach on both daemons
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    Snapshot now = Take(*ranks[r].client);
    EXPECT_EQ(now.generation, 2u);
    ASSERT_EQ(now.shards.size(), committed[r].shards.size());
    for (size_t u = 0; u < now.shards.size(); ++u) {
      EXPECT_TRUE(now.shards[u] == committed[r].shards[u]) << "unit " << u;
    }
  }
  // The group works across both daemons again: a full summon (all-gather over UCX), a commit.
  RunRanks(2, [&](int r) {
    SummonOptions read;
    read.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", read);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    ASSERT_TRUE((*s)->End().ok());
  });
  Commit(ranks, 3);
}

TEST_F(TwoDaemonRestartTest, DaemonsAtDifferentGenerationsDropTheModuleNamingThem) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  Commit(ranks, 1);
  Commit(ranks, 2);
  daemons_[1]->Kill();
  ranks[1] = Rank();
  // As if daemon 1 had died before its copy of commit 2 began: its record says generation 1.
  {
    std::unique_ptr<server::state::StateDir> dir =
        *server::state::StateDir::Open(dirs_[1].string());
    server::state::StateDir::Loaded loaded = dir->LoadAll();
    ASSERT_THAT(loaded.groups, SizeIs(1));
    server::state::GroupRecord rec = loaded.groups[0];
    for (server::state::ModuleRecord& m : rec.modules) {
      m.pending.reset();
      for (server::state::RankRecord& rr : m.ranks) rr.generation = 1;
    }
    rec.sequence += 1;
    ASSERT_TRUE(dir->Write(rec).ok());
  }
  ASSERT_TRUE(RestartDaemon1());
  JoinAll(ranks);
  ASSERT_NO_FATAL_FAILURE(ExpectEveryRankLostItsModule(
      ranks, {"different committed generations", "generation 1: rank 1 (daemon node1)",
              "generation 2: rank 0 (daemon node0)"}));
  Register(ranks, 0);  // afresh
  Commit(ranks, 1);
}

// Issue 24, "no module lost to a single daemon kill": daemon 1 is killed between commit 2's
// agreement and its intent record (--testing_pause_before_commit_intent), after daemon 0
// committed generation 2 and answered rank 0. Daemon 1 comes back with generation 1 in its
// committed copies and its rank's vote for 2 in its record (its shards hold 2); at the re-form
// every daemon resolves the module to 2 and daemon 1 rolls its rank forward from its shards.
// Was: the module dropped as lost ("its daemons hold different committed generations").
class VoteRestartTest : public TwoDaemonRestartTest {
 protected:
  void SetUp() override {
    daemon1_flags_ = {"--testing_pause_before_commit_intent=" + std::string(kPausedAt)};
    TwoDaemonRestartTest::SetUp();
  }
  static constexpr char kPausedAt[] = "2:60s";
};

TEST_F(VoteRestartTest, ADaemonKilledBetweenAgreementAndIntentIsRolledForward) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  Commit(ranks, 1);
  absl::StatusOr<uint64_t> answers[2] = {absl::UnknownError("none"), absl::UnknownError("none")};
  std::thread rank1([&] {
    WriteShards(*ranks[1].client, 1, 2);
    answers[1] = ranks[1].client->Commit("");
  });
  WriteShards(*ranks[0].client, 0, 2);
  answers[0] = ranks[0].client->Commit("");
  ASSERT_TRUE(answers[0].ok()) << answers[0].status();
  EXPECT_EQ(*answers[0], 2u);  // daemon 0 committed 2 and told its trainer
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (daemons_[1]->Log().find("paused between its agreement and its intent") ==
             std::string::npos &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_THAT(daemons_[1]->Log(), HasSubstr("paused between its agreement and its intent"));
  daemons_[1]->Kill();
  rank1.join();
  EXPECT_FALSE(answers[1].ok());
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  EXPECT_THAT(daemons_[1]->Log(), HasSubstr("voted 2"));
  JoinAll(ranks);
  ExpectEveryRankKeptItsModule(ranks);
  Register(ranks, 2);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    Snapshot now = Take(*ranks[r].client);
    EXPECT_EQ(now.generation, 2u);
    absl::StatusOr<ShardViews> views = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    for (const UnitShardView& u : *views) {
      const float* data = static_cast<const float*>(u.data);
      for (int64_t i = 0; i < u.shard_numel; ++i) {
        ASSERT_EQ(data[i], Value(2, r, u.unit, i)) << "unit " << u.unit << " element " << i;
      }
    }
  }
  EXPECT_THAT(daemons_[1]->Log(), HasSubstr("rolled forward to generation 2"));
  Commit(ranks, 3);  // and the group goes on
}

// ---- Optimizer state in the restart records (RegisterState buffers) ----

// kill -9 after commits, with uncommitted optimizer state (and shard) writes on top: the
// restarted daemon gives every rank its committed optimizer state bit for bit, as a restarted
// trainer using keep_optimizer_state reads it; the uncommitted writes are gone.
TEST_F(StateRestartTest, KillNineKeepsTheCommittedOptimizerStateBitForBit) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  RegisterStateAll(ranks);
  TrainWithState(ranks, 1, 3);
  const std::vector<Snapshot> committed = Expected(ranks);
  const std::vector<std::vector<std::string>> state = StateOf(ranks);
  RunRanks(kWorld, [&](int r) {
    optstate::WriteState(*ranks[r].client, r, 77);  // never committed
    WriteShards(*ranks[r].client, r, 77);
  });
  ASSERT_NE(StateOf(ranks), state);
  ranks.clear();
  d->Kill();
  {
    server::state::StateDir::Loaded l =
        (*server::state::StateDir::Open(state_dir_.string()))->LoadAll();
    ASSERT_THAT(l.groups, SizeIs(1));
    EXPECT_EQ(l.groups[0].modules[0].state_specs.size(), 3u);
  }
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("group=g adopted from"));
  // Per unit: shard, gradient, committed copy, and a live and a committed buffer per state;
  // and the kept summon and staging buffers the record lists (adopted when still resident).
  EXPECT_GE(d->Segments().size(), kWorld * committed[0].shards.size() * (3 + 2 * 3));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 3);
  ExpectStateReattached(ranks, 3, state);
  for (int r = 0; r < kWorld; ++r) {
    Snapshot now = Take(*ranks[r].client);
    for (size_t u = 0; u < now.shards.size(); ++u) {
      EXPECT_TRUE(now.shards[u] == committed[r].shards[u]) << "rank " << r << " unit " << u;
    }
  }
  // Training goes on with the state; a second kill keeps step 4's.
  TrainWithState(ranks, 4, 4);
  const std::vector<std::vector<std::string>> state4 = StateOf(ranks);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 4);
  ExpectStateReattached(ranks, 4, state4);
}

// kill -9 while a commit's copies are torn (--testing_commit_copy_pause): the restart finishes
// the copy of the optimizer state from the live buffers too (internal::DurableBuffers).
TEST_F(StateRestartTest, KillNineDuringACommitCopyFinishesTheStateFromItsLiveBuffers) {
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--testing_commit_copy_pause=30s"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  RegisterStateAll(ranks);
  RunRanks(kWorld, [&](int r) {
    WriteShards(*ranks[r].client, r, 1);
    optstate::WriteState(*ranks[r].client, r, 1);
  });
  const std::vector<std::vector<std::string>> step1 = StateOf(ranks);
  ASSERT_NO_FATAL_FAILURE(KillDuringACommitCopyAndRestart(*d, ranks, 1));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 1);
  ExpectStateReattached(ranks, 1, step1);
}

// Records that do not check out for the optimizer state: refused, the group not adopted.
class StateRefusedTest : public StateRestartTest {
 protected:
  void Run(const std::function<void()>& breakit, const std::string& log_text) {
    std::unique_ptr<DaemonProcess> d = StartDaemon();
    std::vector<Rank> ranks;
    JoinAll(*d, ranks, 0);
    RegisterAll(ranks, 0);
    RegisterStateAll(ranks);
    TrainWithState(ranks, 1, 1);
    ranks.clear();
    d->Kill();
    breakit();
    ASSERT_TRUE(Restart(*d));
    const std::string log = d->Log();
    EXPECT_THAT(log, HasSubstr(log_text));
    EXPECT_THAT(log, HasSubstr("not adopted"));
    EXPECT_THAT(log, Not(HasSubstr("group=g adopted")));
    JoinAll(*d, ranks, 0);  // nothing adopted: never without its state
  }
  server::state::BufferRecord& Find(server::state::GroupRecord& rec, int rank, int unit,
                                    const std::string& role) {
    for (server::state::BufferRecord& b : rec.modules[0].ranks[rank].units[unit].buffers) {
      if (b.role == role) return b;
    }
    ADD_FAILURE() << "no " << role << " buffer recorded";
    return rec.modules[0].ranks[rank].units[unit].buffers[0];
  }
  server::state::GroupRecord Load() {
    server::state::StateDir::Loaded l =
        (*server::state::StateDir::Open(state_dir_.string()))->LoadAll();
    EXPECT_THAT(l.groups, SizeIs(1));
    return l.groups.at(0);
  }
  void Store(server::state::GroupRecord rec) {
    rec.sequence += 1;
    ASSERT_TRUE((*server::state::StateDir::Open(state_dir_.string()))->Write(rec).ok());
  }
};

TEST_F(StateRefusedTest, ATruncatedStateSegment) {
  Run(
      [&] {
        server::state::GroupRecord rec = Load();
        const std::string seg = "/dev/shm" + Find(rec, 1, 2, "committed_state:exp_avg").segment;
        ASSERT_EQ(::truncate(seg.c_str(), 8), 0) << seg;
      },
      "committed_state:exp_avg");
}

TEST_F(StateRefusedTest, AStateBufferWhoseRecordedSizeIsNotItsSpecs) {
  Run(
      [&] {
        server::state::GroupRecord rec = Load();
        Find(rec, 0, 1, "state:step").bytes = 4;  // an int64 scalar has 8
        Store(std::move(rec));
      },
      "4 bytes recorded, optimizer state \"step\" (int64, scalar) has 8");
}

TEST_F(StateRefusedTest, ARankWithSomeButNotAllOfItsStateBuffers) {
  Run(
      [&] {
        server::state::GroupRecord rec = Load();
        std::vector<server::state::BufferRecord>& b = rec.modules[0].ranks[1].units[0].buffers;
        b.erase(std::remove_if(b.begin(), b.end(),
                               [](const server::state::BufferRecord& x) {
                                 return x.role == "committed_state:exp_avg_sq";
                               }),
                b.end());
        Store(std::move(rec));
      },
      "rank 1: some but not all of its optimizer state buffers are recorded: 1 missing "
      "(unit 0 committed_state:exp_avg_sq)");
}

// A GPU daemon (simulated GPUs) keeps host copies of the committed device optimizer state at
// SIGTERM with --keep_shards, next to the shards', and the next daemon puts them back on the
// devices; without the host copies made at each commit (--gpu_host_copies=false) kill -9 keeps
// nothing of it (device memory dies with the process).
TEST_F(StateRestartTest, GpuDaemonKeepsHostCopiesOfItsCommittedStateOnSigterm) {
  simulated_gpus_ = true;
  std::unique_ptr<DaemonProcess> d = StartDaemon({"--simulate_gpus=2", "--gpu_host_copies=false"});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  RegisterStateAll(ranks);
  TrainWithState(ranks, 1, 2);
  const std::vector<std::vector<std::string>> state = StateOf(ranks);
  RunRanks(kWorld, [&](int r) { optstate::WriteState(*ranks[r].client, r, 55); });
  RunRanks(kWorld, [&](int r) { ASSERT_TRUE(ranks[r].client->Leave().ok()); });
  ranks.clear();
  EXPECT_EQ(d->Terminate(), 0);
  EXPECT_THAT(d->Log(), HasSubstr("kept host copies of the committed device shards of 2 rank(s)"));
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("group=g adopted from"));
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 2);
  ExpectStateReattached(ranks, 2, state);
  TrainWithState(ranks, 3, 3);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  JoinAll(*d, ranks, 0);
}

// ---- Checkpoint loads write the group's record ----

// A load is a committed step: after it, a kill -9 and a restart, every rank re-attaches at the
// loaded generation with the loaded values (not at the pre-load generation and values).
TEST_F(RestartTest, KillNineAfterACheckpointLoadReattachesAtTheLoadedGeneration) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  const std::filesystem::path ckpt = state_dir_.string() + ".ckpt";
  absl::StatusOr<Client::CheckpointInfo> saved = ranks[0].client->SaveCheckpoint("", ckpt.string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->generation, 2u);
  // Step 2's shards, without step 2's gradients (a load does not touch gradient shards).
  std::vector<Snapshot> loaded = Expected(ranks);
  Train(ranks, 3, 5);
  const std::vector<Snapshot> step5 = Expected(ranks);
  for (int r = 0; r < kWorld; ++r) loaded[r].grads = step5[r].grads;
  absl::StatusOr<Client::CheckpointInfo> load = ranks[1].client->LoadCheckpoint("", ckpt.string());
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_EQ(load->generation, 2u);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("generation 2)"));
  ExpectReattached(*d, ranks, 2, loaded);
  std::error_code ignored;
  std::filesystem::remove_all(ckpt, ignored);
}

// A record with a "load" intent (Records::NoteLoadCopying: the generation the shards hold
// completely, written before a load stages its values in the committed copies) is finished from
// the shards at restart: the committed copies are restored from them, never left torn. The
// test writes such an intent by hand, at a generation (7) the shards are made to hold.
TEST_F(RestartTest, ALoadIntentInTheRecordIsFinishedFromTheShards) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 1);
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 9); });  // "loaded" values
  std::vector<Snapshot> want = Expected(ranks);
  ranks.clear();
  d->Kill();
  {
    // As NoteLoadCopying leaves it: the intent durable, the committed copies at step 1.
    std::unique_ptr<server::state::StateDir> dir =
        *server::state::StateDir::Open(state_dir_.string());
    server::state::GroupRecord rec = dir->LoadAll().groups.at(0);
    rec.modules[0].pending = server::state::PendingCommit{7, "load", {0, 1}, {}};
    rec.sequence += 1;
    ASSERT_TRUE(dir->Write(rec).ok());
  }
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("finished the load of generation 7 from its shards"));
  ExpectReattached(*d, ranks, 7, want);
}

// Two daemons with optimizer state: daemon 1 is killed after two commits (uncommitted state
// writes on both ranks), restarted, and the group re-forms: the restarted daemon's rank finds
// its committed state from its record, the survivor's is rolled back to its committed state.
TEST_F(TwoDaemonRestartTest, TheRestartedDaemonsOptimizerStateComesBackAtTheCommittedStep) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  Register(ranks, 0);
  RunRanks(2, [&](int r) {
    absl::StatusOr<ShardViews> v = ranks[r].client->RegisterState("", optstate::Specs());
    ASSERT_TRUE(v.ok()) << "rank " << r << ": " << v.status();
  });
  std::vector<std::vector<std::string>> committed(2);
  for (uint64_t g = 1; g <= 2; ++g) {
    RunRanks(2, [&](int r) { optstate::WriteState(*ranks[r].client, r, g); });
    Commit(ranks, g);
  }
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<ShardViews> v = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(v.ok()) << v.status();
    committed[r] = optstate::TakeState(*v);
  }
  RunRanks(2, [&](int r) { optstate::WriteState(*ranks[r].client, r, 66); });  // uncommitted
  daemons_[1]->Kill();
  ranks[1] = Rank();
  ASSERT_TRUE(RestartDaemon1());
  JoinAll(ranks);
  Register(ranks, 2);
  RunRanks(2, [&](int r) {
    absl::StatusOr<ShardViews> v = ranks[r].client->RegisterState("", optstate::Specs());
    ASSERT_TRUE(v.ok()) << "rank " << r << ": " << v.status();
    EXPECT_EQ(v->generation(), 2u) << "rank " << r;
    const std::vector<std::string> now = optstate::TakeState(*v);
    ASSERT_EQ(now.size(), committed[r].size()) << "rank " << r;
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_TRUE(now[i] == committed[r][i]) << "rank " << r << " state buffer " << i;
    }
  });
  RunRanks(2, [&](int r) { optstate::WriteState(*ranks[r].client, r, 3); });
  Commit(ranks, 3);
}

}  // namespace
}  // namespace flatshard::client
