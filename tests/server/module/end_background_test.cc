// Writeback Ends answer once their bytes are in the shards and copy them into the committed
// copies afterwards (server/module/pending_committed.h). Here the
// worker's copy is held (--testing_commit_copy_pause) while the trainers go on at once: a
// Commit, a rollback (another rank's session ends) and a second writeback End of the unit each
// finish it first, a checkpoint save waits for it, and the trainers' in-place writes right after
// the End never reach it. Values are compared to the element. Each test runs without and with
// a state directory (then the End's "done" record lists the held copy, state::DeferredRecord;
// kills while it is held: end_deferred_restart_test).

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::FloatCount;
using testing::Floats;
using testing::HoldsStep;
using testing::IdsOf;
using testing::WriteRankPattern;
using testing::WriteStep;

// [rank][unit]: every element of a rank's shards.
using Shards = std::vector<std::vector<std::vector<float>>>;

// The parameter: with a state directory.
class EndBackgroundTest : public testing::GroupManagerHarness,
                          public ::testing::WithParamInterface<bool> {
 protected:
  // Two ranks at generation 1, then a writeback End of every unit (generation 2) whose copy
  // into the committed copies is held for a while after the End answered.
  void StartAndEnd() {
    GroupManagerOptions options;
    options.testing_commit_copy_pause = absl::Milliseconds(200);
    if (GetParam()) UseStateDir();
    Start(std::move(options));
    c_ = JoinAndRegister("g", 2, &regs_);
    for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, 1, r);
    for (absl::StatusOr<uint64_t>& g : CommitAll(c_)) ASSERT_TRUE(g.ok()) << g.status();
    EndWriting(0);
    ASSERT_EQ(GenerationOf("g"), 2u);
  }
  // Every rank summons every unit with writeback, writes its pattern (plus `shift`) and ends.
  void EndWriting(float shift) {
    std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c_, "", SummonOptions{});
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(s[r].ok()) << s[r].status();
      WriteRankPattern(*s[r], r);
      for (const SummonedUnit& v : s[r]->views) {
        for (int64_t i = 0; i < FloatCount(*v.params); ++i) Floats(*v.params)[i] += shift;
      }
    }
    for (const absl::Status& e : EndAll(c_, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  }
  Shards Snapshot() const {
    Shards out(2);
    for (int r = 0; r < 2; ++r) {
      for (const UnitShard& u : regs_[r].shards) {
        out[r].emplace_back(Floats(*u.shard), Floats(*u.shard) + FloatCount(*u.shard));
      }
    }
    return out;
  }
  // Rank 1's session ends and it comes back: every rank is rolled back to its committed copies.
  void Reform() {
    ASSERT_TRUE(gm_->Leave(c_[1]).ok());
    std::vector<std::string> modules;
    c_[1] = Rejoin("g", 2, 1, &modules);
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(gm_->GetShards(c_[r], "").ok());
  }
  // `params_only`: the padding is left out (a checkpoint holds the parameters only).
  // Saves a checkpoint of module "" (it holds the committed copies only once no End's copy into
  // them is pending).
  absl::StatusOr<CheckpointResult> Save(bool load = false) {
    if (ckpt_.dir.empty()) {
      ckpt_.group = "g";
      ckpt_.module = "";
      ckpt_.dir = MakeTempDir("ckpt") + "/ckpt";
      ckpt_.privileged = true;
      ckpt_.wait = absl::Seconds(10);
    }
    CheckpointProgress progress;
    return load ? gm_->LoadCheckpoint(ckpt_, &progress) : gm_->SaveCheckpoint(ckpt_, &progress);
  }
  ::testing::AssertionResult ShardsAre(const Shards& want, bool params_only = false) const {
    const Shards got = Snapshot();
    for (int r = 0; r < 2; ++r) {
      for (size_t u = 0; u < got[r].size(); ++u) {
        const PlanUnit& unit = regs_[r].plan.units[regs_[r].shards[u].unit];
        for (size_t i = 0; i < got[r][u].size(); ++i) {
          if (params_only && r * unit.shard_numel + static_cast<int64_t>(i) >= unit.numel) break;
          if (got[r][u][i] != want[r][u][i]) {
            return ::testing::AssertionFailure()
                   << "rank " << r << " unit " << u << " element " << i << " holds " << got[r][u][i]
                   << ", expected " << want[r][u][i];
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  std::vector<RegisterResult> regs_;
  std::vector<Caller> c_;
  CheckpointArgs ckpt_;
};

// The optimizer steps the shards in place at once; a re-form right after restores exactly what
// the End wrote (the held copy neither read the shards nor was overtaken by the rollback).
TEST_P(EndBackgroundTest, ARollbackRightAfterTheEndRestoresWhatItWrote) {
  StartAndEnd();
  const Shards ended = Snapshot();
  for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, 3, r);  // never committed
  Reform();
  EXPECT_EQ(GenerationOf("g"), 2u);
  EXPECT_TRUE(ShardsAre(ended));
}

// A Commit at once copies the stepped shards only after the End's copy: a re-form after it
// restores the Commit's step, not the End's values (the save waits until the worker is done
// with the End's copy, so a copy landing after the Commit's would show).
TEST_P(EndBackgroundTest, ACommitRightAfterTheEndFinishesItsCopyFirst) {
  StartAndEnd();
  for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, 3, r);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c_)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 3u);
  }
  absl::StatusOr<CheckpointResult> saved = Save();
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->generation, 3u);
  for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, 4, r);  // never committed
  Reform();
  EXPECT_EQ(GenerationOf("g"), 3u);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(HoldsStep(regs_[r].shards, 3, r));
}

