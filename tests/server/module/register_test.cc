// GroupManager's Register through its public API (GroupManagerHarness): equal and differing
// plans, refused manifests, duplicate and nested paths, the FROM_EVERY_RANK and FROM_RANK0 init
// summons.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using ::testing::ElementsAre;
using testing::FloatCount;
using testing::Floats;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::kTestPolicy;
using testing::kWait;
using testing::RegisterCall;
using testing::RunTogether;
using testing::StatusCall;
using testing::SummonCall;
using testing::TestManifest;

using GroupManagerTest = testing::GroupManagerHarness;

TEST_F(GroupManagerTest, EqualPlansGetShardsOfThePlannedSizes) {
  Start();
  std::vector<Caller> c = JoinAll("g", 2);
  std::vector<absl::StatusOr<RegisterResult>> r = RegisterAll(c, InitMode::kZeros);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(r[rank].ok()) << r[rank].status();
    const RegisterResult& res = *r[rank];
    EXPECT_FALSE(res.init_summon.has_value());
    EXPECT_EQ(res.generation, 0u);
    EXPECT_EQ(res.plan.fingerprint, r[0]->plan.fingerprint);
    ASSERT_EQ(res.shards.size(), res.plan.units.size());
    for (size_t u = 0; u < res.shards.size(); ++u) {
      const PlanUnit& unit = res.plan.units[u];
      EXPECT_EQ(res.shards[u].unit, unit.index);
      EXPECT_EQ(res.shards[u].shard->bytes(), unit.shard_numel * 4);
      EXPECT_EQ(unit.padded_numel, unit.shard_numel * 2);
      EXPECT_EQ(res.shards[u].grad, nullptr);
      for (int64_t i = 0; i < FloatCount(*res.shards[u].shard); ++i) {
        ASSERT_EQ(Floats(*res.shards[u].shard)[i], 0.0f);
      }
    }
  }
  // The planned units, pre-order: the root, enc, enc.l1, enc.l2, head.
  std::vector<std::string> modules;
  for (const PlanUnit& u : r[0]->plan.units) modules.push_back(u.module);
  EXPECT_THAT(modules, ElementsAre("", "enc", "enc.l1", "enc.l2", "head"));
  // kZeros: usable at once.
  absl::StatusOr<RegisterResult> views = gm_->GetShards(c[1], "");
  ASSERT_TRUE(views.ok()) << views.status();
  EXPECT_EQ(views->shards[2].shard->segment_name(), r[1]->shards[2].shard->segment_name());
  const std::vector<GroupManager::GroupInfo> groups = gm_->ListGroups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_THAT(groups[0].registered_modules, ElementsAre(""));
  absl::StatusOr<std::vector<GroupManager::ModuleUnits>> units = gm_->ListUnits("g", std::nullopt);
  ASSERT_TRUE(units.ok()) << units.status();
  ASSERT_EQ(units->size(), 1u);
  EXPECT_TRUE((*units)[0].initialized);
  EXPECT_EQ((*units)[0].units.size(), 5u);
  // Unregistered module, unknown group.
  EXPECT_EQ(gm_->GetShards(c[0], "nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gm_->ListUnits("nope", std::nullopt).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(GroupManagerTest, DifferingPlansFailEveryRankNamingTheUnitAndTheRanks) {
  Start();
  std::vector<Caller> c = JoinAll("g", 3);
  std::vector<absl::StatusOr<RegisterResult>> r = RegisterAll(
      c, InitMode::kZeros, "", [](int rank) { return TestManifest(rank == 2 ? 11 : 10); });
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_EQ(r[rank].status().code(), absl::StatusCode::kInvalidArgument) << r[rank].status();
    EXPECT_EQ(r[rank].status().message(),
              "group g: ranks registered different models for module \"\" (the root): first "
              "difference at unit 4: rank 0 has \"head\" (Linear, 1 params, 10 elements, "
              "float32), rank 2 has \"head\" (Linear, 1 params, 11 elements, float32)")
        << "rank " << rank;
  }
  EXPECT_THAT(gm_->ListGroups()[0].registered_modules, IsEmpty());
  EXPECT_EQ(store_->Usage().buffers, 0) << "a refused registration kept memory";
  // Differing init modes.
  r = RegisterAll(c, InitMode::kZeros, "", nullptr,
                  [](int rank) { return rank == 1 ? InitMode::kFromRank0 : InitMode::kZeros; });
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_EQ(r[rank].status().code(), absl::StatusCode::kInvalidArgument) << r[rank].status();
    EXPECT_THAT(r[rank].status().message(),
                HasSubstr("rank 0 and rank 1 asked for different init modes"));
  }
  // After the refusals the group is fine: an agreeing registration succeeds.
  for (absl::StatusOr<RegisterResult>& x : RegisterAll(c, InitMode::kZeros)) {
    EXPECT_TRUE(x.ok()) << x.status();
  }
}

