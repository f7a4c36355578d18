// Unit tests of GroupManager through its public API only: a real ShardStore over host shared
// memory, the in-process backend (local groups), a FakeClock for every deadline the manager
// reads (joins, leases, idle groups, deferred failures). No gRPC, no daemon process.
//
// Time: the manager's deadline loop wakes every 20 ms of real time and compares deadlines
// with the FakeClock, so a test moves the clock and then waits (with a real-time bound of a
// few seconds) for the outcome; TickProbe tells when the loop has looked at least once since a
// point, so "nothing happened yet" is checked without a fixed sleep. Collective waits run in
// real time (their timeout is the deadline minus the clock's now), so deadlines here are
// `clock.Now() + kWait` and a passing test never waits for one.

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/testing/async_call.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::server {
namespace {

using ::flatshard::testing::ListSegments;
using ::flatshard::testing::RunRanks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// How long a test waits in real time for an answer that should come at once.
constexpr absl::Duration kWait = absl::Seconds(5);

// A model with nesting and odd sizes (padding on every unit at world size 2 and 3):
//   ""         Net    scale[3]
//   "enc"      Block  bias[6]
//   "enc.l1"   Linear weight[5, 3]
//   "enc.l2"   Linear weight[7]
//   "head"     Linear weight[head_numel]
std::string ModelJson(int head_numel = 10) {
  return absl::StrCat(R"({
 "format": "flatshard.manifest/1",
 "root": {"id": 0, "type": "Net", "bases": ["Module"],
  "params": [{"name": "scale", "id": 4, "shape": [3], "dtype": "float32", "requires_grad": true}],
  "children": [
  {"name": "enc", "module": {"id": 1, "type": "Block", "bases": ["Module"],
   "params": [{"name": "bias", "id": 0, "shape": [6], "dtype": "float32", "requires_grad": true}],
   "children": [
    {"name": "l1", "module": {"id": 2, "type": "Linear", "bases": ["Module"], "children": [],
     "params": [{"name": "weight", "id": 1, "shape": [5, 3], "dtype": "float32",
                 "requires_grad": true}]}},
    {"name": "l2", "module": {"id": 3, "type": "Linear", "bases": ["Module"], "children": [],
     "params": [{"name": "weight", "id": 2, "shape": [7], "dtype": "float32",
                 "requires_grad": true}]}}]}},
  {"name": "head", "module": {"id": 4, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 3, "shape": [)",
                      head_numel, R"(], "dtype": "float32", "requires_grad": true}]}}]}})");
}
constexpr char kPolicy[] = R"({"format": "flatshard.policy/1",
 "auto_wrap": {"kind": "module_types", "types": ["Block", "Linear"]}})";

template <typename T>
using Async = ::flatshard::testing::AsyncCall<T>;

using JoinCall = Async<absl::StatusOr<JoinResult>>;
using RegisterCall = Async<absl::StatusOr<RegisterResult>>;
using SummonCall = Async<absl::StatusOr<SummonResult>>;
using StatusCall = Async<absl::Status>;
using CommitCall = Async<absl::StatusOr<uint64_t>>;

// Polls `cond` until it holds or `wait` of real time passed.
bool Eventually(const std::function<bool()>& cond, absl::Duration wait = kWait) {
  const absl::Time until = absl::Now() + wait;
  while (!cond()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

float* Floats(const Buffer& b) { return static_cast<float*>(b.data()); }
int64_t FloatCount(const Buffer& b) { return b.bytes() / static_cast<int64_t>(sizeof(float)); }

// Every shard of `r` set to / holding `value` (an optimizer's in-place write).
void Fill(const RegisterResult& r, float value) {
  for (const UnitShard& s : r.shards) {
    for (int64_t i = 0; i < FloatCount(*s.shard); ++i) Floats(*s.shard)[i] = value;
  }
}
::testing::AssertionResult Holds(const RegisterResult& r, float value) {
  for (const UnitShard& s : r.shards) {
    for (int64_t i = 0; i < FloatCount(*s.shard); ++i) {
      if (Floats(*s.shard)[i] != value) {
        return ::testing::AssertionFailure() << "unit " << s.unit << " element " << i << " holds "
                                             << Floats(*s.shard)[i] << ", not " << value;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

class GroupManagerTest : public ::testing::Test {
 protected:
  GroupManagerTest()
      : prefix_(absl::StrCat("fs_gmut_", getpid(), "_",
                             ::testing::UnitTest::GetInstance()->current_test_info()->name())) {}
  ~GroupManagerTest() override {
    gm_.reset();
    store_.reset();
    // A collective's completion runs on the engine's watchdog thread, which drops the
    // callback's captures (a failed reduce-scatter's fresh gradient, say) just after the
    // answer, and may still be doing so now: wait a moment. A leak stays a failure.
    Eventually([&] { return ListSegments(prefix_).empty(); });
    EXPECT_THAT(ListSegments(prefix_), IsEmpty()) << "segments left behind";
  }

  void Start(GroupManagerOptions options = {}) {
    store_ = std::make_unique<ShardStore>(ShardStoreOptions{.segment_prefix = prefix_});
    options.clock = &clock_;
    gm_ = std::make_unique<GroupManager>(store_.get(), std::move(options));
  }

  absl::Time Deadline(absl::Duration d = kWait) const { return clock_.Now() + d; }

  static JoinArgs Args(const std::string& group, int world, int rank,
                       const std::string& token = "tok") {
    JoinArgs a;
    a.group = group;
    a.world_size = world;
    a.rank = rank;
    a.token = token;
    return a;
  }
  static Caller CallerOf(const std::string& group, int rank, uint64_t session,
                         const std::string& token = "tok") {
    return Caller{group, rank, token, session, -1};
  }

  // Ranks [0, world) of `group` join, each from its own thread; returns their callers.
  std::vector<Caller> JoinAll(const std::string& group, int world) {
    std::vector<JoinCall> joins(world);
    RunRanks(world, [&](int r) { gm_->Join(Args(group, world, r), Deadline(), joins[r].Callback()); });
    std::vector<Caller> callers;
    for (int r = 0; r < world; ++r) {
      absl::StatusOr<JoinResult>& j = joins[r].Wait();
      EXPECT_TRUE(j.ok()) << "rank " << r << ": " << j.status();
      callers.push_back(CallerOf(group, r, j.ok() ? j->session : 0));
    }
    return callers;
  }
  // `rank` joins again (its group's other ranks are joined); returns its caller.
  Caller Rejoin(const std::string& group, int world, int rank,
                std::vector<std::string>* modules = nullptr) {
    JoinCall j;
    gm_->Join(Args(group, world, rank), Deadline(), j.Callback());
    absl::StatusOr<JoinResult>& r = j.Wait();
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok() && modules != nullptr) *modules = r->registered_modules;
    return CallerOf(group, rank, r.ok() ? r->session : 0);
  }

  // Every caller registers the test model (per rank: its head size and init mode).
  std::vector<absl::StatusOr<RegisterResult>> RegisterAll(
      const std::vector<Caller>& callers, InitMode init, const std::string& module = "",
      const std::function<int(int)>& head_numel = [](int) { return 10; },
      const std::function<InitMode(int)>& init_of = nullptr) {
    std::vector<RegisterCall> calls(callers.size());
    RunRanks(static_cast<int>(callers.size()), [&](int i) {
      gm_->Register(callers[i], module, ManifestFromJson(ModelJson(head_numel(callers[i].rank))),
                    PolicyFromJson(kPolicy), init_of ? init_of(callers[i].rank) : init,
                    Deadline(), calls[i].Callback());
    });
    std::vector<absl::StatusOr<RegisterResult>> out;
    for (RegisterCall& c : calls) out.push_back(std::move(c.Wait()));
    return out;
  }
  // Joins `world` ranks and registers the model with zeros; every step must succeed.
  std::vector<Caller> Setup(const std::string& group, int world,
                            std::vector<RegisterResult>* regs = nullptr) {
    std::vector<Caller> c = JoinAll(group, world);
    std::vector<absl::StatusOr<RegisterResult>> r = RegisterAll(c, InitMode::kZeros);
    for (int i = 0; i < world; ++i) {
      EXPECT_TRUE(r[i].ok()) << "rank " << i << ": " << r[i].status();
      if (regs != nullptr && r[i].ok()) regs->push_back(*r[i]);
    }
    return c;
  }

  // Every caller summons `path` of module "" with `options`.
  std::vector<absl::StatusOr<SummonResult>> SummonAll(const std::vector<Caller>& callers,
                                                      const std::string& path,
                                                      const SummonOptions& options) {
    std::vector<SummonCall> calls(callers.size());
    RunRanks(static_cast<int>(callers.size()), [&](int i) {
      gm_->Summon(callers[i], "", path, options, Deadline(), calls[i].Callback());
    });
    std::vector<absl::StatusOr<SummonResult>> out;
    for (SummonCall& c : calls) out.push_back(std::move(c.Wait()));
    return out;
  }
  // Every caller ends its summon (ids[i]).
  std::vector<absl::Status> EndAll(const std::vector<Caller>& callers,
                                   const std::vector<uint64_t>& ids) {
    std::vector<StatusCall> calls(callers.size());
    RunRanks(static_cast<int>(callers.size()), [&](int i) {
      gm_->EndSummon(callers[i], ids[i], Deadline(), calls[i].Callback());
    });
    std::vector<absl::Status> out;
    for (StatusCall& c : calls) out.push_back(c.Wait());
    return out;
  }
  std::vector<absl::StatusOr<uint64_t>> CommitAll(const std::vector<Caller>& callers) {
    std::vector<CommitCall> calls(callers.size());
    RunRanks(static_cast<int>(callers.size()), [&](int i) {
      gm_->Commit(callers[i], "", Deadline(), calls[i].Callback());
    });
    std::vector<absl::StatusOr<uint64_t>> out;
    for (CommitCall& c : calls) out.push_back(std::move(c.Wait()));
    return out;
  }
  // A read-only summon of every unit on every rank; returns each unit's full buffer as rank
  // 0 sees it (every rank's must be equal), then ends it.
  std::vector<std::vector<float>> ReadAll(const std::vector<Caller>& callers) {
    std::vector<absl::StatusOr<SummonResult>> s =
        SummonAll(callers, "", SummonOptions{.writeback = false});
    std::vector<std::vector<float>> out;
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < s.size(); ++i) {
      EXPECT_TRUE(s[i].ok()) << s[i].status();
      if (!s[i].ok()) return out;
      ids.push_back(s[i]->summon);
    }
    for (const SummonedUnit& v : s[0]->views) {
      out.emplace_back(Floats(*v.params), Floats(*v.params) + FloatCount(*v.params));
    }
    for (size_t i = 1; i < s.size(); ++i) {
      for (size_t u = 0; u < s[i]->views.size(); ++u) {
        const Buffer& b = *s[i]->views[u].params;
        EXPECT_EQ(std::vector<float>(Floats(b), Floats(b) + FloatCount(b)), out[u])
            << "rank " << i << " sees another unit " << u;
      }
    }
    for (const absl::Status& e : EndAll(callers, ids)) EXPECT_TRUE(e.ok()) << e;
    return out;
  }

  // The status of `group`'s collectives (OK when the group is not hosted).
  absl::Status GroupStatus(const std::string& group) const {
    for (const GroupManager::GroupInfo& g : gm_->ListGroups()) {
      if (g.group == group) return g.status;
    }
    return absl::OkStatus();
  }
  bool Hosts(const std::string& group) const {
    for (const GroupManager::GroupInfo& g : gm_->ListGroups()) {
      if (g.group == group) return true;
    }
    return false;
  }

  // Counts the deadline loop's passes: a join of a group nobody else joins, whose
  // caller_gone the loop asks once in every pass. Await() returns once a whole pass that read
  // the clock after the call has run: the count read at the call may be mid-pass (pass n),
  // and pass n + 1 may have read the clock before the call, so it waits for the count of
  // pass n + 3, which follows the end of pass n + 2.
  class TickProbe {
   public:
    explicit TickProbe(GroupManager& gm) : ticks_(std::make_shared<std::atomic<int64_t>>(0)) {
      JoinArgs a = Args("tick-probe", 2, 0);
      a.caller_gone = [ticks = ticks_] {
        ticks->fetch_add(1);
        return false;
      };
      gm.Join(a, absl::InfiniteFuture(), [](absl::StatusOr<JoinResult>) {});
    }
    void Await() const {
      const int64_t start = ticks_->load();
      EXPECT_TRUE(Eventually([&] { return ticks_->load() >= start + 3; }))
          << "the deadline loop did not run";
    }

   private:
    std::shared_ptr<std::atomic<int64_t>> ticks_;
  };

  FakeClock clock_;
  std::string prefix_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<GroupManager> gm_;
};

// ---------------------------------------------------------------------------------------------
// Registration

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
  std::vector<absl::StatusOr<RegisterResult>> r =
      RegisterAll(c, InitMode::kZeros, "", [](int rank) { return rank == 2 ? 11 : 10; });
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
  r = RegisterAll(c, InitMode::kZeros, "", [](int) { return 10; },
                  [](int rank) { return rank == 1 ? InitMode::kFromRank0 : InitMode::kZeros; });
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_EQ(r[rank].status().code(), absl::StatusCode::kInvalidArgument) << r[rank].status();
    EXPECT_THAT(r[rank].status().message(), HasSubstr("rank 0 and rank 1 asked for different init modes"));
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
  RunRanks(2, [&](int r) {
    const absl::StatusOr<Manifest> manifest =
        r == 1 ? absl::StatusOr<Manifest>(absl::InvalidArgumentError("manifest: root: bad"))
               : ManifestFromJson(ModelJson());
    gm_->Register(c[r], "", manifest, PolicyFromJson(kPolicy), InitMode::kZeros,
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
  gm_->Register(c[0], "enc", ManifestFromJson(ModelJson()), PolicyFromJson(kPolicy),
                InitMode::kZeros, Deadline(), dup.Callback());
  ASSERT_EQ(dup.Wait().status().code(), absl::StatusCode::kAlreadyExists) << dup.Wait().status();
  EXPECT_EQ(dup.Wait().status().message(),
            "group g: module \"enc\" is already registered by this session");
  RegisterCall other;
  gm_->Register(c[0], "enc", ManifestFromJson(ModelJson(12)), PolicyFromJson(kPolicy),
                InitMode::kZeros, Deadline(), other.Callback());
  EXPECT_EQ(other.Wait().status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other.Wait().status().message(), HasSubstr("(with a different model)"));
  // Nested inside, or containing, a registered path: FSDP's "already has flatshard applied".
  for (const std::string& path : {std::string("enc.l1"), std::string("")}) {
    RegisterCall nested;
    gm_->Register(c[1], path, ManifestFromJson(ModelJson()), PolicyFromJson(kPolicy),
                  InitMode::kZeros, Deadline(), nested.Callback());
    ASSERT_EQ(nested.Wait().status().code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(nested.Wait().status().message(),
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


// ---------------------------------------------------------------------------------------------
// Summons

// Units of the summon results, as rank 0 got them.
std::vector<int32_t> UnitsOf(const std::vector<absl::StatusOr<SummonResult>>& s) {
  return s.empty() || !s[0].ok() ? std::vector<int32_t>{} : s[0]->units;
}
std::vector<uint64_t> IdsOf(const std::vector<absl::StatusOr<SummonResult>>& s) {
  std::vector<uint64_t> ids;
  for (const absl::StatusOr<SummonResult>& r : s) {
    EXPECT_TRUE(r.ok()) << r.status();
    ids.push_back(r.ok() ? r->summon : 0);
  }
  return ids;
}

TEST_F(GroupManagerTest, RecurseSelectsTheSubtreeOrTheUnitRootedAtThePath) {
  Start();
  std::vector<Caller> c = Setup("g", 2);
  struct Case {
    std::string path;
    bool recurse;
    std::vector<int32_t> units;
  };
  for (const Case& k : {Case{"", true, {0, 1, 2, 3, 4}}, Case{"", false, {0}},
                        Case{"enc", true, {1, 2, 3}}, Case{"enc", false, {1}},
                        Case{"enc.l2", true, {3}}, Case{"head", false, {4}}}) {
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

// Each rank writes 1000 * rank + i at every index i of every unit's full buffer.
void WriteRankPattern(const SummonResult& s, int rank) {
  for (const SummonedUnit& v : s.views) {
    for (int64_t i = 0; i < FloatCount(*v.params); ++i) Floats(*v.params)[i] = 1000 * rank + i;
  }
}

TEST_F(GroupManagerTest, WritebackKeepsEachRanksOwnRangeAndCommits) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = Setup("g", 3, &regs);
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
  std::vector<Caller> c = Setup("g", 2, &regs);
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
  std::vector<Caller> c = Setup("g", 3, &regs);
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
  std::vector<Caller> c = Setup("g", 2, &regs);
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
  std::vector<Caller> c = Setup("g", 2);
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
  std::vector<Caller> c = Setup("g", 2, &regs);
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
  RunRanks(2, [&](int r) {
    gm_->Register(c[r], "", ManifestFromJson(ModelJson()),
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
  absl::StatusOr<std::shared_ptr<Buffer>> grads = gm_->BeginReduceScatter(c[0], "", 0);
  EXPECT_EQ(grads.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(grads.status().message(), HasSubstr("NO_SHARD"));
}

// ---------------------------------------------------------------------------------------------
// Gradients

// Every rank writes (rank + 1) * (i + 1) into the full gradient of `unit` and reduce-scatters.
std::vector<absl::Status> ReduceScatterAll(GroupManager& gm, const std::vector<Caller>& c,
                                           int32_t unit, GradReduce op, bool accumulate,
                                           absl::Time deadline) {
  std::vector<StatusCall> calls(c.size());
  RunRanks(static_cast<int>(c.size()), [&](int r) {
    absl::StatusOr<std::shared_ptr<Buffer>> full = gm.BeginReduceScatter(c[r], "", unit);
    if (!full.ok()) {
      calls[r].Callback()(full.status());
      return;
    }
    for (int64_t i = 0; i < FloatCount(**full); ++i) Floats(**full)[i] = (r + 1) * (i + 1);
    gm.FinishReduceScatter(c[r], "", unit, op, accumulate, deadline, calls[r].Callback());
  });
  std::vector<absl::Status> out;
  for (StatusCall& x : calls) out.push_back(x.Wait());
  return out;
}

TEST_F(GroupManagerTest, ReduceScatterSumsAveragesAndAccumulates) {
  Start();
  std::vector<Caller> c = Setup("g", 2);
  constexpr int32_t kUnit = 2;  // enc.l1: 15 elements, shard 8
  auto grads_hold = [&](float factor) {
    for (int rank = 0; rank < 2; ++rank) {
      absl::StatusOr<RegisterResult> v = gm_->GetShards(c[rank], "");
      if (!v.ok()) return ::testing::AssertionFailure() << v.status();
      const std::shared_ptr<Buffer>& g = v->shards[kUnit].grad;
      if (g == nullptr) return ::testing::AssertionFailure() << "rank " << rank << ": no gradient";
      for (int64_t j = 0; j < FloatCount(*g); ++j) {
        const float want = factor * (rank * FloatCount(*g) + j + 1);
        if (Floats(*g)[j] != want) {
          return ::testing::AssertionFailure()
                 << "rank " << rank << " element " << j << ": " << Floats(*g)[j] << " != " << want;
        }
      }
      if (v->shards[1].grad != nullptr) return ::testing::AssertionFailure() << "unit 1 got a gradient";
    }
    return ::testing::AssertionSuccess();
  };
  for (const absl::Status& s : ReduceScatterAll(*gm_, c, kUnit, GradReduce::kSum, false, Deadline())) {
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(grads_hold(3.0f));  // 1 + 2
  for (const absl::Status& s : ReduceScatterAll(*gm_, c, kUnit, GradReduce::kAvg, true, Deadline())) {
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(grads_hold(4.5f));  // 3 + (1 + 2) / 2
  for (const absl::Status& s : ReduceScatterAll(*gm_, c, kUnit, GradReduce::kAvg, false, Deadline())) {
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(grads_hold(1.5f));  // replaced
  // with_grads: the full gradient of units that have one; none for the others.
  std::vector<absl::StatusOr<SummonResult>> s =
      SummonAll(c, "enc", SummonOptions{.writeback = false, .with_grads = true});
  for (const absl::StatusOr<SummonResult>& r : s) {
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->views.size(), 3u);
    EXPECT_EQ(r->views[0].grads, nullptr) << "a unit without a gradient reports it absent";
    ASSERT_NE(r->views[1].grads, nullptr);
    for (int64_t i = 0; i < FloatCount(*r->views[1].grads); ++i) {
      ASSERT_EQ(Floats(*r->views[1].grads)[i], 1.5f * (i + 1));
    }
  }
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  // rank0_only: only rank 0 sees the full gradient.
  s = SummonAll(c, "enc.l1",
                SummonOptions{.writeback = false, .rank0_only = true, .with_grads = true});
  ASSERT_TRUE(s[0].ok() && s[1].ok());
  ASSERT_EQ(s[0]->views.size(), 1u);
  ASSERT_NE(s[0]->views[0].grads, nullptr);
  for (int64_t i = 0; i < FloatCount(*s[0]->views[0].grads); ++i) {
    ASSERT_EQ(Floats(*s[0]->views[0].grads)[i], 1.5f * (i + 1));
  }
  EXPECT_THAT(s[1]->views, IsEmpty());
  for (const absl::Status& e : EndAll(c, IdsOf(s))) EXPECT_TRUE(e.ok()) << e;
  // Refusals.
  EXPECT_EQ(gm_->BeginReduceScatter(c[0], "", 9).status().code(), absl::StatusCode::kNotFound);
  StatusCall unbegun;
  gm_->FinishReduceScatter(c[0], "", 3, GradReduce::kSum, false, Deadline(), unbegun.Callback());
  ASSERT_EQ(unbegun.Wait().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(unbegun.Wait().message(), HasSubstr("(begin the reduce-scatter first)"));
}

TEST_F(GroupManagerTest, FailedReduceScatterChangesNothingAndARepeatedFinishGetsItsCause) {
  Start();
  std::vector<Caller> c = Setup("g", 2);
  absl::StatusOr<std::shared_ptr<Buffer>> full = gm_->BeginReduceScatter(c[0], "", 4);
  ASSERT_TRUE(full.ok()) << full.status();
  for (int64_t i = 0; i < FloatCount(**full); ++i) Floats(**full)[i] = 1.0f;
  StatusCall finish;
  gm_->FinishReduceScatter(c[0], "", 4, GradReduce::kSum, false, Deadline(absl::Seconds(60)),
                           finish.Callback());
  // Rank 1's client dies: rank 0's reduce-scatter fails at once, naming it.
  const absl::Time start = absl::Now();
  gm_->EndSession("g", c[1].session);
  const absl::Status failed = finish.Wait();
  EXPECT_LT(absl::Now() - start, kWait);
  ASSERT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_THAT(failed.message(), HasSubstr("rank 1's session ended"));
  // The unit got no gradient.
  absl::StatusOr<RegisterResult> v = gm_->GetShards(c[0], "");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->shards[4].grad, nullptr);
  // A client's retry of the finish gets the first cause, not "begin first".
  StatusCall retry;
  gm_->FinishReduceScatter(c[0], "", 4, GradReduce::kSum, false, Deadline(), retry.Callback());
  EXPECT_EQ(retry.Wait(), failed);
  EXPECT_EQ(finish.calls(), 1);
}


// ---------------------------------------------------------------------------------------------
// Commits, generations, rollback


TEST_F(GroupManagerTest, CommitsCountGenerationsAndAReformRollsBackToTheLast) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = Setup("g", 2, &regs);
  for (uint64_t step = 1; step <= 2; ++step) {
    Fill(regs[0], step);
    Fill(regs[1], step);
    for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(*g, step);
    }
  }
  EXPECT_EQ((*gm_->ListUnits("g", std::nullopt))[0].generation, 2u);
  // Step 3 is half done when rank 1 leaves: rank 0's commit fails at once, naming it.
  Fill(regs[0], 3);
  Fill(regs[1], 3);
  ASSERT_TRUE(gm_->Leave(c[1]).ok());
  CommitCall commit;
  gm_->Commit(c[0], "", Deadline(absl::Seconds(60)), commit.Callback());
  ASSERT_EQ(commit.Wait().status().code(), absl::StatusCode::kUnavailable) << commit.Wait().status();
  EXPECT_THAT(commit.Wait().status().message(), HasSubstr("rank 1's session left the group"));
  EXPECT_EQ(gm_->GetShards(c[0], "")->generation, 2u);
  // Rank 1 returns; the group re-forms and every rank is back at generation 2 before the
  // join completes.
  std::vector<std::string> modules;
  c[1] = Rejoin("g", 2, 1, &modules);
  EXPECT_THAT(modules, ElementsAre(""));
  EXPECT_TRUE(GroupStatus("g").ok()) << GroupStatus("g");
  EXPECT_TRUE(Holds(regs[0], 2));
  EXPECT_TRUE(Holds(regs[1], 2));
  // Rank 0 did not read its views since the rollback: its commit is refused on every rank.
  std::vector<absl::StatusOr<uint64_t>> refused = CommitAll(c);
  for (const absl::StatusOr<uint64_t>& g : refused) {
    ASSERT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
    EXPECT_THAT(g.status().message(), HasSubstr("refused by rank 0"));
  }
  // Both read their views (GetShards; rank 1 by re-attaching) and commit step 3.
  RegisterCall reattach;
  gm_->Register(c[1], "", ManifestFromJson(ModelJson()), PolicyFromJson(kPolicy),
                InitMode::kZeros, Deadline(), reattach.Callback());
  ASSERT_TRUE(reattach.Wait().ok()) << reattach.Wait().status();
  EXPECT_EQ(reattach.Wait()->generation, 2u);
  EXPECT_EQ(reattach.Wait()->shards[2].shard->segment_name(), regs[1].shards[2].shard->segment_name())
      << "re-attaching must hand out the same shards";
  ASSERT_TRUE(gm_->GetShards(c[0], "").ok());
  Fill(regs[0], 3);
  Fill(regs[1], 3);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 3u);
  }
  // Commit refusals that need no collective.
  CommitCall unknown;
  gm_->Commit(c[0], "nope", Deadline(), unknown.Callback());
  EXPECT_EQ(unknown.Wait().status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace flatshard::server
