// GroupManager's Summon and EndSummon through its public API (GroupManagerHarness): which units
// a path selects, writeback of each rank's own range (an agreed End commits), read-only summons
// sharing one copy, rank0_only, offload_to_cpu, nested summons refused, an End missing a rank,
// NO_SHARD; and the summon's allocations outside the lock (one node copy made once, a failed
// allocation leaves no trace).

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using ::testing::ElementsAre;
using testing::FloatCount;
using testing::Floats;
using ::testing::HasSubstr;
using testing::Holds;
using testing::IdsOf;
using ::testing::IsEmpty;
using testing::kTestPolicy;
using testing::kWait;
using testing::RegisterCall;
using testing::RunTogether;
using testing::StatusCall;
using testing::SummonCall;
using testing::TestManifest;
using testing::UnitsOf;
using testing::WriteRankPattern;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, RecurseSelectsTheSubtreeOrTheUnitRootedAtThePath) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  struct Case {
    std::string path;
    bool recurse;
    std::vector<int32_t> units;
  };
  for (const Case& k :
       {Case{"", true, {0, 1, 2, 3, 4}}, Case{"", false, {0}}, Case{"enc", true, {1, 2, 3}},
        Case{"enc", false, {1}}, Case{"enc.l2", true, {3}}, Case{"head", false, {4}}}) {
    std::vector<absl::StatusOr<SummonResult>> s =
        SummonAll(c, k.path, SummonOptions{.recurse = k.recurse, .writeback = false});
    EXPECT_EQ(UnitsOf(s), k.units) << "path " << k.path << " recurse " << k.recurse;
    for (const absl::StatusOr<SummonResult>& r : s) {
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->views.size(), k.units.size());
      for (size_t i = 0; i < k.units.size(); ++i) EXPECT_EQ(r->views[i].unit, k.units[i]);
    }
    for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  }
  SummonCall unknown;
  gm_->Summon(c[0], "", "enc.nope", SummonOptions{}, Deadline(), unknown.Callback());
  ASSERT_EQ(unknown.Wait().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.Wait().status().message(),
            "module \"\" (the root) has no submodule \"enc.nope\"");
  SummonCall unregistered;
  gm_->Summon(c[0], "other", "", SummonOptions{}, Deadline(), unregistered.Callback());
  EXPECT_EQ(unregistered.Wait().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(GroupManagerTest, WritebackKeepsEachRanksOwnRangeAndCommits) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 3, &regs);
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{});
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(s[rank].ok()) << s[rank].status();
    for (int other = 0; other < rank; ++other) {
      EXPECT_NE(s[rank]->views[2].params.get(), s[other]->views[2].params.get())
          << "writeback views must be private to each rank";
    }
    WriteRankPattern(*s[rank], rank);
  }
  EXPECT_EQ(gm_->GetStats().open_summons, 3);
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  EXPECT_EQ(gm_->GetStats().open_summons, 0);
  // Element i of a unit is owned by rank i / shard_numel: only that rank's write persists.
  std::vector<std::vector<float>> full = ReadAll(c);
  ASSERT_EQ(full.size(), 5u);
  for (int u = 1; u < 5; ++u) {
    const PlanUnit& unit = regs[0].plan.units[u];
    for (int64_t i = 0; i < unit.numel; ++i) {
      ASSERT_EQ(full[u][i], 1000 * (i / unit.shard_numel) + i) << "unit " << u << " index " << i;
    }
  }
  // An agreed writeback End commits: the generation went up on every rank.
  for (const Caller& x : c) EXPECT_EQ(gm_->GetShards(x, "")->generation, 1u);
}

