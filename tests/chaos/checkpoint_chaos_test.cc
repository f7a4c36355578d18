// Chaos tests of issue 14's checkpoints: the daemon is killed with SIGKILL while it writes a
// checkpoint, and while it loads one, then restarted with the same --state_dir.
//  - Killed during a save: the incomplete checkpoint is refused on load (an error naming the
//    file and the check), or, when the kill came after its metadata was written, it loads
//    and holds exactly the generation it saved; the previous complete checkpoint still loads
//    bit for bit.
//  - Killed during a load: after the restart every rank re-attaches to one committed
//    generation: either the one before the load or the loaded one, the same on every rank,
//    and every parameter element holds exactly that generation's value (never a mix).
// Real flatshardd processes; the ranks are threads of this test (the daemon is the process
// that dies). FS_CHAOS_CKPT_TRIALS (default 3) trials per test, FS_CHAOS_SEED.

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/chaos/chaos_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::chaos {
namespace {

using ::flatshard::client::Client;
using ::flatshard::client::ClientOptions;
using ::flatshard::client::InitMode;
using ::flatshard::client::RegisteredModule;
using ::flatshard::client::ShardViews;
using ::flatshard::testing::RunRanks;

constexpr int kWorld = 3;
constexpr char kToken[] = "ckpt-chaos";
constexpr int kBlocks = 3;
constexpr int kCols = 1024;

// 2048 rows: 8 MiB per block unit, about 24 MiB per checkpoint, so a kill lands inside it.
int Rows() { return std::max(1, EnvInt("FS_CHAOS_CKPT_ROWS", 2048)); }

struct Rank {
  std::unique_ptr<Client> client;
  RegisteredModule module;
};

// Every rank: a fresh client joins and registers (re-attaching, or initialising at
// generation 0). Returns the generation each rank re-attached to.
std::vector<int64_t> AttachAll(ChaosCluster& cluster, const std::string& group,
                               std::vector<Rank>& ranks) {
  const std::string manifest = ChaosManifest(kBlocks, Rows(), kCols);
  std::vector<int64_t> generation(kWorld, -1);
  ranks.clear();
  ranks.resize(kWorld);
  RunRanks(kWorld, [&](int r) {
    ClientOptions o;
    o.address = cluster.AddressFor(r);
    o.call_timeout = absl::Seconds(30);
    o.join_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
    ranks[r].client = *std::move(c);
    absl::Status j = ranks[r].client->Join(group, kWorld, r, kToken, cluster.coordinator());
    ASSERT_TRUE(j.ok()) << "rank " << r << ": " << j;
    EXPECT_TRUE(ranks[r].client->lost_modules().empty())
        << "rank " << r << ": " << ranks[r].client->lost_modules()[0];
    absl::StatusOr<RegisteredModule> m =
        ranks[r].client->Register("", manifest, ChaosPolicy(), InitMode::kFromRank0);
    ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
    ranks[r].module = *std::move(m);
    generation[r] = static_cast<int64_t>(ranks[r].module.generation);
    if (ranks[r].module.init_summon != nullptr) {
      if (r == 0) FillFull(*ranks[r].module.plan, *ranks[r].module.init_summon, 0);
      absl::Status e = ranks[r].module.init_summon->End();
      ranks[r].module.init_summon.reset();
      ASSERT_TRUE(e.ok()) << "rank " << r << ": " << e;
      generation[r] = 0;
    }
  });
  return generation;
}

void LeaveAll(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) {
    r.module = RegisteredModule();
    if (r.client != nullptr) r.client->Leave().IgnoreError();
    r.client.reset();
  }
}

// One optimizer step on every rank: its shards take the value of the next generation, then
// Commit. Returns the generation committed.
uint64_t Step(std::vector<Rank>& ranks) {
  std::vector<uint64_t> committed(kWorld, 0);
  RunRanks(kWorld, [&](int r) {
    absl::StatusOr<ShardViews> v = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(v.ok()) << "rank " << r << ": " << v.status();
    WriteShards(*v, v->generation() + 1, 0);
    WriteShards(*v, v->generation() + 1, 1);
    absl::StatusOr<uint64_t> c = ranks[r].client->Commit("");
    ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
    EXPECT_EQ(*c, v->generation() + 1) << "rank " << r;
    committed[r] = *c;
  });
  return committed[0];
}

// Which value generation every parameter element of every rank's shards holds: one of
// `candidates`, the same for all; "" and *which set when so, else what differs.
std::string ShardsHoldOneOf(std::vector<Rank>& ranks, const std::vector<uint64_t>& candidates,
                            uint64_t* which) {
  std::vector<std::string> bad(kWorld);
  std::vector<int64_t> found(kWorld, -1);
  RunRanks(kWorld, [&](int r) {
    absl::StatusOr<ShardViews> v = ranks[r].client->GetShardViews("");
    if (!v.ok()) {
      bad[r] = absl::StrCat("GetShardViews: ", v.status().ToString());
      return;
    }
    for (uint64_t g : candidates) {
      if (CheckShards(*ranks[r].module.plan, *v, g).empty()) {
        found[r] = static_cast<int64_t>(g);
        return;
      }
    }
    bad[r] = absl::StrCat("its shards hold none of the candidate generations entirely (",
                          CheckShards(*ranks[r].module.plan, *v, candidates[0]), ")");
  });
  for (int r = 0; r < kWorld; ++r) {
    if (!bad[r].empty()) return absl::StrCat("rank ", r, ": ", bad[r]);
    if (found[r] != found[0]) {
      return absl::StrCat("rank 0 holds generation ", found[0], "'s values, rank ", r, " ",
                          found[r], "'s: a mix");
    }
  }
  *which = static_cast<uint64_t>(found[0]);
  return "";
}

// Runs `call` (a save or a load by rank 0's client) on a thread and kills daemon 0 once
// `fraction` (0..1) of its bytes are done, or after `delay` when fraction < 0. Returns the
// call's status and whether the kill came before it finished.
struct KilledCall {
  absl::Status status;
  bool killed_during = false;
  int64_t done_bytes = 0;
  int64_t total_bytes = 0;
};
KilledCall KillDuring(
    ChaosCluster& cluster, double fraction, absl::Duration delay,
    const std::function<absl::Status(const Client::CheckpointProgressFn&)>& call) {
  std::atomic<int64_t> done_bytes{0};
  std::atomic<int64_t> total_bytes{0};
  std::atomic<bool> finished{false};
  absl::Status status;
  std::thread t([&] {
    status = call([&](int64_t done, int64_t total) {
      done_bytes = done;
      total_bytes = total;
    });
    finished = true;
  });
  const absl::Time start = absl::Now();
  const absl::Time give_up = start + absl::Seconds(60);
  for (;;) {
    if (finished || absl::Now() > give_up) break;
    if (fraction < 0 && absl::Now() - start >= delay) break;
    if (fraction >= 0 && total_bytes > 0 &&
        static_cast<double>(done_bytes) >= fraction * static_cast<double>(total_bytes)) {
      break;
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  KilledCall out;
  out.killed_during = !finished;
  out.done_bytes = done_bytes;
  out.total_bytes = total_bytes;
  cluster.Kill(0);
  t.join();
  out.status = status;
  return out;
}

class CheckpointChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!DaemonHasStateDir()) GTEST_SKIP() << "flatshardd has no --state_dir yet";
    seed_ = Env("FS_CHAOS_SEED").empty()
                ? static_cast<uint32_t>(absl::ToUnixMicros(absl::Now()))
                : static_cast<uint32_t>(std::atoll(Env("FS_CHAOS_SEED").c_str()));
    trials_ = std::max(1, EnvInt("FS_CHAOS_CKPT_TRIALS", 3));
    ckpt_root_ = std::filesystem::temp_directory_path() /
                 absl::StrCat("fsckptchaos", getpid(), "x",
                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(ckpt_root_);
    std::printf("checkpoint chaos: seed %u, %d trials\n", seed_, trials_);
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(ckpt_root_, ignored);
  }
  std::string Dir(const std::string& name) const { return (ckpt_root_ / name).string(); }

  uint32_t seed_ = 0;
  int trials_ = 3;
  std::filesystem::path ckpt_root_;
};

TEST_F(CheckpointChaosTest, KillDuringSaveRefusesTheTornCheckpointAndTheLastCompleteOneLoads) {
  ChaosCluster cluster(1, {});
  std::mt19937 rng(seed_);
  std::map<std::string, int> count;
  for (int trial = 0; trial < trials_; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial, " (seed ", seed_, ")"));
    const std::string group = absl::StrCat("cs", trial);
    std::vector<Rank> ranks;
    std::vector<int64_t> g = AttachAll(cluster, group, ranks);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(g[0], 0);
    Step(ranks);
    const uint64_t saved = Step(ranks);  // generation 2
    const std::string complete = Dir(absl::StrCat("complete", trial));
    const absl::Time save_start = absl::Now();
    absl::StatusOr<Client::CheckpointInfo> a = ranks[0].client->SaveCheckpoint("", complete);
    const absl::Duration save_time = absl::Now() - save_start;
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->generation, saved);
    const uint64_t live = Step(ranks);  // generation 3: what the torn save holds
    const absl::Duration scale = save_time;
    // The kill: at a random fraction of the bytes reported done (1 in 4), else after a random
    // delay within 1.2x the time an uninterrupted save of the same bytes took.
    const double fraction = (rng() % 4 == 0) ? (rng() % 1000) / 1000.0 : -1.0;
    const double u = (rng() % 1000) / 1000.0;
    const absl::Duration delay = scale * 1.2 * (u * u);  // early kills more often
    const std::string torn = Dir(absl::StrCat("torn", trial));
    KilledCall k = KillDuring(cluster, fraction, delay, [&](const auto& progress) {
      return ranks[0].client->SaveCheckpoint("", torn, progress).status();
    });
    ++count[k.killed_during ? "killed_during_save" : "killed_after_save"];
    std::printf(
        "trial %d: save of %s killed after %s (an uninterrupted save took %s)%s\n", trial,
        torn.c_str(), absl::FormatDuration(fraction < 0 ? delay : absl::ZeroDuration()).c_str(),
        absl::FormatDuration(save_time).c_str(), k.killed_during ? "" : ", after it returned");
    LeaveAll(ranks);
    ASSERT_TRUE(cluster.Restart(0));
    // Every rank re-attaches to the live committed generation.
    g = AttachAll(cluster, group, ranks);
    ASSERT_FALSE(HasFatalFailure());
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(g[r], static_cast<int64_t>(live)) << "rank " << r;
    uint64_t holds = 0;
    std::string bad = ShardsHoldOneOf(ranks, {live}, &holds);
    EXPECT_EQ(bad, "") << "after the restart";
    // The torn checkpoint: refused naming the file and the check, or (metadata written
    // before the kill) complete with the live generation.
    absl::StatusOr<Client::CheckpointInfo> t = ranks[0].client->LoadCheckpoint("", torn);
    if (t.ok()) {
      ++count["torn_save_complete_loaded"];
      EXPECT_EQ(t->generation == live || t->generation == live + 1, true)
          << "a checkpoint saved at generation " << live << " loaded as " << t->generation;
      bad = ShardsHoldOneOf(ranks, {live}, &holds);
      EXPECT_EQ(bad, "") << "the checkpoint written before the kill loaded other values";
    } else {
      ++count[absl::StrCat("torn_save_refused.", absl::StatusCodeToString(t.status().code()))];
      std::printf("trial %d: the torn checkpoint (%lld of %lld bytes at the kill) refused: %s\n",
                  trial, static_cast<long long>(k.done_bytes),
                  static_cast<long long>(k.total_bytes), t.status().ToString().c_str());
      EXPECT_TRUE(absl::StrContains(t.status().message(), torn) ||
                  absl::StrContains(t.status().message(), "metadata.json") ||
                  absl::StrContains(t.status().message(), ".bin"))
          << "the refusal names no file: " << t.status();
      // Nothing changed by the refused load.
      bad = ShardsHoldOneOf(ranks, {live}, &holds);
      EXPECT_EQ(bad, "") << "a refused load changed the shards";
    }
    // The last complete checkpoint loads, bit for bit.
    absl::StatusOr<Client::CheckpointInfo> c = ranks[0].client->LoadCheckpoint("", complete);
    ASSERT_TRUE(c.ok()) << c.status();
    bad = ShardsHoldOneOf(ranks, {saved}, &holds);
    EXPECT_EQ(bad, "") << "the complete checkpoint of generation " << saved;
    LeaveAll(ranks);
  }
  std::string summary;
  for (const auto& [k, v] : count) absl::StrAppend(&summary, k, "=", v, " ");
  std::printf("checkpoint chaos, kill during save: %s\n", summary.c_str());
}

