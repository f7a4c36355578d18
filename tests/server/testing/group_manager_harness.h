#pragma once
// GroupManagerHarness: the one fixture of GroupManager's in-process unit tests
// (tests/server/{group,module,durable,checkpoint}). No gRPC, no daemon process:
//   - a real ShardStore whose segments carry a prefix private to the test (and to this
//     process), checked empty at teardown (a leak is a failure) and then cleaned up;
//   - a FakeClock for every deadline the manager reads (joins, leases, idle groups, deferred
//     failures); a test may pass GroupManagerOptions::clock = Clock::Real() instead;
//   - optional simulated GPUs (AddSimulatedGpus: host shared memory, memcpy copies) and an
//     optional state directory in a temp dir (UseStateDir);
//   - the manager built from options (Start), stopped (Stop) or stopped as a daemon's SIGTERM
//     with --keep_shards does it (StopKeepingShards), so that a second manager over a fresh
//     store with the same prefix can adopt what the first left (ReopenStateDir + Start +
//     AdoptGroups);
//   - helpers that act as the ranks' trainers, each rank on its own thread: join N ranks,
//     register a model, summon / end, reduce-scatter, commit; every wait has a real-time bound.
//
// Time: the manager's deadline loop wakes every 20 ms of real time and compares deadlines
// with the FakeClock, so a test moves the clock and then waits (Eventually, a few seconds of
// real time) for the outcome; TickProbe tells when the loop has looked at least once since a
// point, so "nothing happened yet" is checked without a fixed sleep. Collective waits run in
// real time (their timeout is the deadline minus the clock's now), so deadlines are
// `Deadline()` = the manager's clock + kWait and a passing test never waits for one.
//
// Usage:
//   using GroupManagerTest = testing::GroupManagerHarness;
//   TEST_F(GroupManagerTest, Something) {
//     Start();
//     std::vector<RegisterResult> regs;
//     std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
//     Fill(regs[0], 1.0f);
//     ...
//   }

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "common/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/durable/journal.h"
#include "server/durable/state_dir.h"
#include "server/gpu/device_context.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/testing/async_call.h"
#include "tests/testing/files.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::server::testing {

template <typename T>
using Async = ::flatshard::testing::AsyncCall<T>;

using JoinCall = Async<absl::StatusOr<JoinResult>>;
using RegisterCall = Async<absl::StatusOr<RegisterResult>>;
using SummonCall = Async<absl::StatusOr<SummonResult>>;
using StatusCall = Async<absl::Status>;
using CommitCall = Async<absl::StatusOr<uint64_t>>;

// How long a test waits in real time for an answer that should come at once.
inline constexpr absl::Duration kWait = absl::Seconds(5);
inline constexpr char kToken[] = "tok";

// Polls `cond` until it holds or `wait` of real time passed.
inline bool Eventually(const std::function<bool()>& cond, absl::Duration wait = kWait) {
  const absl::Time until = absl::Now() + wait;
  while (!cond()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

// Calls fn(i) for i in [0, n), each on its own thread, released together once every thread
// runs (ranks arriving at once); returns when all return.
inline void RunTogether(int n, const std::function<void(int)>& fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      ++ready;
      while (!go.load()) std::this_thread::yield();
      fn(i);
    });
  }
  while (ready.load() < n) std::this_thread::yield();
  go = true;
  for (std::thread& t : threads) t.join();
}

// ---- Buffers as float32 ----

inline float* Floats(const Buffer& b) { return static_cast<float*>(b.data()); }
inline int64_t FloatCount(const Buffer& b) {
  return b.bytes() / static_cast<int64_t>(sizeof(float));
}

