// CollectiveEngine: op_seq assignment per (group, rank), ordering, deadlines and the watchdog,
// sticky errors, abort/removal, re-entrant callbacks. Uses the inproc backend for real data and
// a fake Communicator that captures ops where the test must control completion.

#include "server/collective/collective_engine.h"

#include <deque>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_backend.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/ring_algorithms.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/metrics/daemon_metrics.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::flatshard::testing::RunRanks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

CollectiveBackend& Inproc() {
  static CollectiveBackend* backend = CreateInprocBackend().value().release();
  return *backend;
}

std::shared_ptr<CollectiveGroup> AddInprocGroup(CollectiveEngine& engine, const std::string& id,
                                                int world) {
  GroupSpec spec = GroupSpec::AllLocal(id, world);
  return engine.AddGroup(spec, Inproc().Connect(spec).value()).value();
}

// Captures every op; the test completes them (CompleteNext) or not at all.
class FakeCommunicator final : public Communicator {
 public:
  explicit FakeCommunicator(std::string backend_name = "fake")
      : backend_name_(std::move(backend_name)) {}

  struct Call {
    CollectiveKind kind;
    OpOptions options;
    DoneCallback done;
  };

  void AllGather(ConstBuffer, MutableBuffer, const OpOptions& o, DoneCallback done) override {
    Record(CollectiveKind::kAllGather, o, std::move(done));
  }
  void ReduceScatter(ConstBuffer, MutableBuffer, ReduceOp, const OpOptions& o,
                     DoneCallback done) override {
    Record(CollectiveKind::kReduceScatter, o, std::move(done));
  }
  void Broadcast(MutableBuffer, int, const OpOptions& o, DoneCallback done) override {
    Record(CollectiveKind::kBroadcast, o, std::move(done));
  }
  void Gather(ConstBuffer, MutableBuffer, int, const OpOptions& o, DoneCallback done) override {
    Record(CollectiveKind::kGather, o, std::move(done));
  }
  void Abort(absl::Status reason) override {
    absl::MutexLock lock(&mu_);
    aborts_.push_back(reason);
  }
  absl::Status status() const override { return absl::OkStatus(); }
  std::vector<PendingOpInfo> PendingOps() const override { return {}; }
  absl::string_view backend_name() const override { return backend_name_; }

  // Completes the oldest captured op with `s` (outside the lock); false if none.
  bool CompleteNext(absl::Status s) {
    DoneCallback done;
    {
      absl::MutexLock lock(&mu_);
      if (calls_.empty()) return false;
      done = std::move(calls_.front().done);
      calls_.pop_front();
    }
    std::move(done)(std::move(s));
    return true;
  }
  std::vector<uint64_t> SeqsOf(int rank) const {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> seqs;
    for (const auto& [rank_seq, unit] : history_) {
      if (rank_seq.first == rank) seqs.push_back(rank_seq.second);
    }
    return seqs;
  }
  std::vector<Call*> calls() {
    absl::MutexLock lock(&mu_);
    std::vector<Call*> out;
    for (Call& c : calls_) out.push_back(&c);
    return out;
  }
  std::vector<absl::Status> aborts() const {
    absl::MutexLock lock(&mu_);
    return aborts_;
  }

 private:
  void Record(CollectiveKind kind, const OpOptions& o, DoneCallback done) {
    absl::MutexLock lock(&mu_);
    history_.push_back({{o.rank, o.op_seq}, o.unit});
    calls_.push_back(Call{kind, o, std::move(done)});
  }

  const std::string backend_name_;
  mutable absl::Mutex mu_;
  std::deque<Call> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::pair<int, uint64_t>, int64_t>> history_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> aborts_ ABSL_GUARDED_BY(mu_);
};

struct FakeGroup {
  FakeCommunicator* fake;
  std::shared_ptr<CollectiveGroup> group;
};

FakeGroup AddFakeGroup(CollectiveEngine& engine, int world) {
  auto comm = std::make_unique<FakeCommunicator>();
  FakeCommunicator* fake = comm.get();
  auto group = engine.AddGroup(GroupSpec::AllLocal("fake", world), std::move(comm)).value();
  return {fake, group};
}