TEST_F(GroupManagerTest, ReadOnlySummonSharesOneCopyAndChangesNoShard) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  for (int rank = 0; rank < 2; ++rank) {
    for (const UnitShard& u : regs[rank].shards) {
      for (int64_t i = 0; i < FloatCount(*u.shard); ++i) Floats(*u.shard)[i] = 5.0f;
    }
  }
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{.writeback = false});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  for (size_t u = 1; u < s[0]->views.size(); ++u) {
    EXPECT_EQ(s[0]->views[u].params.get(), s[1]->views[u].params.get())
        << "unit " << u << ": the local ranks must share one read-only copy";
    const PlanUnit& unit = regs[0].plan.units[u];
    for (int64_t i = 0; i < unit.numel; ++i) ASSERT_EQ(Floats(*s[0]->views[u].params)[i], 5.0f);
  }
  // Edits of a read-only summon are not written back, and its End waits for nobody.
  WriteRankPattern(*s[0], 9);
  StatusCall end0;
  gm_->EndSummon(c[0], s[0]->summon, Deadline(), end0.Callback());
  EXPECT_TRUE(end0.Wait().ok()) << end0.Wait();
  StatusCall end1;
  gm_->EndSummon(c[1], s[1]->summon, Deadline(), end1.Callback());
  EXPECT_TRUE(end1.Wait().ok()) << end1.Wait();
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[rank], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 0u) << "a read-only End committed";
    for (const UnitShard& u : v->shards) {
      for (int64_t i = 0; i < FloatCount(*u.shard); ++i) ASSERT_EQ(Floats(*u.shard)[i], 5.0f);
    }
  }
  // An ended summon is gone; a repeated End of it is NOT_FOUND.
  StatusCall again;
  gm_->EndSummon(c[0], s[0]->summon, Deadline(), again.Callback());
  EXPECT_EQ(again.Wait().code(), absl::StatusCode::kNotFound);
}

TEST_F(GroupManagerTest, Rank0OnlyGathersToRank0AndItsWritebackReachesEveryShard) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 3, &regs);
  // Distinct values per rank: rank r's shard holds r + 1.
  for (int rank = 0; rank < 3; ++rank) {
    for (const UnitShard& u : regs[rank].shards) {
      for (int64_t i = 0; i < FloatCount(*u.shard); ++i) Floats(*u.shard)[i] = rank + 1;
    }
  }
  std::vector<absl::StatusOr<SummonResult>> s =
      SummonAll(c, "enc", SummonOptions{.writeback = false, .rank0_only = true});
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(s[rank].ok()) << s[rank].status();
    EXPECT_THAT(s[rank]->units, ElementsAre(1, 2, 3));
    EXPECT_EQ(s[rank]->views.size(), rank == 0 ? 3u : 0u) << "rank " << rank;
  }
  for (const SummonedUnit& v : s[0]->views) {
    const PlanUnit& unit = regs[0].plan.units[v.unit];
    for (int64_t i = 0; i < unit.padded_numel; ++i) {
      ASSERT_EQ(Floats(*v.params)[i], i / unit.shard_numel + 1) << "unit " << v.unit;
    }
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  // beyond FSDP: writeback with rank0_only; rank 0's edits reach every rank's shard.
  s = SummonAll(c, "", SummonOptions{.rank0_only = true});
  ASSERT_TRUE(s[0].ok()) << s[0].status();
  for (const SummonedUnit& v : s[0]->views) {
    for (int64_t i = 0; i < FloatCount(*v.params); ++i) Floats(*v.params)[i] = -i;
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  for (int rank = 0; rank < 3; ++rank) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[rank], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 1u);
    for (const UnitShard& u : v->shards) {
      const PlanUnit& unit = v->plan.units[u.unit];
      for (int64_t j = 0; j < unit.shard_numel; ++j) {
        const int64_t i = rank * unit.shard_numel + j;
        if (i < unit.numel) {
          ASSERT_EQ(Floats(*u.shard)[j], -i) << "rank " << rank << " unit " << u.unit;
        }
      }
    }
  }
}

TEST_F(GroupManagerTest, OffloadToCpuOnAHostDaemonIsHostMemoryAndWritesBack) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  std::vector<absl::StatusOr<SummonResult>> s =
      SummonAll(c, "head", SummonOptions{.offload_to_cpu = true});
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(s[rank].ok()) << s[rank].status();
    ASSERT_EQ(s[rank]->views.size(), 1u);
    EXPECT_FALSE(s[rank]->views[0].params->on_device());
    EXPECT_EQ(s[rank]->views[0].params->bytes(), regs[0].plan.units[4].padded_numel * 4);
    WriteRankPattern(*s[rank], rank);
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  std::vector<std::vector<float>> full = ReadAll(c);
  ASSERT_EQ(full.size(), 5u);
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(full[4][i], 1000 * (i / 5) + i);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(full[2][i], 0.0f) << "a unit not summoned changed";
}