TEST_F(CheckpointChaosTest, KillDuringLoadLeavesEveryRankAtOneCommittedGeneration) {
  ChaosCluster cluster(1, {});
  std::mt19937 rng(seed_ + 1);
  std::map<std::string, int> count;
  for (int trial = 0; trial < trials_; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial, " (seed ", seed_, ")"));
    const std::string group = absl::StrCat("cl", trial);
    std::vector<Rank> ranks;
    std::vector<int64_t> g = AttachAll(cluster, group, ranks);
    ASSERT_FALSE(HasFatalFailure());
    Step(ranks);
    const uint64_t saved = Step(ranks);  // generation 2
    const std::string dir = Dir(absl::StrCat("ckpt", trial));
    const absl::Time save_start = absl::Now();
    absl::StatusOr<Client::CheckpointInfo> a = ranks[0].client->SaveCheckpoint("", dir);
    const absl::Duration save_time = absl::Now() - save_start;
    ASSERT_TRUE(a.ok()) << a.status();
    // An uninterrupted load of the same checkpoint (the values are generation 2's already)
    // gives the time scale of the kill.
    const absl::Time load_start = absl::Now();
    absl::StatusOr<Client::CheckpointInfo> warm = ranks[0].client->LoadCheckpoint("", dir);
    const absl::Duration scale = absl::Now() - load_start;
    ASSERT_TRUE(warm.ok()) << warm.status();
    (void)save_time;
    Step(ranks);
    const uint64_t live = Step(ranks);
    // The kill: at a random fraction of the bytes reported done (1 in 4), else after a random
    // delay within 1.2x the time an uninterrupted save of the same bytes took.
    const double fraction = (rng() % 4 == 0) ? (rng() % 1000) / 1000.0 : -1.0;
    const double u = (rng() % 1000) / 1000.0;
    const absl::Duration delay = scale * 1.2 * (u * u);  // early kills more often
    KilledCall k = KillDuring(cluster, fraction, delay, [&](const auto& progress) {
      return ranks[0].client->LoadCheckpoint("", dir, progress).status();
    });
    ++count[k.killed_during ? "killed_during_load" : "killed_after_load"];
    LeaveAll(ranks);
    ASSERT_TRUE(cluster.Restart(0));
    g = AttachAll(cluster, group, ranks);
    ASSERT_FALSE(HasFatalFailure());
    for (int r = 1; r < kWorld; ++r) EXPECT_EQ(g[r], g[0]) << "rank " << r;
    uint64_t holds = 0;
    const std::string bad = ShardsHoldOneOf(ranks, {live, saved}, &holds);
    EXPECT_EQ(bad, "") << "killed at " << k.done_bytes << " of " << k.total_bytes
                       << " bytes of the load";
    if (bad.empty()) {
      ++count[holds == live ? "reattached_before_load" : "reattached_loaded"];
      std::printf(
          "trial %d: load killed at %lld of %lld bytes: re-attached at generation %lld "
          "holding generation %llu's values\n",
          trial, static_cast<long long>(k.done_bytes), static_cast<long long>(k.total_bytes),
          static_cast<long long>(g[0]), static_cast<unsigned long long>(holds));
      if (holds == live) {
        EXPECT_EQ(g[0], static_cast<int64_t>(live)) << "the generation does not match the values";
      }
    }
    LeaveAll(ranks);
  }
  std::string summary;
  for (const auto& [k, v] : count) absl::StrAppend(&summary, k, "=", v, " ");
  std::printf("checkpoint chaos, kill during load: %s\n", summary.c_str());
}