CollectiveOp SmallAllGather(int64_t unit, const float* in, float* out, int world) {
  return CollectiveOp::AllGather(
      unit, ConstBuffer{in, 4, DType::kFloat32},
      MutableBuffer{out, 4 * static_cast<size_t>(world), DType::kFloat32});
}

TEST(CollectiveEngineTest, NumbersOpsPerRankInSubmissionOrder) {
  CollectiveEngine engine;
  FakeGroup g = AddFakeGroup(engine, 2);
  float in = 0, out[2];
  DoneRecorder done[5];
  g.group->Submit(0, SmallAllGather(10, &in, out, 2), done[0].Callback());
  g.group->Submit(0, SmallAllGather(11, &in, out, 2), done[1].Callback());
  g.group->Submit(1, SmallAllGather(10, &in, out, 2), done[2].Callback());
  g.group->Submit(0, SmallAllGather(12, &in, out, 2), done[3].Callback());
  g.group->Submit(1, SmallAllGather(11, &in, out, 2), done[4].Callback());
  EXPECT_THAT(g.fake->SeqsOf(0), ElementsAre(1, 2, 3));
  EXPECT_THAT(g.fake->SeqsOf(1), ElementsAre(1, 2));
  EXPECT_EQ(g.group->last_op_seq(0), 3u);
  EXPECT_EQ(g.group->last_op_seq(1), 2u);
  while (g.fake->CompleteNext(absl::OkStatus())) {
  }
  for (DoneRecorder& d : done) EXPECT_TRUE(d.Wait().ok());
}

TEST(CollectiveEngineTest, PassesUnitNameAndDeadlineToTheBackend) {
  CollectiveEngine engine;
  FakeGroup g = AddFakeGroup(engine, 1);
  float in = 0, out = 0;
  CollectiveOp op = SmallAllGather(42, &in, &out, 1);
  op.name = "unshard";
  op.timeout = absl::Seconds(30);
  const absl::Time before = absl::Now();
  g.group->Submit(0, std::move(op), [](absl::Status) {});
  std::vector<FakeCommunicator::Call*> calls = g.fake->calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]->kind, CollectiveKind::kAllGather);
  EXPECT_EQ(calls[0]->options.unit, 42);
  EXPECT_EQ(calls[0]->options.name, "unshard");
  EXPECT_EQ(calls[0]->options.op_seq, 1u);
  EXPECT_GE(calls[0]->options.deadline, before + absl::Seconds(30));
  EXPECT_LE(calls[0]->options.deadline, absl::Now() + absl::Seconds(30));
  g.fake->CompleteNext(absl::OkStatus());
}

TEST(CollectiveEngineTest, MovesDataThroughTheInprocBackend) {
  constexpr int kWorld = 3;
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", kWorld);
  std::vector<std::vector<float>> shard(kWorld, std::vector<float>(4));
  std::vector<float> full(4 * kWorld, -1);  // shared by the ranks: one copy per node
  std::vector<std::vector<float>> grads(kWorld, std::vector<float>(4 * kWorld));
  std::vector<std::vector<float>> grad_shard(kWorld, std::vector<float>(4));
  for (int r = 0; r < kWorld; ++r) {
    std::iota(shard[r].begin(), shard[r].end(), 10.0f * r);
    std::fill(grads[r].begin(), grads[r].end(), static_cast<float>(r + 1));
  }
  RunRanks(kWorld, [&](int r) {
    DoneRecorder ag, rs, bc;
    group->Submit(
        r,
        CollectiveOp::AllGather(1, ConstBuffer{shard[r].data(), 16, DType::kFloat32},
                                MutableBuffer{full.data(), full.size() * 4, DType::kFloat32}),
        ag.Callback());
    group->Submit(r,
                  CollectiveOp::ReduceScatter(
                      1, ConstBuffer{grads[r].data(), grads[r].size() * 4, DType::kFloat32},
                      MutableBuffer{grad_shard[r].data(), 16, DType::kFloat32}, ReduceOp::kAvg),
                  rs.Callback());
    EXPECT_TRUE(ag.Wait().ok()) << ag.status();
    EXPECT_TRUE(rs.Wait().ok()) << rs.status();
  });
  for (int k = 0; k < kWorld; ++k) {
    for (int i = 0; i < 4; ++i) EXPECT_EQ(full[k * 4 + i], 10.0f * k + i);
  }
  for (int r = 0; r < kWorld; ++r) {
    for (float v : grad_shard[r]) EXPECT_EQ(v, (1.0f + 2.0f + 3.0f) / 3.0f);
  }
  EXPECT_TRUE(group->PendingOps().empty());
  EXPECT_TRUE(group->status().ok());
}