TEST_F(GroupManagerTest, RefusedManifestStillArrivesSoTheOthersFailAtOnce) {
  Start();
  std::vector<Caller> c = JoinAll("g", 2);
  std::vector<RegisterCall> calls(2);
  RunTogether(2, [&](int r) {
    const absl::StatusOr<Manifest> manifest =
        r == 1 ? absl::StatusOr<Manifest>(absl::InvalidArgumentError("manifest: root: bad"))
               : ManifestFromJson(TestManifest());
    gm_->Register(c[r], "", manifest, PolicyFromJson(kTestPolicy), InitMode::kZeros,
                  Deadline(absl::Seconds(60)), calls[r].Callback());
  });
  const absl::Time start = absl::Now();
  EXPECT_EQ(calls[1].Wait().status(), absl::InvalidArgumentError("manifest: root: bad"));
  ASSERT_EQ(calls[0].Wait().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(calls[0].Wait().status().message(),
            "group g: rank 1's registration of module \"\" (the root) was refused: manifest: "
            "root: bad");
  EXPECT_LT(absl::Now() - start, kWait);
}

TEST_F(GroupManagerTest, RegisterRefusesDuplicatesAndNestedPaths) {
  Start();
  std::vector<Caller> c = JoinAll("g", 2);
  for (absl::StatusOr<RegisterResult>& r : RegisterAll(c, InitMode::kZeros, "enc")) {
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Again in the same session: ALREADY_EXISTS, without a collective.
  RegisterCall dup;
  gm_->Register(c[0], "enc", ManifestFromJson(TestManifest()), PolicyFromJson(kTestPolicy),
                InitMode::kZeros, Deadline(), dup.Callback());
  ASSERT_EQ(dup.Wait().status().code(), absl::StatusCode::kAlreadyExists) << dup.Wait().status();
  EXPECT_EQ(dup.Wait().status().message(),
            "group g: module \"enc\" is already registered by this session");
  RegisterCall other;
  gm_->Register(c[0], "enc", ManifestFromJson(TestManifest(12)), PolicyFromJson(kTestPolicy),
                InitMode::kZeros, Deadline(), other.Callback());
  EXPECT_EQ(other.Wait().status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other.Wait().status().message(), HasSubstr("(with a different model)"));
  // Nested inside, or containing, a registered path: FSDP's "already has flatshard applied".
  for (const std::string& path : {std::string("enc.l1"), std::string("")}) {
    RegisterCall nested;
    gm_->Register(c[1], path, ManifestFromJson(TestManifest()), PolicyFromJson(kTestPolicy),
                  InitMode::kZeros, Deadline(), nested.Callback());
    ASSERT_EQ(nested.Wait().status().code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(
        nested.Wait().status().message(),
        HasSubstr("already has flatshard applied: it overlaps the registered module \"enc\""));
  }
  // A sibling path is fine.
  for (absl::StatusOr<RegisterResult>& r : RegisterAll(c, InitMode::kZeros, "encoder2")) {
    EXPECT_TRUE(r.ok()) << r.status();
  }
  EXPECT_THAT(gm_->ListGroups()[0].registered_modules, ElementsAre("enc", "encoder2"));
}

TEST_F(GroupManagerTest, FromEveryRankInitCommitsWhenEveryRankEnded) {
  Start();
  std::vector<Caller> c = JoinAll("g", 2);
  std::vector<absl::StatusOr<RegisterResult>> r = RegisterAll(c, InitMode::kFromEveryRank);
  std::vector<uint64_t> ids;
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(r[rank].ok()) << r[rank].status();
    ASSERT_TRUE(r[rank]->init_summon.has_value());
    ASSERT_EQ(r[rank]->init_summon->views.size(), 5u);
    ids.push_back(r[rank]->init_summon->summon);
  }
  // Not a model yet: no views, no summons.
  absl::StatusOr<RegisterResult> early = gm_->GetShards(c[0], "");
  ASSERT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.status().message(), HasSubstr("is not initialised"));
  SummonCall refused;
  gm_->Summon(c[1], "", "", SummonOptions{}, Deadline(), refused.Callback());
  EXPECT_EQ(refused.Wait().status().code(), absl::StatusCode::kFailedPrecondition);
  // Each rank fills its full buffers with the same values (FSDP: every rank's module has
  // them); value = unit * 100 + index.
  for (int rank = 0; rank < 2; ++rank) {
    for (const SummonedUnit& v : r[rank]->init_summon->views) {
      for (int64_t i = 0; i < FloatCount(*v.params); ++i) Floats(*v.params)[i] = v.unit * 100 + i;
    }
  }
  for (const absl::Status& s : EndAll(c, ids)) ASSERT_TRUE(s.ok()) << s;
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[rank], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 0u);
    for (const UnitShard& s : v->shards) {
      const PlanUnit& unit = v->plan.units[s.unit];
      for (int64_t j = 0; j < unit.shard_numel; ++j) {
        const int64_t i = rank * unit.shard_numel + j;
        if (i >= unit.numel) continue;  // padding: unspecified
        ASSERT_EQ(Floats(*s.shard)[j], s.unit * 100 + i) << "rank " << rank << " unit " << s.unit;
      }
    }
  }
  std::vector<std::vector<float>> full = ReadAll(c);
  ASSERT_EQ(full.size(), 5u);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(full[2][i], 200 + i);
  EXPECT_TRUE((*gm_->ListUnits("g", std::nullopt))[0].initialized);
}