// Every shard set to / holding `value` (an optimizer's in-place write).
inline void Fill(const std::vector<UnitShard>& shards, float value) {
  for (const UnitShard& s : shards) {
    for (int64_t i = 0; i < FloatCount(*s.shard); ++i) Floats(*s.shard)[i] = value;
  }
}
inline void Fill(const RegisterResult& r, float value) { Fill(r.shards, value); }
inline ::testing::AssertionResult Holds(const std::vector<UnitShard>& shards, float value) {
  for (const UnitShard& s : shards) {
    for (int64_t i = 0; i < FloatCount(*s.shard); ++i) {
      if (Floats(*s.shard)[i] != value) {
        return ::testing::AssertionFailure() << "unit " << s.unit << " element " << i << " holds "
                                             << Floats(*s.shard)[i] << ", not " << value;
      }
    }
  }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult Holds(const RegisterResult& r, float value) {
  return Holds(r.shards, value);
}

// The value of shard element `i` of unit `unit` of `rank` at step `step`: distinct between
// steps, ranks and units of the test models (shards under 10 elements), never zero.
inline float StepValue(uint64_t step, int rank, int unit, int64_t i) {
  return static_cast<float>(step * 1000 + rank * 100 + unit * 10 + i + 1);
}
// Writes step `step`'s values into every shard of `rank` (the optimizer, in place).
inline void WriteStep(const std::vector<UnitShard>& shards, uint64_t step, int rank) {
  for (const UnitShard& s : shards) {
    for (int64_t i = 0; i < FloatCount(*s.shard); ++i) {
      Floats(*s.shard)[i] = StepValue(step, rank, s.unit, i);
    }
  }
}
inline ::testing::AssertionResult HoldsStep(const std::vector<UnitShard>& shards, uint64_t step,
                                            int rank) {
  for (const UnitShard& s : shards) {
    for (int64_t i = 0; i < FloatCount(*s.shard); ++i) {
      const float want = StepValue(step, rank, s.unit, i);
      if (Floats(*s.shard)[i] != want) {
        return ::testing::AssertionFailure()
               << "rank " << rank << " unit " << s.unit << " element " << i << " holds "
               << Floats(*s.shard)[i] << ", step " << step << " is " << want;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- Summon results ----

// Units of the summon results, as rank 0 got them.
inline std::vector<int32_t> UnitsOf(const std::vector<absl::StatusOr<SummonResult>>& s) {
  return s.empty() || !s[0].ok() ? std::vector<int32_t>{} : s[0]->units;
}
// The summon ids (0 for a failed summon, which is a test failure).
inline std::vector<uint64_t> IdsOf(const std::vector<absl::StatusOr<SummonResult>>& s) {
  std::vector<uint64_t> ids;
  for (const absl::StatusOr<SummonResult>& r : s) {
    EXPECT_TRUE(r.ok()) << r.status();
    ids.push_back(r.ok() ? r->summon : 0);
  }
  return ids;
}
// Each rank writes 1000 * rank + i at every index i of every unit's full buffer.
inline void WriteRankPattern(const SummonResult& s, int rank) {
  for (const SummonedUnit& v : s.views) {
    for (int64_t i = 0; i < FloatCount(*v.params); ++i) Floats(*v.params)[i] = 1000 * rank + i;
  }
}

// ---- Models ----

struct Model {
  std::string manifest;  // flatshard.manifest/1 JSON
  std::string policy;    // flatshard.policy/1 JSON
};

// A model with nesting and odd sizes (padding on every unit at world size 2 and 3):
//   ""         Net    scale[3]
//   "enc"      Block  bias[6]
//   "enc.l1"   Linear weight[5, 3]
//   "enc.l2"   Linear weight[7]
//   "head"     Linear weight[head_numel]
inline std::string TestManifest(int head_numel = 10) {
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
inline constexpr char kTestPolicy[] = R"({"format": "flatshard.policy/1",
 "auto_wrap": {"kind": "module_types", "types": ["Block", "Linear"]}})";
inline Model TestModel(int head_numel = 10) { return {TestManifest(head_numel), kTestPolicy}; }

// examples/models/<name>.{manifest,policy}.json (e.g. "gpt_tied").
inline Model ExampleModel(const std::string& name) {
  return {::flatshard::testing::ExampleModelFile(name, "manifest"),
          ::flatshard::testing::ExampleModelFile(name, "policy")};
}

// ---- The fixture ----

class GroupManagerHarness : public ::testing::Test {
 protected:
  GroupManagerHarness() : prefix_(absl::StrCat("fsh_", ::getpid(), "_", TestId())) {
    store_options_.segment_prefix = prefix_;
  }
  ~GroupManagerHarness() override {
    Stop();
    gpus_.clear();
    simulated_gpus_.clear();
    state_dir_.reset();
    // A collective's completion runs on the engine's watchdog thread, which drops the
    // callback's captures (a failed reduce-scatter's fresh gradient, say) just after the
    // answer, and may still be doing so now: wait a moment. A leak stays a failure.
    if (check_segments_) {
      Eventually([&] { return ::flatshard::testing::ListSegments(prefix_).empty(); });
      EXPECT_THAT(::flatshard::testing::ListSegments(prefix_), ::testing::IsEmpty())
          << "segments left behind";
    }
    (void)UnlinkSegmentsWithPrefix(prefix_);  // whatever a failed test left
    std::error_code ignored;
    for (const std::string& dir : temp_dirs_) std::filesystem::remove_all(dir, ignored);
  }

  // 8 hex digits of the running test's full name: segment names stay short (a simulated GPU's
  // slab name must fit an IPC handle) and differ between the tests of a process.
  static std::string TestId() {
    const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string name = absl::StrCat(t->test_suite_name(), ".", t->name());
    return absl::StrCat(absl::Hex(std::hash<std::string>()(name) & 0xffffffffu, absl::kZeroPad8));
  }

  // ---- Setup ----

  // `n` simulated GPUs (ordinals 0..n-1) whose "device memory" is host shared memory with this
  // test's prefix; the next Start() gives the store their pools and the manager `gpus_` (a
  // test may replace an entry of `gpus_` by a context of its own over the same pool).
  void AddSimulatedGpus(int n) {
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::unique_ptr<gpu::DeviceContext>> sim = gpu::DeviceContext::CreateSimulated(
          static_cast<int>(simulated_gpus_.size()), gpu::DevicePoolOptions{}, prefix_);
      ASSERT_TRUE(sim.ok()) << sim.status();
      simulated_gpus_.push_back(std::shared_ptr<gpu::DeviceContext>(*std::move(sim)));
      gpus_.push_back(simulated_gpus_.back());
    }
  }

  // A state directory (--state_dir) in a fresh temp dir; the next Start() records into it.
  void UseStateDir() {
    state_path_ = MakeTempDir("state");
    absl::StatusOr<std::unique_ptr<state::StateDir>> dir =
        state::StateDir::Open(state_path_, /*sync=*/false);
    ASSERT_TRUE(dir.ok()) << dir.status();
    state_dir_ = *std::move(dir);
  }

  // A fresh directory for the test (removed at teardown); `tag` goes into its name.
  std::string MakeTempDir(const std::string& tag) {
    std::string base = ::testing::TempDir();
    while (base.size() > 1 && base.back() == '/') base.pop_back();
    std::string tmpl = absl::StrCat(base, "/", prefix_, "_", tag, "_XXXXXX");
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << tmpl;
    temp_dirs_.push_back(tmpl);
    return tmpl;
  }

  // A store from `store_options_` (the simulated GPUs' pools added) and a manager over it
  // with `options`; the FakeClock unless options.clock is set, the state directory (if any)
  // unless options.state_dir is set, the simulated GPUs (if any) unless options.gpus is set.
  void Start(GroupManagerOptions options = {}) {
    ShardStoreOptions so = store_options_;
    if (!gpus_.empty()) {
      for (const auto& sim : simulated_gpus_) so.device_pools.push_back(sim->pool());
      so.pin_host_memory = false;
      if (options.gpus.empty()) options.gpus = gpus_;
      if (options.copier == nullptr) options.copier = collective::MakeSimulatedDeviceCopier();
    }
    store_ = std::make_unique<ShardStore>(so);
    if (options.clock == nullptr) options.clock = &clock_;
    if (options.state_dir == nullptr) options.state_dir = state_dir_.get();
    clock_in_use_ = options.clock;
    gm_ = std::make_unique<GroupManager>(store_.get(), std::move(options));
  }
  // The manager, then its store (their segments go).
  void Stop() {
    gm_.reset();
    store_.reset();
  }
  // As flatshardd's SIGTERM with --keep_shards and a state directory (server/daemon.cc): the
  // manager shuts down, GPU daemons copy their committed device shards to host, the store
  // keeps the segments of shards, gradient shards and committed copies for the next daemon;
  // the records stay. Then both go.
  void StopKeepingShards() {
    gm_->Shutdown();
    gm_->KeepDeviceShards();
    store_->Shutdown(/*keep_durable=*/true);
    Stop();
  }
  // As the next daemon's start with the same --state_dir (server/daemon.cc): opens it again
  // and loads every record; removes this test's segments that no loaded record references
  // (refused records' segments are left alone). Start() then records into it, and
  // gm_->AdoptGroups(loaded.groups) takes the groups over.
  state::StateDir::Loaded ReopenStateDir() {
    state_dir_.reset();
    absl::StatusOr<std::unique_ptr<state::StateDir>> dir =
        state::StateDir::Open(state_path_, /*sync=*/false);
    EXPECT_TRUE(dir.ok()) << dir.status();
    if (!dir.ok()) return {};
    state_dir_ = *std::move(dir);
    state::StateDir::Loaded loaded = state_dir_->LoadAll();
    std::vector<std::string> keep;
    for (const state::StateDir::Refused& r : loaded.refused) {
      const std::string bytes = ::flatshard::testing::ReadFile(r.file);
      for (std::string& name : state::SegmentNamesIn(bytes, prefix_)) keep.push_back(name);
    }
    for (const state::GroupRecord& g : loaded.groups) {
      for (const std::string& name : SegmentsOf(g)) keep.push_back(name);
    }
    EXPECT_TRUE(state::UnlinkUnreferencedSegments(prefix_, keep).ok());
    return loaded;
  }
  // Every segment `record` names (with its leading "/").
  static std::vector<std::string> SegmentsOf(const state::GroupRecord& record) {
    std::vector<std::string> names;
    for (const state::ModuleRecord& m : record.modules) {
      for (const state::RankRecord& r : m.ranks) {
        for (const state::UnitRecord& u : r.units) {
          for (const state::BufferRecord& b : u.buffers) names.push_back(b.segment);
        }
      }
    }
    return names;
  }
  // The record of `group` in the state directory (its base file and journal), as written now
  // (NOT_FOUND: none).
  absl::StatusOr<state::GroupRecord> ReadRecord(const std::string& group) const {
    return state::ReadGroupRecord(FileSystem::Posix(), state_path_, group);
  }

  // Now on the manager's clock (the FakeClock before Start()).
  absl::Time Now() const { return clock_in_use_->Now(); }
  absl::Time Deadline(absl::Duration d = kWait) const { return Now() + d; }

  // ---- Callers ----

  static JoinArgs Args(const std::string& group, int world, int rank,
                       const std::string& token = kToken, int64_t uid = -1) {
    JoinArgs a;
    a.group = group;
    a.world_size = world;
    a.rank = rank;
    a.token = token;
    a.uid = uid;
    return a;
  }
  static Caller CallerOf(const std::string& group, int rank, uint64_t session,
                         const std::string& token = kToken, int64_t uid = -1) {
    return Caller{group, rank, token, session, uid};
  }

  // One join, waited for (its deadline `wait` from now on the manager's clock).
  absl::StatusOr<JoinResult> JoinAndWait(const JoinArgs& args, absl::Duration wait = kWait) {
    JoinCall j;
    gm_->Join(args, Deadline(wait), j.Callback());
    return std::move(j.Wait());
  }
  // A join that completes only when the other ranks arrive (or at `wait`); nobody waits.
  void JoinLater(const JoinArgs& args, absl::Duration wait) {
    gm_->Join(args, Deadline(wait), [](absl::StatusOr<JoinResult>) {});
  }

  // Ranks [0, world) of `group` join, each from its own thread; returns their callers (and
  // their join results in `results`). Every join must succeed.
  std::vector<Caller> JoinAll(const std::string& group, int world, int64_t uid = -1,
                              std::vector<JoinResult>* results = nullptr) {
    std::vector<JoinCall> joins(world);
    RunTogether(world, [&](int r) {
      gm_->Join(Args(group, world, r, kToken, uid), Deadline(), joins[r].Callback());
    });
    std::vector<Caller> callers;
    for (int r = 0; r < world; ++r) {
      absl::StatusOr<JoinResult>& j = joins[r].Wait();
      EXPECT_TRUE(j.ok()) << "rank " << r << ": " << j.status();
      callers.push_back(CallerOf(group, r, j.ok() ? j->session : 0, kToken, uid));
      if (results != nullptr) results->push_back(j.ok() ? *j : JoinResult{});
    }
    return callers;
  }
  // `rank` joins again (its group's other ranks are joined); returns its caller.
  Caller Rejoin(const std::string& group, int world, int rank,
                std::vector<std::string>* modules = nullptr) {
    absl::StatusOr<JoinResult> r = JoinAndWait(Args(group, world, rank));
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok() && modules != nullptr) *modules = r->registered_modules;
    return CallerOf(group, rank, r.ok() ? r->session : 0);
  }
  Caller Rejoin(const std::vector<Caller>& group, int rank) {
    return Rejoin(group[0].group, static_cast<int>(group.size()), rank);
  }
  // Opens every caller's lease (else its session ends lease_timeout after its join).
  void AttachLeases(const std::vector<Caller>& callers) {
    for (const Caller& c : callers) EXPECT_TRUE(gm_->AttachLease(c).ok()) << "rank " << c.rank;
  }

  // ---- Registration ----

  // Every caller registers `model_` as `module` (per rank: `manifest_of(rank)` instead of
  // model_.manifest, `init_of(rank)` instead of `init`), all at once; returns their results.
  std::vector<absl::StatusOr<RegisterResult>> RegisterAll(
      const std::vector<Caller>& callers, InitMode init, const std::string& module = "",
      const std::function<std::string(int rank)>& manifest_of = nullptr,
      const std::function<InitMode(int rank)>& init_of = nullptr) {
    std::vector<RegisterCall> calls(callers.size());
    RunTogether(static_cast<int>(callers.size()), [&](int i) {
      const int rank = callers[i].rank;
      gm_->Register(callers[i], module,
                    ManifestFromJson(manifest_of ? manifest_of(rank) : model_.manifest),
                    PolicyFromJson(model_.policy), init_of ? init_of(rank) : init, Deadline(),
                    calls[i].Callback());
    });
    std::vector<absl::StatusOr<RegisterResult>> out;
    for (RegisterCall& c : calls) out.push_back(std::move(c.Wait()));
    return out;
  }
  // Joins `world` ranks of `group` and registers `model_` as module "" with zeros; every step
  // must succeed. The results go to `regs` (one per rank).
  std::vector<Caller> JoinAndRegister(const std::string& group, int world,
                                      std::vector<RegisterResult>* regs = nullptr,
                                      int64_t uid = -1) {
    std::vector<Caller> c = JoinAll(group, world, uid);
    std::vector<absl::StatusOr<RegisterResult>> r = RegisterAll(c, InitMode::kZeros);
    for (int i = 0; i < world; ++i) {
      EXPECT_TRUE(r[i].ok()) << "rank " << i << ": " << r[i].status();
      if (regs != nullptr) regs->push_back(r[i].ok() ? *r[i] : RegisterResult{});
    }
    return c;
  }

  // ---- Collectives ----

  // Every caller summons `path` of `module` with `options`, all at once.
  std::vector<absl::StatusOr<SummonResult>> SummonAll(const std::vector<Caller>& callers,
                                                      const std::string& path,
                                                      const SummonOptions& options,
                                                      const std::string& module = "") {
    std::vector<SummonCall> calls(callers.size());
    RunTogether(static_cast<int>(callers.size()), [&](int i) {
      gm_->Summon(callers[i], module, path, options, Deadline(), calls[i].Callback());
    });
    std::vector<absl::StatusOr<SummonResult>> out;
    for (SummonCall& c : calls) out.push_back(std::move(c.Wait()));
    return out;
  }
  // Every caller ends its summon (ids[i]).
  std::vector<absl::Status> EndAll(const std::vector<Caller>& callers,
                                   const std::vector<uint64_t>& ids) {
    std::vector<StatusCall> calls(callers.size());
    RunTogether(static_cast<int>(callers.size()), [&](int i) {
      gm_->EndSummon(callers[i], ids[i], Deadline(), calls[i].Callback());
    });
    std::vector<absl::Status> out;
    for (StatusCall& c : calls) out.push_back(c.Wait());
    return out;
  }
  // Every caller commits `module`.
  std::vector<absl::StatusOr<uint64_t>> CommitAll(const std::vector<Caller>& callers,
                                                  const std::string& module = "") {
    std::vector<CommitCall> calls(callers.size());
    RunTogether(static_cast<int>(callers.size()),
                [&](int i) { gm_->Commit(callers[i], module, Deadline(), calls[i].Callback()); });
    std::vector<absl::StatusOr<uint64_t>> out;
    for (CommitCall& c : calls) out.push_back(std::move(c.Wait()));
    return out;
  }
  // Every caller writes (rank + 1) * (i + 1) into the full gradient of `unit` of module ""
  // and reduce-scatters it.
  std::vector<absl::Status> ReduceScatterAll(const std::vector<Caller>& callers, int32_t unit,
                                             ReduceOp op, bool accumulate, absl::Time deadline) {
    std::vector<StatusCall> calls(callers.size());
    RunTogether(static_cast<int>(callers.size()), [&](int i) {
      absl::StatusOr<std::shared_ptr<Buffer>> full = gm_->BeginReduceScatter(callers[i], "", unit);
      if (!full.ok()) {
        calls[i].Callback()(full.status());
        return;
      }
      const int r = callers[i].rank;
      for (int64_t k = 0; k < FloatCount(**full); ++k) Floats(**full)[k] = (r + 1) * (k + 1);
      gm_->FinishReduceScatter(callers[i], "", unit, op, accumulate, deadline, calls[i].Callback());
    });
    std::vector<absl::Status> out;
    for (StatusCall& x : calls) out.push_back(x.Wait());
    return out;
  }
  // A read-only summon of every unit of module "" on every rank; returns each unit's full
  // buffer as rank 0 sees it (every rank's must be equal), then ends it.
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

  // ---- Inspection ----

  // The status of `group`'s collectives (OK when the group is not hosted).
  absl::Status GroupStatus(const std::string& group) const {
    for (const GroupManager::GroupInfo& g : gm_->ListGroups()) {
      if (g.group == group) return g.status;
    }
    return absl::OkStatus();
  }
  // The committed generation of `module` of `group` (ListUnits; the lowest over the local
  // ranks); nullopt when the group or the module is not hosted.
  std::optional<uint64_t> GenerationOf(const std::string& group,
                                       const std::string& module = "") const {
    absl::StatusOr<std::vector<GroupManager::ModuleUnits>> units = gm_->ListUnits(group, module);
    if (!units.ok() || units->empty()) return std::nullopt;
    return (*units)[0].generation;
  }
  bool Hosts(const std::string& group) const {
    for (const GroupManager::GroupInfo& g : gm_->ListGroups()) {
      if (g.group == group) return true;
    }
    return false;
  }
  // This test's segments in /dev/shm (names without the leading "/").
  std::vector<std::string> Segments() const { return ::flatshard::testing::ListSegments(prefix_); }

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
  const std::string prefix_;
  // What the next Start() builds the store from (segment_prefix: prefix_).
  ShardStoreOptions store_options_;
  // What RegisterAll and JoinAndRegister register.
  Model model_ = TestModel();
  // False: no check at teardown that every segment of the test is gone.
  bool check_segments_ = true;
  std::vector<std::shared_ptr<gpu::DeviceContext>> simulated_gpus_;
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  std::string state_path_;
  std::unique_ptr<state::StateDir> state_dir_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<GroupManager> gm_;

 private:
  Clock* clock_in_use_ = &clock_;
  std::vector<std::string> temp_dirs_;
};

}  // namespace flatshard::server::testing