TEST(CollectiveEngineTest, RankZeroOnlyGatherOtherRanksAllocateNothing) {
  constexpr int kWorld = 4;
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", kWorld);
  std::vector<float> shards(kWorld);
  std::iota(shards.begin(), shards.end(), 1.0f);
  std::vector<float> full(kWorld, 0);
  RunRanks(kWorld, [&](int r) {
    DoneRecorder done;
    MutableBuffer out;
    if (r == 0) out = MutableBuffer{full.data(), full.size() * 4, DType::kFloat32};
    group->Submit(r, CollectiveOp::Gather(5, ConstBuffer{&shards[r], 4, DType::kFloat32}, out, 0),
                  done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  EXPECT_THAT(full, ElementsAre(1, 2, 3, 4));
}

TEST(CollectiveEngineTest, DivergentRanksFailWithAbortedAndTheGroupStaysFailed) {
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 2);
  float in[2] = {0, 0}, out[4];
  DoneRecorder ag, rs, later;
  group->Submit(0, SmallAllGather(3, in, out, 2), ag.Callback());
  group->Submit(1,
                CollectiveOp::ReduceScatter(3, ConstBuffer{in, 8, DType::kFloat32},
                                            MutableBuffer{out, 4, DType::kFloat32}, ReduceOp::kSum),
                rs.Callback());
  const absl::Status s = ag.Wait();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_EQ(s.message(),
            "collective mismatch at op_seq 1: rank 0 called AllGather(unit 3, 4 bytes, float32) "
            "but rank 1 called ReduceScatter(unit 3, 4 bytes, float32, sum)");
  EXPECT_EQ(rs.Wait(), s);
  EXPECT_EQ(group->status(), s);
  group->Submit(0, SmallAllGather(4, in, out, 2), later.Callback());
  EXPECT_EQ(later.Wait(), s);
}

TEST(CollectiveEngineTest, TimeoutNamesTheRanksThatNeverArrived) {
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 3);
  float in = 0, out[3];
  CollectiveOp op = SmallAllGather(8, &in, out, 3);
  op.timeout = absl::Milliseconds(50);
  DoneRecorder done, late;
  group->Submit(0, op, done.Callback());
  const absl::Status s = done.Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("op_seq 1 AllGather(unit 8, 4 bytes, float32): ranks 1, 2 did not "
                        "arrive within"));
  group->Submit(1, op, late.Callback());
  EXPECT_EQ(late.Wait(), s);
  EXPECT_EQ(group->status(), s);
}

TEST(CollectiveEngineTest, WatchdogCompletesOpsOfAHungBackendOnce) {
  EngineOptions options;
  options.watchdog_grace = absl::Milliseconds(20);
  CollectiveEngine engine(options);
  FakeGroup g = AddFakeGroup(engine, 2);
  float in = 0, out[2];
  CollectiveOp op = SmallAllGather(9, &in, out, 2);
  op.timeout = absl::Milliseconds(30);
  DoneRecorder done;
  g.group->Submit(1, op, done.Callback());
  const absl::Status s = done.Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("op_seq 1 AllGather(unit 9) on rank 1: the backend did not complete it"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("(engine watchdog)"));
  ASSERT_FALSE(g.fake->aborts().empty());
  EXPECT_EQ(g.fake->aborts()[0], s);
  // The backend answers late: the callback does not run again.
  EXPECT_TRUE(g.fake->CompleteNext(absl::OkStatus()));
  EXPECT_EQ(done.calls(), 1);
}