TEST_F(GroupManagerTest, FromRank0InitSpreadsRank0sValues) {
  Start();
  std::vector<Caller> c = JoinAll("g", 3);
  std::vector<absl::StatusOr<RegisterResult>> r = RegisterAll(c, InitMode::kFromRank0);
  std::vector<uint64_t> ids;
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(r[rank].ok()) << r[rank].status();
    ASSERT_TRUE(r[rank]->init_summon.has_value());
    EXPECT_EQ(r[rank]->init_summon->units.size(), 5u);
    EXPECT_EQ(r[rank]->init_summon->views.size(), rank == 0 ? 5u : 0u) << "rank " << rank;
    ids.push_back(r[rank]->init_summon->summon);
  }
  for (const SummonedUnit& v : r[0]->init_summon->views) {
    for (int64_t i = 0; i < FloatCount(*v.params); ++i) Floats(*v.params)[i] = -(v.unit * 100 + i);
  }
  // Rank 0's End waits for the others' (nothing is applied before every rank ended).
  StatusCall end0;
  gm_->EndSummon(c[0], ids[0], Deadline(), end0.Callback());
  EXPECT_EQ(gm_->GetShards(c[0], "").status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<absl::Status> rest = EndAll({c[1], c[2]}, {ids[1], ids[2]});
  ASSERT_TRUE(end0.Wait().ok()) << end0.Wait();
  for (const absl::Status& s : rest) ASSERT_TRUE(s.ok()) << s;
  std::vector<std::vector<float>> full = ReadAll(c);
  ASSERT_EQ(full.size(), 5u);
  for (int u = 1; u < 5; ++u) {
    const PlanUnit& unit = r[0]->plan.units[u];
    for (int64_t i = 0; i < unit.numel; ++i) ASSERT_EQ(full[u][i], -(u * 100 + i)) << "unit " << u;
  }
  EXPECT_EQ(gm_->GetShards(c[2], "")->generation, 0u);
}

}  // namespace
}  // namespace flatshard::server