// A load makes the module's generation the checkpoint's (README "Checkpoints") and writes the
// committed copies; the daemon's state record must say so, else a restart would re-attach at
// the generation from before the load (4) with the checkpoint's values (generation 2's): one
// generation number for two different states (found by this test; fixed by the load intent).
TEST_F(CheckpointChaosTest, RestartAfterALoadKeepsTheCheckpointsGeneration) {
  ChaosCluster cluster(1, {});
  std::vector<Rank> ranks;
  AttachAll(cluster, "lg", ranks);
  ASSERT_FALSE(HasFatalFailure());
  Step(ranks);
  const uint64_t saved = Step(ranks);
  const std::string dir = Dir("ckpt");
  ASSERT_TRUE(ranks[0].client->SaveCheckpoint("", dir).ok());
  Step(ranks);
  Step(ranks);
  absl::StatusOr<Client::CheckpointInfo> loaded = ranks[0].client->LoadCheckpoint("", dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->generation, saved);
  uint64_t holds = 0;
  EXPECT_EQ(ShardsHoldOneOf(ranks, {saved}, &holds), "");
  LeaveAll(ranks);
  cluster.Kill(0);
  ASSERT_TRUE(cluster.Restart(0));
  std::vector<int64_t> g = AttachAll(cluster, "lg", ranks);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(ShardsHoldOneOf(ranks, {saved}, &holds), "");
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(g[r], static_cast<int64_t>(saved))
        << "rank " << r << " re-attached at another generation than the loaded checkpoint's";
  }
  LeaveAll(ranks);
}

}  // namespace
}  // namespace flatshard::chaos