TEST(CollectiveEngineTest, FirstBackendErrorIsStickyAndAbortsTheCommunicator) {
  CollectiveEngine engine;
  FakeGroup g = AddFakeGroup(engine, 2);
  float in = 0, out[2];
  DoneRecorder a, b, c;
  g.group->Submit(0, SmallAllGather(1, &in, out, 2), a.Callback());
  g.group->Submit(1, SmallAllGather(1, &in, out, 2), b.Callback());
  const absl::Status first = absl::UnavailableError("peer node-b down");
  g.fake->CompleteNext(first);
  g.fake->CompleteNext(absl::InternalError("later, different"));
  EXPECT_EQ(a.Wait(), first);
  EXPECT_EQ(b.Wait(), first);  // the same sticky status, not the backend's second error
  EXPECT_THAT(g.fake->aborts(), ElementsAre(first));
  g.group->Submit(0, SmallAllGather(2, &in, out, 2), c.Callback());
  EXPECT_EQ(c.Wait(), first);
  EXPECT_TRUE(g.fake->calls().empty());  // failed without reaching the backend
}

TEST(CollectiveEngineTest, AbortFailsPendingAndLaterOpsOffTheCallersThread) {
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 2);
  float in = 0, out[2];
  DoneRecorder pending, later;
  // The caller holds a lock that the pending op's callback takes (as GroupManager does): the
  // callback must not run inside Abort.
  absl::Mutex caller_lock;
  std::thread::id callback_thread;
  group->Submit(0, SmallAllGather(1, &in, out, 2), [&](absl::Status s) {
    absl::MutexLock lock(&caller_lock);
    callback_thread = std::this_thread::get_id();
    pending.Callback()(std::move(s));
  });
  {
    absl::MutexLock lock(&caller_lock);
    group->Abort(absl::AbortedError("operator drained the node"));
    EXPECT_EQ(group->status(), absl::AbortedError("operator drained the node"));  // at once
  }
  EXPECT_EQ(pending.Wait(), absl::AbortedError("operator drained the node"));
  {
    absl::MutexLock lock(&caller_lock);
    EXPECT_NE(callback_thread, std::this_thread::get_id());
  }
  group->Submit(1, SmallAllGather(1, &in, out, 2), later.Callback());
  EXPECT_EQ(later.Wait(), pending.status());
}

TEST(CollectiveEngineTest, RemoveGroupAbortsAndForgetsIt) {
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 2);
  float in = 0, out[2];
  DoneRecorder pending, unknown;
  group->Submit(0, SmallAllGather(1, &in, out, 2), pending.Callback());
  ASSERT_TRUE(engine.RemoveGroup("job", absl::AbortedError("job left")).ok());
  EXPECT_EQ(pending.Wait(), absl::AbortedError("job left"));
  EXPECT_TRUE(absl::IsNotFound(engine.FindGroup("job").status()));
  EXPECT_TRUE(absl::IsNotFound(engine.RemoveGroup("job", absl::OkStatus())));
  engine.Submit("job", 0, SmallAllGather(1, &in, out, 2), unknown.Callback());
  EXPECT_TRUE(absl::IsNotFound(unknown.Wait())) << unknown.status();
}

TEST(CollectiveEngineTest, DestroyingTheEngineFailsPendingOps) {
  DoneRecorder pending;
  float in = 0, out[2];
  {
    CollectiveEngine engine;
    auto group = AddInprocGroup(engine, "job", 2);
    group->Submit(1, SmallAllGather(1, &in, out, 2), pending.Callback());
  }
  EXPECT_TRUE(absl::IsAborted(pending.Wait())) << pending.status();
  EXPECT_EQ(pending.calls(), 1);
}

TEST(CollectiveEngineTest, DroppingTheLastReferenceFailsPendingOps) {
  DoneRecorder pending;
  float in = 0, out[2];
  CollectiveEngine engine;
  {
    auto group = AddInprocGroup(engine, "job", 2);
    group->Submit(1, SmallAllGather(1, &in, out, 2), pending.Callback());
    ASSERT_TRUE(engine.RemoveGroup("job", absl::OkStatus()).ok());
  }
  EXPECT_TRUE(absl::IsAborted(pending.Wait())) << pending.status();
  EXPECT_EQ(pending.calls(), 1);
}

