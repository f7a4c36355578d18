// LocalRendezvous: matching local ranks' calls per op_seq, hand-over to the last arrival or to
// TakeReady in op_seq order, and the shared error contract (mismatch, op_seq order, bad calls,
// deadlines, sticky errors, Close) and pending listing. Calls are issued from the test thread
// so every case is deterministic; deadlines use short timeouts and wait for the callback.

#include "server/collective/local_rendezvous.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::shared_ptr<DeadlineTimer> Timer() {
  static auto* timer = new std::shared_ptr<DeadlineTimer>(std::make_shared<DeadlineTimer>());
  return *timer;
}

LocalRendezvousOptions Options() {
  LocalRendezvousOptions o;
  o.log_name = "group=test rendezvous";
  o.timer = Timer();
  return o;
}

std::shared_ptr<LocalRendezvous> Make(const GroupSpec& spec,
                                      LocalRendezvousOptions options = Options()) {
  return std::make_shared<LocalRendezvous>(spec, std::move(options));
}

OpOptions Opts(int rank, uint64_t op_seq, absl::Duration timeout = absl::InfiniteDuration()) {
  OpOptions o;
  o.rank = rank;
  o.op_seq = op_seq;
  o.unit = 3;
  o.name = "unshard";
  o.deadline = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  return o;
}

// A 1-float AllGather of `world` ranks (the buffers are never touched by the rendezvous).
struct Buffers {
  explicit Buffers(int world) : in(world), out(world * world) {}
  OpCall AllGather(int rank, int world, int64_t unit = 3) {
    return AllGatherCall(
        ConstBuffer{&in[rank], 4, DType::kFloat32},
        MutableBuffer{&out[rank * world], 4 * static_cast<size_t>(world), DType::kFloat32}, unit);
  }
  std::vector<float> in;
  std::vector<float> out;
};

TEST(LocalRendezvousTest, TheLastArrivalGetsTheOpWithEveryCallByRank) {
  auto rv = Make(GroupSpec::AllLocal("g", 3));
  Buffers b(3);
  DoneRecorder done[3];
  EXPECT_FALSE(rv->Arrive(b.AllGather(2, 3), Opts(2, 1), done[2].Callback()));
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 3), Opts(0, 1), done[0].Callback()));
  std::vector<PendingOpInfo> pending = rv->PendingOps();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending[0].op_seq, 1u);
  EXPECT_EQ(pending[0].unit, 3);
  EXPECT_EQ(pending[0].bytes, 4u);
  EXPECT_EQ(pending[0].name, "unshard");
  EXPECT_THAT(pending[0].arrived_ranks, ElementsAre(0, 2));
  EXPECT_THAT(pending[0].missing_ranks, ElementsAre(1));
  EXPECT_FALSE(pending[0].running);

  std::optional<RendezvousOp> op = rv->Arrive(b.AllGather(1, 3), Opts(1, 1), done[1].Callback());
  ASSERT_TRUE(op.has_value());
  EXPECT_EQ(op->op_seq, 1u);
  EXPECT_EQ(op->desc.kind, CollectiveKind::kAllGather);
  ASSERT_EQ(op->calls.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(op->calls[r].rank, r);
    EXPECT_EQ(op->calls[r].call.in.data, &b.in[r]);
  }
  pending = rv->PendingOps();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_TRUE(pending[0].running);
  EXPECT_THAT(pending[0].arrived_ranks, ElementsAre(0, 1, 2));
  for (DoneRecorder& d : done) EXPECT_EQ(d.calls(), 0);  // the owner completes them

  EXPECT_TRUE(rv->Finish(1, absl::OkStatus()).ok());
  for (RendezvousCall& c : op->calls) std::move(c.done)(absl::OkStatus());
  for (DoneRecorder& d : done) EXPECT_TRUE(d.Wait().ok());
  EXPECT_THAT(rv->PendingOps(), IsEmpty());
  EXPECT_TRUE(rv->status().ok());
}

TEST(LocalRendezvousTest, MismatchFailsEveryWaitingCallAndIsSticky) {
  auto rv = Make(GroupSpec::AllLocal("g", 3));
  Buffers b(3);
  DoneRecorder first, second, later;
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 3), Opts(0, 1), first.Callback()));
  OpCall other = ReduceScatterCall(ConstBuffer{b.out.data(), 12, DType::kFloat32},
                                   MutableBuffer{&b.in[1], 4, DType::kFloat32}, ReduceOp::kSum, 3);
  EXPECT_FALSE(rv->Arrive(other, Opts(1, 1), second.Callback()));
  const absl::Status s = first.Wait();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("collective mismatch at op_seq 1: rank 0 called AllGather(unit 3, 4 bytes, "
                        "float32) but rank 1 called ReduceScatter(unit 3, 4 bytes, float32, sum)"));
  EXPECT_EQ(second.Wait(), s);
  EXPECT_EQ(rv->status(), s);
  EXPECT_FALSE(rv->Arrive(b.AllGather(2, 3), Opts(2, 1), later.Callback()));
  EXPECT_EQ(later.Wait(), s);
  EXPECT_THAT(rv->PendingOps(), IsEmpty());
}