TEST_F(GroupManagerTest, SummonRefusesUnitsTheRankAlreadyUnshards) {
  Start();
  std::vector<Caller> c = JoinAndRegister("g", 2);
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "enc", SummonOptions{});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  // Unit 2 (enc.l1) is open on rank 0: FSDP's refusal, at once, without a collective.
  SummonCall nested;
  gm_->Summon(c[0], "", "enc.l1", SummonOptions{}, Deadline(), nested.Callback());
  ASSERT_EQ(nested.Wait().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(nested.Wait().status().message(),
            "Cannot manually unshard parameters when already unsharding parameters (unit 2 "
            "\"enc.l1\")");
  // Units outside the open summon are fine.
  std::vector<absl::StatusOr<SummonResult>> head = SummonAll(c, "head", SummonOptions{});
  EXPECT_THAT(UnitsOf(head), ElementsAre(4));
  for (const absl::Status& e : EndAll(c, IdsOf(head))) EXPECT_TRUE(e.ok()) << e;
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  // Ended: the units are IDLE again.
  std::vector<absl::StatusOr<SummonResult>> again = SummonAll(c, "enc.l1", SummonOptions{});
  EXPECT_THAT(UnitsOf(again), ElementsAre(2));
  for (const absl::Status& e : EndAll(c, IdsOf(again))) EXPECT_TRUE(e.ok()) << e;
}

TEST_F(GroupManagerTest, WritebackEndMissingARankFailsAtItsDeadlineAndAppliesNothing) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "head", SummonOptions{});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  WriteRankPattern(*s[0], 3);
  // Rank 0 ends with little time left (the collective waits in real time for what is left
  // of the deadline on the manager's clock); rank 1 never ends.
  StatusCall end0;
  gm_->EndSummon(c[0], s[0]->summon, Deadline(absl::Milliseconds(200)), end0.Callback());
  const absl::Status failed = end0.Wait();
  ASSERT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
  EXPECT_THAT(failed.message(), HasSubstr(absl::StrCat("summon ", s[0]->summon,
                                                       ": no rank's writeback was applied")));
  EXPECT_THAT(failed.message(), HasSubstr("rank 1"));
  EXPECT_TRUE(Holds(regs[0], 0.0f)) << "rank 0's range was written back alone";
  // A repeated End answers the same; rank 1's End fails too, and nothing was applied.
  StatusCall again;
  gm_->EndSummon(c[0], s[0]->summon, Deadline(), again.Callback());
  EXPECT_EQ(again.Wait(), failed);
  StatusCall end1;
  gm_->EndSummon(c[1], s[1]->summon, Deadline(), end1.Callback());
  EXPECT_FALSE(end1.Wait().ok());
  EXPECT_TRUE(Holds(regs[1], 0.0f));
  EXPECT_EQ(gm_->GetShards(c[0], "")->generation, 0u);
  EXPECT_EQ(gm_->GetStats().open_summons, 0);
}

TEST_F(GroupManagerTest, NoShardKeepsAWholeCopyOnEveryRank) {
  Start();
  std::vector<Caller> c = JoinAll("g", 2);
  std::vector<RegisterCall> calls(2);
  RunTogether(2, [&](int r) {
    gm_->Register(
        c[r], "", ManifestFromJson(TestManifest()),
        PolicyFromJson(R"({"format": "flatshard.policy/1", "sharding_strategy": "NO_SHARD",
                                     "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})"),
        InitMode::kZeros, Deadline(), calls[r].Callback());
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(calls[r].Wait().ok()) << calls[r].Wait().status();
    for (const UnitShard& u : calls[r].Wait()->shards) {
      const PlanUnit& unit = calls[r].Wait()->plan.units[u.unit];
      EXPECT_EQ(unit.shard_numel, unit.padded_numel);
      EXPECT_EQ(u.shard->bytes(), unit.padded_numel * 4);
    }
  }
  // Each rank writes back its whole copy (its own range is all of it).
  std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", SummonOptions{});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(s[r].ok()) << s[r].status();
    WriteRankPattern(*s[r], r);
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  // Read-only views are each rank's own (there is nothing to gather into one copy).
  s = SummonAll(c, "head", SummonOptions{.writeback = false});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  EXPECT_NE(s[0]->views[0].params.get(), s[1]->views[0].params.get());
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < 10; ++i) ASSERT_EQ(Floats(*s[r]->views[0].params)[i], 1000 * r + i);
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  // Gradients are all-reduced into each rank's whole copy (module_strategy_test has more).
  for (const absl::Status& e : ReduceScatterAll(c, 0, ReduceOp::kSum, false, Deadline())) {
    ASSERT_TRUE(e.ok()) << e;
  }
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    const Buffer& g = *v->shards[0].grad;
    for (int64_t i = 0; i < FloatCount(g); ++i) ASSERT_EQ(Floats(g)[i], 3.0f * (i + 1));
  }
}