TEST(CollectiveEngineTest, UnknownRankFailsOnlyThatSubmit) {
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 1);
  float in = 1, out = 0;
  DoneRecorder bad, good;
  group->Submit(1, SmallAllGather(1, &in, &out, 1), bad.Callback());
  EXPECT_TRUE(absl::IsInvalidArgument(bad.Wait())) << bad.status();
  group->Submit(0, SmallAllGather(1, &in, &out, 1), good.Callback());
  EXPECT_TRUE(good.Wait().ok()) << good.status();
  EXPECT_EQ(out, 1);
}

TEST(CollectiveEngineTest, GroupIdsAreUnique) {
  CollectiveEngine engine;
  AddInprocGroup(engine, "b", 1);
  AddInprocGroup(engine, "a", 1);
  GroupSpec spec = GroupSpec::AllLocal("a", 1);
  EXPECT_TRUE(
      absl::IsAlreadyExists(engine.AddGroup(spec, Inproc().Connect(spec).value()).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(engine.AddGroup(spec, nullptr).status()));
  EXPECT_THAT(engine.GroupIds(), ElementsAre("a", "b"));
}

TEST(CollectiveEngineTest, CallbacksMaySubmitTheNextOpWithoutRecursing) {
  // world_size 1 completes every op inside Submit; a callback that submits again must be
  // queued behind the running dispatch, or 20000 ops would nest 20000 frames deep.
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 1);
  constexpr int kOps = 20000;
  float in = 7, out = 0;
  int completed = 0;
  std::function<void()> next = [&] {
    group->Submit(0, SmallAllGather(1, &in, &out, 1), [&](absl::Status s) {
      ASSERT_TRUE(s.ok()) << s;
      if (++completed < kOps) next();
    });
  };
  next();
  EXPECT_EQ(completed, kOps);
  EXPECT_EQ(group->last_op_seq(0), static_cast<uint64_t>(kOps));
}

TEST(CollectiveEngineTest, ConcurrentRanksChainingOpsFromCallbacks) {
  constexpr int kWorld = 4;
  constexpr int kOps = 50;
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", kWorld);
  std::vector<float> in(kWorld);
  std::iota(in.begin(), in.end(), 0.0f);
  std::vector<std::vector<float>> out(kWorld, std::vector<float>(kWorld));
  absl::Mutex mu;
  int finished = 0;
  std::vector<std::function<void(int)>> next(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    next[r] = [&, r](int i) {
      group->Submit(r, SmallAllGather(i, &in[r], out[r].data(), kWorld), [&, r, i](absl::Status s) {
        EXPECT_TRUE(s.ok()) << s;
        if (i + 1 < kOps) {
          next[r](i + 1);
        } else {
          absl::MutexLock lock(&mu);
          ++finished;
        }
      });
    };
  }
  RunRanks(kWorld, [&](int r) { next[r](0); });
  absl::MutexLock lock(&mu);
  auto all = [&] { return finished == kWorld; };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(20)));
  for (int r = 0; r < kWorld; ++r) EXPECT_THAT(out[r], ElementsAre(0, 1, 2, 3));
}

// --- SubmitAll: one callback for several ops ------------------------------------------------

TEST(CollectiveEngineTest, SubmitAllOfNoOpsCompletesAtOnce) {
  CollectiveEngine engine;
  FakeGroup g = AddFakeGroup(engine, 2);
  DoneRecorder done;
  g.group->SubmitAll(0, {}, absl::Seconds(1), done.Callback());
  EXPECT_EQ(done.calls(), 1);  // before SubmitAll returned
  EXPECT_TRUE(done.status().ok()) << done.status();
  EXPECT_TRUE(g.fake->calls().empty());
  EXPECT_EQ(g.group->last_op_seq(0), 0u);
}