TEST(LocalRendezvousTest, OpSeqMustIncreasePerRank) {
  auto rv = Make(GroupSpec::AllLocal("g", 2));
  Buffers b(2);
  DoneRecorder a, again;
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 2), Opts(0, 5), a.Callback()));
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 2), Opts(0, 5), again.Callback()));
  const absl::Status s = again.Wait();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0 issued op_seq 5"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("after op_seq 5"));
  EXPECT_EQ(a.Wait(), s);  // sticky: the waiting call fails with it
}

TEST(LocalRendezvousTest, OpSeqOrderRecordsOnlyAcceptedOps) {
  OpSeqOrder order;
  const OpDescriptor d;
  EXPECT_TRUE(order.Next(4, 2, d).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(order.Next(4, 1, d)));
  EXPECT_TRUE(absl::IsInvalidArgument(order.Next(4, 2, d)));
  EXPECT_TRUE(order.Next(4, 3, d).ok());
  EXPECT_TRUE(order.Next(7, 1, d).ok());  // ranks are independent
}

TEST(LocalRendezvousTest, ACallForARankThatIsNotLocalFailsAlone) {
  GroupSpec spec;
  spec.group_id = "g";
  spec.world_size = 4;
  spec.local_ranks = {1, 3};
  auto rv = Make(spec);
  Buffers b(4);
  DoneRecorder remote;
  EXPECT_FALSE(rv->Arrive(b.AllGather(2, 4), Opts(2, 1), remote.Callback()));
  EXPECT_TRUE(absl::IsInvalidArgument(remote.Wait())) << remote.status();
  EXPECT_TRUE(rv->status().ok());  // nobody waits for it: not sticky
}

TEST(LocalRendezvousTest, BadCallsAndTheBackendsOwnCheckAreSticky) {
  {
    auto rv = Make(GroupSpec::AllLocal("g", 2));
    DoneRecorder bad;
    float in = 0, out = 0;  // out is too small for world 2
    EXPECT_FALSE(rv->Arrive(AllGatherCall(ConstBuffer{&in, 4, DType::kFloat32},
                                          MutableBuffer{&out, 4, DType::kFloat32}, 3),
                            Opts(0, 1), bad.Callback()));
    EXPECT_TRUE(absl::IsInvalidArgument(bad.Wait())) << bad.status();
    EXPECT_EQ(rv->status(), bad.status());
  }
  {
    LocalRendezvousOptions o = Options();
    o.check_call = [](const OpCall&, int rank, uint64_t op_seq) {
      return rank == 1 ? absl::InvalidArgumentError(
                             absl::StrCat("rank 1 op_seq ", op_seq, ": wrong memory"))
                       : absl::OkStatus();
    };
    auto rv = Make(GroupSpec::AllLocal("g", 2), std::move(o));
    Buffers b(2);
    DoneRecorder ok, refused;
    EXPECT_FALSE(rv->Arrive(b.AllGather(0, 2), Opts(0, 1), ok.Callback()));
    EXPECT_FALSE(rv->Arrive(b.AllGather(1, 2), Opts(1, 1), refused.Callback()));
    EXPECT_THAT(std::string(refused.Wait().message()), HasSubstr("rank 1 op_seq 1: wrong memory"));
    EXPECT_EQ(ok.Wait(), refused.status());
  }
}

TEST(LocalRendezvousTest, DeadlineNamesTheLocalRanksThatDidNotArrive) {
  GroupSpec spec;
  spec.group_id = "g";
  spec.world_size = 6;
  spec.local_ranks = {0, 2, 4, 5};
  auto rv = Make(spec);
  Buffers b(6);
  DoneRecorder zero, four, late;
  EXPECT_FALSE(rv->Arrive(b.AllGather(4, 6), Opts(4, 1), four.Callback()));
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 6), Opts(0, 1, absl::Milliseconds(30)), zero.Callback()));
  const absl::Status s = zero.Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("op_seq 1 AllGather(unit 3, 4 bytes, float32): ranks 2, 5 did not arrive "
                        "within "));  // ~30ms: the budget is read from the test's clock
  EXPECT_EQ(four.Wait(), s);          // no deadline of its own, failed with the group
  EXPECT_FALSE(rv->Arrive(b.AllGather(2, 6), Opts(2, 1), late.Callback()));
  EXPECT_EQ(late.Wait(), s);
}

