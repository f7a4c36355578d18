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

}  // namespace
}  // namespace flatshard::collective