// A second writeback End of the unit at once lands after the first one's copy, so the
// committed copies end at the second End's values.
TEST_P(EndBackgroundTest, ASecondWritebackEndLandsAfterTheFirstOnesCopy) {
  StartAndEnd();
  EndWriting(0.5f);
  EXPECT_EQ(GenerationOf("g"), 3u);
  const Shards ended = Snapshot();
  for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, 5, r);
  Reform();
  EXPECT_EQ(GenerationOf("g"), 3u);
  EXPECT_TRUE(ShardsAre(ended));
}

// A checkpoint saved at once holds the End's generation completely: loaded after another
// committed step, it gives back exactly what the End wrote.
TEST_P(EndBackgroundTest, ACheckpointSavedRightAfterTheEndHoldsItsGeneration) {
  StartAndEnd();
  const Shards ended = Snapshot();
  absl::StatusOr<CheckpointResult> saved = Save();
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->generation, 2u);
  for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, 3, r);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c_)) ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<CheckpointResult> loaded = Save(/*load=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->generation, 2u);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(gm_->GetShards(c_[r], "").ok());
  EXPECT_TRUE(ShardsAre(ended, /*params_only=*/true));
}

// Steps back to back (summon, write, End, in-place step, Commit), the copies held each time:
// every generation counts once and the last commit is what a re-form restores.
TEST_P(EndBackgroundTest, StepsBackToBackCommitEachGenerationOnce) {
  StartAndEnd();
  for (uint64_t step = 3; step <= 6; step += 2) {
    EndWriting(static_cast<float>(step));
    for (int r = 0; r < 2; ++r) WriteStep(regs_[r].shards, step + 1, r);
    for (absl::StatusOr<uint64_t>& g : CommitAll(c_)) {
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(*g, step + 1);
    }
  }
  Reform();
  EXPECT_EQ(GenerationOf("g"), 6u);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(HoldsStep(regs_[r].shards, 6, r));
}

INSTANTIATE_TEST_SUITE_P(StateDir, EndBackgroundTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "WithStateDir" : "Ephemeral";
                         });

}  // namespace
}  // namespace flatshard::server