TEST(LocalRendezvousTest, ACompletedOpCancelsItsDeadlines) {
  auto rv = Make(GroupSpec::AllLocal("g", 2));
  Buffers b(2);
  DoneRecorder d0, d1;
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 2), Opts(0, 1, absl::Milliseconds(20)), d0.Callback()));
  std::optional<RendezvousOp> op =
      rv->Arrive(b.AllGather(1, 2), Opts(1, 1, absl::Milliseconds(20)), d1.Callback());
  ASSERT_TRUE(op.has_value());
  absl::SleepFor(absl::Milliseconds(60));  // past both deadlines while the op "runs"
  EXPECT_TRUE(rv->status().ok()) << rv->status();
  EXPECT_TRUE(rv->Finish(1, absl::OkStatus()).ok());
  EXPECT_EQ(d0.calls() + d1.calls(), 0);
}

TEST(LocalRendezvousTest, AbortFailsWaitingCallsNotRunningOnesAndTheFirstErrorWins) {
  auto rv = Make(GroupSpec::AllLocal("g", 2));
  Buffers b(2);
  DoneRecorder r0, r1, waiting;
  rv->Arrive(b.AllGather(0, 2), Opts(0, 1), r0.Callback());
  std::optional<RendezvousOp> running = rv->Arrive(b.AllGather(1, 2), Opts(1, 1), r1.Callback());
  ASSERT_TRUE(running.has_value());
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 2), Opts(0, 2), waiting.Callback()));

  const absl::Status reason = absl::UnavailableError("peer down");
  EXPECT_EQ(rv->Fail(reason), reason);
  EXPECT_EQ(waiting.Wait(), reason);
  EXPECT_EQ(r0.calls() + r1.calls(), 0);  // the running op is the owner's
  std::vector<PendingOpInfo> pending = rv->PendingOps();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_TRUE(pending[0].running);

  EXPECT_EQ(rv->Fail(absl::InternalError("second")), reason);
  // The owner's op failed too: it reports the sticky status, not its own.
  EXPECT_EQ(rv->Finish(1, absl::DataLossError("copy failed")), reason);
  EXPECT_THAT(rv->PendingOps(), IsEmpty());
  EXPECT_TRUE(absl::IsAborted(Make(GroupSpec::AllLocal("h", 1))->Fail(absl::OkStatus())));
}

TEST(LocalRendezvousTest, AFailedRunningOpBecomesTheStickyError) {
  auto rv = Make(GroupSpec::AllLocal("g", 2));
  Buffers b(2);
  DoneRecorder r0, r1, next;
  rv->Arrive(b.AllGather(0, 2), Opts(0, 1), r0.Callback());
  ASSERT_TRUE(rv->Arrive(b.AllGather(1, 2), Opts(1, 1), r1.Callback()).has_value());
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 2), Opts(0, 2), next.Callback()));
  const absl::Status overlap = absl::InvalidArgumentError("buffers overlap");
  EXPECT_EQ(rv->Finish(1, overlap), overlap);
  EXPECT_EQ(next.Wait(), overlap);
  EXPECT_EQ(rv->status(), overlap);
}

TEST(LocalRendezvousTest, FailureCallbacksMayCallBackIn) {
  auto rv = Make(GroupSpec::AllLocal("g", 2));
  Buffers b(2);
  DoneRecorder inner;
  bool ran = false;
  rv->Arrive(b.AllGather(0, 2), Opts(0, 1), [&](absl::Status s) {
    ran = true;
    EXPECT_EQ(rv->status(), s);
    EXPECT_THAT(rv->PendingOps(), IsEmpty());
    rv->Arrive(b.AllGather(0, 2), Opts(0, 2), inner.Callback());
  });
  rv->Fail(absl::AbortedError("stop")).IgnoreError();
  EXPECT_TRUE(ran);
  EXPECT_TRUE(absl::IsAborted(inner.Wait()));
}

// --- Ops taken by the owner in op_seq order (NCCL's progress thread) ------------------------

LocalRendezvousOptions OwnerTakes() {
  LocalRendezvousOptions o = Options();
  o.hand_over_on_arrival = false;
  o.compare_descriptors = false;
  return o;
}