// ---------------------------------------------------------------------------------------------
// Summon's allocations outside the manager's lock: the local ranks of a read-only summon share
// one node copy made once (also when they all arrive together), an allocation that fails leaves
// no trace (the units are not summoned, a later summon succeeds), and kept buffers are reused
// across summons.

class GroupManagerSummonTest : public testing::GroupManagerHarness {
 protected:
  GroupManagerSummonTest() { model_ = testing::ExampleModel("gpt_tied"); }
};

TEST_F(GroupManagerSummonTest, LocalRanksArrivingTogetherShareOneNodeCopyMadeOnce) {
  Start();
  const std::vector<Caller> c = JoinAndRegister("g", 4);
  const int64_t before = store_->Usage().buffers;
  SummonOptions read_only;
  read_only.writeback = false;
  for (int round = 0; round < 5; ++round) {
    std::vector<absl::StatusOr<SummonResult>> s = SummonAll(c, "", read_only);
    for (size_t r = 0; r < c.size(); ++r) {
      ASSERT_TRUE(s[r].ok()) << "round " << round << " rank " << r << ": " << s[r].status();
      ASSERT_EQ(s[r]->views.size(), s[0]->views.size());
      for (size_t u = 0; u < s[r]->views.size(); ++u) {
        EXPECT_EQ(s[r]->views[u].params.get(), s[0]->views[u].params.get())
            << "round " << round << ": rank " << r << " got its own copy of unit " << u;
      }
    }
    const int64_t units = static_cast<int64_t>(s[0]->views.size());
    // One node copy per unit, made once: no second copy was allocated and dropped, and the
    // same ones are reused every round (all ranks end before the next round).
    EXPECT_EQ(store_->Usage().buffers - before, units) << "round " << round;
    for (const absl::Status& e : EndAll(c, IdsOf(s))) ASSERT_TRUE(e.ok()) << e;
  }
}

TEST_F(GroupManagerSummonTest, AFailedAllocationLeavesNoTrace) {
  // What the shards and their committed copies take, measured on a first manager.
  Start();
  (void)JoinAndRegister("g", 1);
  const int64_t held = store_->Usage().total_bytes;
  Stop();
  // A store with room for exactly that: the views of a summon cannot be allocated.
  store_options_.memory_limit_bytes = held;
  Start();
  const std::vector<Caller> c2 = JoinAndRegister("g", 1);
  ASSERT_EQ(store_->Usage().total_bytes, held);
  SummonOptions options;
  options.writeback = true;
  SummonCall refused;
  gm_->Summon(c2[0], "", "", options, Deadline(), refused.Callback());
  ASSERT_EQ(refused.Wait().status().code(), absl::StatusCode::kResourceExhausted)
      << refused.Wait().status();
  // Nothing changed: no open summon, the units are not summoned (a second refusal says the
  // same, not "already unsharding"), no buffer stays allocated.
  EXPECT_EQ(gm_->GetStats().open_summons, 0);
  EXPECT_EQ(store_->Usage().total_bytes, held);
  SummonCall again;
  gm_->Summon(c2[0], "", "", options, Deadline(), again.Callback());
  EXPECT_EQ(again.Wait().status().code(), absl::StatusCode::kResourceExhausted)
      << again.Wait().status();
}

}  // namespace
}  // namespace flatshard::server