TEST(CollectiveEngineTest, SubmitAllRunsOneCallbackAfterTheLastOpWithTheFirstError) {
  CollectiveEngine engine;
  FakeGroup g = AddFakeGroup(engine, 2);
  float in = 0, out[2];
  DoneRecorder done;
  std::vector<CollectiveOp> ops;
  for (int unit = 0; unit < 3; ++unit) ops.push_back(SmallAllGather(unit, &in, out, 2));
  g.group->SubmitAll(1, std::move(ops), absl::Seconds(30), done.Callback());
  EXPECT_THAT(g.fake->SeqsOf(1), ElementsAre(1, 2, 3));
  ASSERT_TRUE(g.fake->CompleteNext(absl::OkStatus()));
  EXPECT_FALSE(done.done());
  const absl::Status first = absl::UnavailableError("peer node-b down");
  ASSERT_TRUE(g.fake->CompleteNext(first));
  EXPECT_FALSE(done.done());  // one op is still running: its buffers are still in use
  ASSERT_TRUE(g.fake->CompleteNext(absl::InternalError("a later, different error")));
  EXPECT_EQ(done.Wait(), first);
  EXPECT_EQ(done.calls(), 1);
}

TEST(CollectiveEngineTest, SubmitAllGivesEveryOpTheTimeoutFromNow) {
  CollectiveEngine engine;
  FakeGroup g = AddFakeGroup(engine, 2);
  float in = 0, out[2];
  std::vector<CollectiveOp> ops;
  for (int unit = 0; unit < 2; ++unit) {
    ops.push_back(SmallAllGather(unit, &in, out, 2));
    ops.back().timeout = absl::Hours(1);  // replaced by SubmitAll's
  }
  DoneRecorder done;
  const absl::Time before = absl::Now();
  g.group->SubmitAll(0, std::move(ops), absl::Seconds(30), done.Callback());
  const absl::Time after = absl::Now();
  std::vector<FakeCommunicator::Call*> calls = g.fake->calls();
  ASSERT_EQ(calls.size(), 2u);
  for (FakeCommunicator::Call* c : calls) {
    EXPECT_GE(c->options.deadline, before + absl::Seconds(30));
    EXPECT_LE(c->options.deadline, after + absl::Seconds(30));
  }
  // A deadline already passed is a zero timeout, not a negative one.
  float in2 = 0, out2[2];
  std::vector<CollectiveOp> late;
  late.push_back(SmallAllGather(5, &in2, out2, 2));
  DoneRecorder late_done;
  g.group->SubmitAll(0, std::move(late), -absl::Seconds(5), late_done.Callback());
  calls = g.fake->calls();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_LE(calls[2]->options.deadline, absl::Now());
  EXPECT_GE(calls[2]->options.deadline, after);
  while (g.fake->CompleteNext(absl::OkStatus())) {
  }
  EXPECT_TRUE(done.Wait().ok());
  EXPECT_TRUE(late_done.Wait().ok());
}

TEST(CollectiveEngineTest, SubmitAllTimesOutEachOpAndCallsBackOnce) {
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", 2);
  float in[2] = {0, 0}, out[2][2];
  std::vector<CollectiveOp> ops;
  ops.push_back(SmallAllGather(1, &in[0], out[0], 2));
  ops.push_back(SmallAllGather(2, &in[1], out[1], 2));
  DoneRecorder done;
  group->SubmitAll(0, std::move(ops), absl::Milliseconds(50), done.Callback());
  const absl::Status s = done.Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 did not arrive within"));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(done.calls(), 1);
}