TEST(LocalRendezvousTest, TheOwnerTakesCompleteOpsInOpSeqOrder) {
  GroupSpec spec;
  spec.group_id = "g";
  spec.world_size = 4;
  spec.local_ranks = {0, 1};
  Buffers b(4);
  {
    auto rv = Make(spec, OwnerTakes());
    DoneRecorder d[3];
    // Op 2 is complete while op 1 is not (rank 1 skipped it): op 2 must not start before op 1,
    // as every daemon launches in op_seq order.
    EXPECT_FALSE(rv->Arrive(b.AllGather(0, 4), Opts(0, 1), d[0].Callback()));
    EXPECT_FALSE(rv->Arrive(b.AllGather(0, 4), Opts(0, 2), d[1].Callback()));
    EXPECT_FALSE(rv->Arrive(b.AllGather(1, 4), Opts(1, 2), d[2].Callback()));
    EXPECT_FALSE(rv->TakeReady().has_value());
    const absl::Time until = absl::Now() + absl::Milliseconds(5);
    rv->WaitForWork(until);  // nothing to do: returns at `until`
    EXPECT_GE(absl::Now(), until);
    for (DoneRecorder& r : d) EXPECT_EQ(r.calls(), 0);
  }
  auto rv = Make(spec, OwnerTakes());
  DoneRecorder d[4];
  // Descriptors are not compared (compare_descriptors off): units 7 and 9 meet.
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 4), Opts(0, 1), d[0].Callback()));
  EXPECT_FALSE(rv->Arrive(b.AllGather(1, 4), Opts(1, 1), d[1].Callback()));
  EXPECT_FALSE(rv->Arrive(b.AllGather(0, 4, 7), Opts(0, 2), d[2].Callback()));
  EXPECT_FALSE(rv->Arrive(b.AllGather(1, 4, 9), Opts(1, 2), d[3].Callback()));
  rv->WaitForWork(absl::InfiniteFuture());  // op 1 is ready
  std::optional<RendezvousOp> first = rv->TakeReady();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->op_seq, 1u);
  EXPECT_FALSE(rv->TakeReady().has_value());  // one op at a time: op 2 waits for op 1's Finish
  EXPECT_TRUE(rv->Finish(1, absl::OkStatus()).ok());
  std::optional<RendezvousOp> second = rv->TakeReady();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->op_seq, 2u);
  EXPECT_EQ(second->calls[0].call.desc.unit, 7);
  EXPECT_EQ(second->calls[1].call.desc.unit, 9);
  EXPECT_TRUE(rv->Finish(2, absl::OkStatus()).ok());
  for (DoneRecorder& r : d) EXPECT_EQ(r.calls(), 0);  // the owner's to run
}

TEST(LocalRendezvousTest, AQueuedOpPastItsDeadlineFailsWithTheOwnersOverdueStatus) {
  LocalRendezvousOptions o = OwnerTakes();
  o.overdue = [](uint64_t op_seq, const OpDescriptor&, const std::string& name,
                 absl::Duration budget) {
    return absl::DeadlineExceededError(
        absl::StrCat("op ", op_seq, " '", name, "' overdue after ", absl::FormatDuration(budget)));
  };
  auto rv = Make(GroupSpec::AllLocal("g", 1), std::move(o));
  Buffers b(1);
  DoneRecorder running, queued;
  rv->Arrive(b.AllGather(0, 1), Opts(0, 1), running.Callback());
  std::optional<RendezvousOp> op = rv->TakeReady();
  ASSERT_TRUE(op.has_value());
  EXPECT_FALSE(
      rv->Arrive(b.AllGather(0, 1), Opts(0, 2, absl::Milliseconds(20)), queued.Callback()));
  const absl::Status s = queued.Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("op 2 'unshard' overdue after "));
  rv->WaitForWork(absl::InfiniteFuture());  // wakes on the sticky error
  EXPECT_EQ(running.calls(), 0);
}

TEST(LocalRendezvousTest, CloseFailsLaterCallsAndPendingOnes) {
  {
    auto rv = Make(GroupSpec::AllLocal("g", 2), OwnerTakes());
    rv->Close(absl::AbortedError("destroyed"), /*fail=*/false);
    EXPECT_TRUE(rv->closed());
    EXPECT_TRUE(rv->status().ok());           // nothing was pending: a clean close
    rv->WaitForWork(absl::InfiniteFuture());  // returns: closed
    Buffers b(2);
    DoneRecorder late;
    rv->Arrive(b.AllGather(0, 2), Opts(0, 1), late.Callback());
    EXPECT_THAT(std::string(late.Wait().message()), HasSubstr("destroyed"));
  }
  {
    auto rv = Make(GroupSpec::AllLocal("g", 2), OwnerTakes());
    Buffers b(2);
    DoneRecorder waiting;
    rv->Arrive(b.AllGather(0, 2), Opts(0, 1), waiting.Callback());
    rv->Close(absl::AbortedError("destroyed"), /*fail=*/false);
    EXPECT_TRUE(absl::IsAborted(waiting.Wait()));
    EXPECT_TRUE(absl::IsAborted(rv->status()));
  }
  {
    auto rv = Make(GroupSpec::AllLocal("g", 2), OwnerTakes());
    rv->Close(absl::AbortedError("init still running"), /*fail=*/true);
    EXPECT_THAT(std::string(rv->status().message()), HasSubstr("init still running"));
  }
}

}  // namespace
}  // namespace flatshard::collective