TEST(CollectiveEngineTest, SubmitAllMovesDataThroughTheInprocBackend) {
  constexpr int kWorld = 2;
  CollectiveEngine engine;
  auto group = AddInprocGroup(engine, "job", kWorld);
  float in[kWorld][2] = {{1, 2}, {3, 4}};
  float out[kWorld][2][kWorld];
  std::vector<DoneRecorder> done(kWorld);
  RunRanks(kWorld, [&](int r) {
    std::vector<CollectiveOp> ops;
    for (int k = 0; k < 2; ++k) ops.push_back(SmallAllGather(k, &in[r][k], out[r][k], kWorld));
    group->SubmitAll(r, std::move(ops), absl::Seconds(20), done[r].Callback());
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(done[r].Wait().ok()) << done[r].status();
    EXPECT_EQ(done[r].calls(), 1);
    EXPECT_THAT(out[r][0], ElementsAre(1, 3));
    EXPECT_THAT(out[r][1], ElementsAre(2, 4));
  }
}

// --- The metrics' backend label comes from the communicator ---------------------------------

double BackendBytes(absl::string_view backend) {
  return metrics::GetDaemonMetrics().collective_bytes.WithLabels({backend}).value();
}

TEST(CollectiveEngineTest, MetricsCountBytesUnderTheCommunicatorsBackend) {
  CollectiveEngine engine;
  // All ranks local and no addresses: the old guess would have said "inproc".
  auto comm = std::make_unique<FakeCommunicator>("nccl");
  FakeCommunicator* fake = comm.get();
  auto group = engine.AddGroup(GroupSpec::AllLocal("gpu-job", 2), std::move(comm)).value();
  EXPECT_EQ(group->backend_name(), "nccl");
  const double nccl_before = BackendBytes("nccl");
  const double inproc_before = BackendBytes("inproc");
  float in = 0, out[2];
  DoneRecorder done;
  group->Submit(0, SmallAllGather(1, &in, out, 2), done.Callback());
  ASSERT_TRUE(fake->CompleteNext(absl::OkStatus()));
  ASSERT_TRUE(done.Wait().ok());
  EXPECT_EQ(BackendBytes("nccl") - nccl_before, 8.0);  // the larger buffer: 2 floats
  EXPECT_EQ(BackendBytes("inproc"), inproc_before);
}

TEST(CollectiveEngineTest, StagedCommunicatorsNameTheirInnerBackend) {
  GroupSpec spec = GroupSpec::AllLocal("staged", 1);
  auto host = MakeStagingCommunicator(std::make_unique<FakeCommunicator>("ucx"), MemoryKind::kHost,
                                      spec, MakeSimulatedDeviceCopier());
  EXPECT_EQ(host->backend_name(), "ucx+staging");
  auto device = MakeStagingCommunicator(std::make_unique<FakeCommunicator>("nccl"),
                                        MemoryKind::kCuda, spec, MakeSimulatedDeviceCopier());
  EXPECT_EQ(device->backend_name(), "nccl");

  CollectiveEngine engine;
  auto group = engine.AddGroup(spec, Inproc().Connect(spec).value()).value();
  EXPECT_EQ(group->backend_name(), "inproc");
  GroupSpec staged_spec = GroupSpec::AllLocal("staged-inproc", 1);
  auto staged =
      engine
          .AddGroup(staged_spec, MakeStagingCommunicator(Inproc().Connect(staged_spec).value(),
                                                         MemoryKind::kHost, staged_spec,
                                                         MakeSimulatedDeviceCopier()))
          .value();
  EXPECT_EQ(staged->backend_name(), "inproc+staging");
  const double before = BackendBytes("inproc+staging");
  float in = 7, out = 0;
  DoneRecorder done;
  staged->Submit(0, SmallAllGather(1, &in, &out, 1), done.Callback());
  ASSERT_TRUE(done.Wait().ok()) << done.status();
  EXPECT_EQ(out, 7);
  EXPECT_EQ(BackendBytes("inproc+staging") - before, 4.0);
}

TEST(CollectiveEngineTest, RingCommunicatorsNameTheBackendTheyRunFor) {
  GroupSpec spec = GroupSpec::AllLocal("ring", 2);
  auto plain = NewRingCommunicator(spec, std::make_shared<InprocTransport>(2)).value();
  EXPECT_EQ(plain->backend_name(), "ring");
  RingOptions options;
  options.backend_name = "ucx";
  auto ucx = NewRingCommunicator(spec, std::make_shared<InprocTransport>(2), options).value();
  EXPECT_EQ(ucx->backend_name(), "ucx");
}

}  // namespace
}  // namespace flatshard::collective
