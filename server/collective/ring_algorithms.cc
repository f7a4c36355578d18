#include "server/collective/ring_algorithms.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/bulk_copy.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/hierarchical_algorithms.h"
#include "server/collective/local_rendezvous.h"
#include "server/collective/op_descriptor.h"
#include "server/collective/reduce.h"
#include "server/collective/ring_reduce_scatter.h"
#include "server/collective/ring_step.h"
#include "server/collective/scratch_pool.h"

namespace flatshard::collective {
namespace {

// Message sub-tags: data messages use the step or chunk index, the fingerprint its own value.
constexpr uint32_t kFingerprintSub = 0x80000000u;

class RingCore;

// One thread that runs the local work of steps in order (ring_algorithms.h). Started on first
// use; the thread owns the queue, so the runner's owner may go away (even on that thread)
// while it drains: it ends once stopped and empty.
class StepRunner {
 public:
  StepRunner() : state_(std::make_shared<State>()) {}
  ~StepRunner() {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
  }
  void Post(absl::AnyInvocable<void() &&> fn) {
    absl::MutexLock lock(&state_->mu);
    state_->queue.push_back(std::move(fn));
    if (state_->started) return;
    state_->started = true;
    std::thread([state = state_] { Loop(*state); }).detach();
  }

 private:
  struct State {
    absl::Mutex mu;
    std::deque<absl::AnyInvocable<void() &&>> queue ABSL_GUARDED_BY(mu);
    bool started ABSL_GUARDED_BY(mu) = false;
    bool stop ABSL_GUARDED_BY(mu) = false;
  };
  static void Loop(State& s) {
    while (true) {
      absl::AnyInvocable<void() &&> fn;
      {
        absl::MutexLock lock(&s.mu);
        s.mu.Await(absl::Condition(
            +[](State* st)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->stop || !st->queue.empty(); },
            &s));
        if (s.queue.empty()) return;
        fn = std::move(s.queue.front());
        s.queue.pop_front();
      }
      std::move(fn)();
    }
  }
  const std::shared_ptr<State> state_;
};

// One local rank's part of one op: a small state machine that runs step after step. Steps
// are sequential, so the step fields are only touched by whichever thread drives the current
// step; completion of a step is handed over through `outstanding`. The flat ring's
// ReduceScatter runs its steps in lanes instead (ring_reduce_scatter.h), after the fingerprint
// step: each lane a chain of such steps with its own count, the op finished by the last lane
// to stop.
class RankOp : public std::enable_shared_from_this<RankOp> {
 public:
  RankOp(std::shared_ptr<RingCore> core, int rank, int world, OpCall call, const OpOptions& o,
         bool fingerprints, size_t chunk_bytes, DoneCallback done);

  uint64_t op_seq() const { return op_seq_; }
  int rank() const { return rank_; }
  RingCore& core() const { return *core_; }
  const OpDescriptor& desc() const { return call_.desc; }
  const std::string& name() const { return name_; }
  absl::Time arrived_at() const { return arrived_at_; }
  absl::Time deadline() const { return deadline_; }

  void set_timer(DeadlineTimer::TimerId id) {
    absl::MutexLock lock(&mu_);
    timer_ = id;
  }
  // Ranks known to have arrived (fingerprint received), and whether all have.
  std::vector<bool> Arrived(bool* all) const {
    absl::MutexLock lock(&mu_);
    *all = fingerprints_done_ || !fingerprints_;
    return got_;
  }

  // Runs steps until one has to wait for the transport or the op ends.
  void Drive();
  // The status an expired deadline reports, or OK when the op already finished.
  absl::Status DeadlineStatus() const;
  void Finish(absl::Status status);

 private:
  // Fills `xfers` for step `step_` and does its local work; false when no step is left.
  bool BuildStep(std::vector<Xfer>* xfers);
  // Local work after every transfer of step `step_` succeeded.
  absl::Status AfterStep();
  void OnXferDone(const Xfer& x, absl::Status status);
  // The step's transfers are done: check, post-process, advance. Returns whether to go on.
  bool CompleteStep();
  // Posts `xfers` with `outstanding` counting them plus one for this call, so that their step
  // cannot complete while they are still being posted; `on_done(x)` makes x's callback.
  // Returns whether every one of them already finished: then the caller completes the step,
  // otherwise the last transfer's callback does.
  bool PostXfers(const std::vector<Xfer>& xfers, std::atomic<int>& outstanding,
                 absl::FunctionRef<DoneCallback(const Xfer&)> on_done);
  // Whether the step's local work is the step runner's (a reduction), and this is not it.
  bool RunsElsewhere() const;
  // Completes the step and drives on, on the step runner.
  void ContinueOnRunner();

  // The flat ReduceScatter's lanes: Lanes starts them; DriveLane posts lane `lane`'s step `s`
  // and those after it until one has to wait; the last LaneStopped finishes the op.
  struct Lane {
    int step = 0;  // the step in flight (its index in RingReduceScatterSteps)
    std::atomic<int> outstanding{0};
  };
  void Lanes();
  void DriveLane(int lane, int s);
  void OnLaneXferDone(int lane, absl::Status status);
  // Lane `lane`'s step is done (on the step runner): reduce and drive on, or stop on an error.
  void CompleteLaneStep(int lane);
  void PostCompleteLaneStep(int lane);
  void LaneStopped();

  int AlgorithmStep() const { return step_ - (fingerprints_ ? 1 : 0); }
  uint8_t* OutBlock(int b) const { return call_.out.begin() + b * call_.desc.bytes; }
  void CopyOwn(uint8_t* dst) const {
    if (call_.desc.bytes > 0 && dst != call_.in.begin()) {
      BulkCopy(dst, call_.in.begin(), call_.desc.bytes, BulkShouldStream(call_.desc.bytes));
    }
  }

  const std::shared_ptr<RingCore> core_;
  const int rank_;
  const int world_;
  const uint64_t op_seq_;
  const OpCall call_;
  const std::string name_;
  const absl::Time arrived_at_;
  const absl::Time deadline_;
  const bool fingerprints_;
  const size_t chunk_bytes_;

  mutable absl::Mutex mu_;
  DoneCallback done_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  DeadlineTimer::TimerId timer_ ABSL_GUARDED_BY(mu_) = DeadlineTimer::kNoTimer;
  absl::Status step_error_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> got_ ABSL_GUARDED_BY(mu_);
  bool fingerprints_done_ ABSL_GUARDED_BY(mu_) = false;

  // Step state (see the class comment).
  int step_ = 0;
  std::atomic<int> outstanding_{0};
  WireDescriptor mine_;
  std::vector<WireDescriptor> theirs_;
  std::optional<HierarchicalSteps> hier_;          // AllGather and ReduceScatter over nodes
  std::optional<RingReduceScatterSteps> flat_rs_;  // ReduceScatter, flat ring, W >= 2
  Lane lanes_[RingReduceScatterSteps::kWindow];
  std::atomic<int> running_lanes_{0};
};

// Shared by the Communicator, its ops and timer callbacks.
class RingCore : public std::enable_shared_from_this<RingCore> {
 public:
  RingCore(GroupSpec spec, std::shared_ptr<Transport> transport, RingOptions options,
           std::optional<NodeLayout> layout)
      : spec_(std::move(spec)),
        transport_(std::move(transport)),
        options_(std::move(options)),
        layout_(std::move(layout)) {
    if (options_.timer == nullptr) options_.timer = std::make_shared<DeadlineTimer>();
    if (options_.scratch == nullptr) options_.scratch = ScratchPool::Create(options_.timer);
  }

  const GroupSpec& spec() const { return spec_; }
  Transport& transport() { return *transport_; }
  absl::string_view backend_name() const { return options_.backend_name; }
  // Null: the flat ring runs every op.
  const NodeLayout* layout() const { return layout_ ? &*layout_ : nullptr; }
  ScratchPool& scratch() { return *options_.scratch; }
  size_t pipeline_chunk_bytes() const { return options_.pipeline_chunk_bytes; }
  StepRunner& runner() { return runner_; }

  void Start(int rank, OpCall call, const OpOptions& o, DoneCallback done);
  // `quiet`: no warning unless ops were in flight (the communicator is being destroyed).
  void Abort(absl::Status reason, bool quiet = false);
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return sticky_;
  }
  std::vector<PendingOpInfo> PendingOps() const;
  void Remove(const RankOp* op);
  void CancelTimer(DeadlineTimer::TimerId id) { options_.timer->Cancel(id); }

 private:
  const GroupSpec spec_;
  const std::shared_ptr<Transport> transport_;
  RingOptions options_;
  const std::optional<NodeLayout> layout_;
  StepRunner runner_;

  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  // The same op_seq order check as the local rendezvous (local_rendezvous.h).
  OpSeqOrder order_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<std::shared_ptr<RankOp>>> live_ ABSL_GUARDED_BY(mu_);
};

// --- RankOp ---------------------------------------------------------------------------------

RankOp::RankOp(std::shared_ptr<RingCore> core, int rank, int world, OpCall call, const OpOptions& o,
               bool fingerprints, size_t chunk_bytes, DoneCallback done)
    : core_(std::move(core)),
      rank_(rank),
      world_(world),
      op_seq_(o.op_seq),
      call_(call),
      name_(o.name),
      arrived_at_(absl::Now()),
      deadline_(o.deadline),
      fingerprints_(fingerprints && world > 1),
      chunk_bytes_(std::max<size_t>(chunk_bytes, 1)),
      done_(std::move(done)),
      got_(world, false) {
  got_[rank] = true;
  if (const NodeLayout* layout = core_->layout(); layout && RunsHierarchically(call_.desc)) {
    hier_.emplace(*layout, rank, call_, core_->scratch(), core_->pipeline_chunk_bytes());
  } else if (call_.desc.kind == CollectiveKind::kReduceScatter && world > 1 &&
             call_.desc.bytes > 0) {
    flat_rs_.emplace(rank, world, call_, core_->scratch(), core_->pipeline_chunk_bytes());
  }
  mine_ = EncodeDescriptor(op_seq_, call_.desc);
  theirs_.resize(world);
}

bool RankOp::BuildStep(std::vector<Xfer>* xfers) {
  if (fingerprints_ && step_ == 0) {
    for (int k = 0; k < world_; ++k) {
      if (k == rank_) continue;
      xfers->push_back(
          SendXfer(k, kFingerprintSub, reinterpret_cast<const uint8_t*>(&mine_), sizeof(mine_)));
      Xfer r = RecvXfer(k, kFingerprintSub, reinterpret_cast<uint8_t*>(&theirs_[k]),
                        sizeof(WireDescriptor));
      r.fingerprint = true;
      xfers->push_back(r);
    }
    return true;
  }
  const int s = AlgorithmStep();
  if (hier_) return hier_->Build(s, xfers);
  const OpDescriptor& d = call_.desc;
  const size_t bytes = d.bytes;
  const int next = Mod(rank_ + 1, world_);
  const int prev = Mod(rank_ - 1, world_);
  switch (d.kind) {
    case CollectiveKind::kAllReduce:  // composed above the Communicator; ValidateCall refuses it
      return false;
    case CollectiveKind::kAllGather: {
      if (s == 0) CopyOwn(OutBlock(rank_));
      if (world_ == 1 || bytes == 0 || s >= world_ - 1) return false;
      const uint32_t sub = static_cast<uint32_t>(s);
      xfers->push_back(SendXfer(next, sub, OutBlock(Mod(rank_ - s, world_)), bytes));
      xfers->push_back(RecvXfer(prev, sub, OutBlock(Mod(rank_ - s - 1, world_)), bytes));
      return true;
    }
    case CollectiveKind::kReduceScatter: {
      if (bytes == 0) return false;
      // world 1 here (ring_reduce_scatter.h runs the others)
      if (s == 0) {
        const void* src = call_.in.data;
        ReduceInto(d.dtype, absl::MakeConstSpan(&src, 1), call_.out.data, bytes / ItemSize(d.dtype),
                   d.reduce_op, 1);
      }
      return false;
    }
    case CollectiveKind::kBroadcast: {
      if (world_ == 1 || bytes == 0) return false;
      // Position p in the chain receives chunk t-p+1 and sends chunk t-p at step t.
      const int p = Mod(rank_ - d.root, world_);
      const int64_t chunks = static_cast<int64_t>((bytes + chunk_bytes_ - 1) / chunk_bytes_);
      if (s >= chunks + world_ - 2) return false;
      auto off = [&](int64_t c) { return static_cast<size_t>(c) * chunk_bytes_; };
      auto len = [&](int64_t c) { return std::min(chunk_bytes_, bytes - off(c)); };
      const int64_t recv_chunk = s - p + 1;
      if (p > 0 && recv_chunk >= 0 && recv_chunk < chunks) {
        xfers->push_back(RecvXfer(prev, static_cast<uint32_t>(recv_chunk),
                                  call_.out.begin() + off(recv_chunk), len(recv_chunk)));
      }
      const int64_t send_chunk = s - p;
      if (p < world_ - 1 && send_chunk >= 0 && send_chunk < chunks) {
        xfers->push_back(SendXfer(next, static_cast<uint32_t>(send_chunk),
                                  call_.out.begin() + off(send_chunk), len(send_chunk)));
      }
      return true;
    }
    case CollectiveKind::kGather: {
      if (s > 0) return false;
      if (rank_ == d.root) CopyOwn(OutBlock(rank_));
      if (world_ == 1 || bytes == 0) return false;
      if (rank_ == d.root) {
        for (int k = 0; k < world_; ++k) {
          if (k == rank_) continue;
          xfers->push_back(RecvXfer(k, 0, OutBlock(k), bytes));
        }
      } else {
        xfers->push_back(SendXfer(d.root, 0, call_.in.begin(), bytes));
      }
      return true;
    }
  }
  return false;
}

absl::Status RankOp::AfterStep() {
  if (fingerprints_ && step_ == 0) {
    // Every rank compares against rank 0, so every rank reports the same mismatch.
    std::vector<OpDescriptor> descs(world_);
    for (int k = 0; k < world_; ++k) {
      if (k == rank_) {
        descs[k] = call_.desc;
        continue;
      }
      std::optional<OpDescriptor> d = DecodeDescriptor(theirs_[k]);
      if (!d || theirs_[k].op_seq != op_seq_) {
        return absl::InternalError(
            absl::StrCat("op_seq ", op_seq_, ": rank ", k, " sent a malformed fingerprint"));
      }
      descs[k] = *d;
    }
    for (int k = 1; k < world_; ++k) {
      if (descs[k] != descs[0]) return MismatchError(op_seq_, 0, descs[0], k, descs[k]);
    }
    absl::MutexLock lock(&mu_);
    fingerprints_done_ = true;
    return absl::OkStatus();
  }
  if (hier_) hier_->After(AlgorithmStep());
  return absl::OkStatus();
}

void RankOp::Drive() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
    }
    if (flat_rs_ && !(fingerprints_ && step_ == 0)) return Lanes();
    std::vector<Xfer> xfers;
    if (!BuildStep(&xfers)) {
      Finish(absl::OkStatus());
      return;
    }
    std::shared_ptr<RankOp> self = shared_from_this();
    if (!PostXfers(xfers, outstanding_, [&self](const Xfer& x) -> DoneCallback {
          return [self, x](absl::Status s) { self->OnXferDone(x, std::move(s)); };
        })) {
      return;  // the last transfer callback continues
    }
    if (RunsElsewhere()) return ContinueOnRunner();
    if (!CompleteStep()) return;
  }
}

bool RankOp::PostXfers(const std::vector<Xfer>& xfers, std::atomic<int>& outstanding,
                       absl::FunctionRef<DoneCallback(const Xfer&)> on_done) {
  outstanding.store(static_cast<int>(xfers.size()) + 1);
  for (const Xfer& x : xfers) {
    if (x.send) {
      core_->transport().Send(rank_, x.peer, MessageTag{op_seq_, x.sub}, x.src, on_done(x));
    } else {
      core_->transport().Recv(rank_, x.peer, MessageTag{op_seq_, x.sub}, x.dst, on_done(x));
    }
  }
  return outstanding.fetch_sub(1) == 1;
}

// The thread on which the runner's work runs (null elsewhere).
thread_local const StepRunner* t_runner = nullptr;

bool RankOp::RunsElsewhere() const {
  return call_.desc.kind == CollectiveKind::kReduceScatter && !(fingerprints_ && step_ == 0) &&
         t_runner != &core_->runner();
}

void RankOp::ContinueOnRunner() {
  core_->runner().Post([self = shared_from_this()] {
    t_runner = &self->core().runner();
    if (self->CompleteStep()) self->Drive();
    t_runner = nullptr;
  });
}

void RankOp::Lanes() {
  flat_rs_->Start();
  const int n = flat_rs_->lanes();
  running_lanes_.store(n);
  for (int lane = 0; lane < n; ++lane) DriveLane(lane, flat_rs_->FirstStep(lane));
}

void RankOp::DriveLane(int lane, int s) {
  Lane& l = lanes_[lane];
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (!step_error_.ok()) s = flat_rs_->steps();  // another lane failed: stop here
    }
    if (s >= flat_rs_->steps()) return LaneStopped();
    std::vector<Xfer> xfers;
    flat_rs_->Build(s, &xfers);
    l.step = s;
    std::shared_ptr<RankOp> self = shared_from_this();
    if (!PostXfers(xfers, l.outstanding, [&self, lane](const Xfer&) -> DoneCallback {
          return [self, lane](absl::Status st) { self->OnLaneXferDone(lane, std::move(st)); };
        })) {
      return;  // the last transfer callback continues
    }
    if (t_runner != &core_->runner()) return PostCompleteLaneStep(lane);
    // On the runner: reduce and go on here rather than recursing.
    absl::Status failed;
    {
      absl::MutexLock lock(&mu_);
      failed = step_error_;
    }
    if (!failed.ok()) return LaneStopped();
    flat_rs_->Reduce(s);
    s = flat_rs_->NextStep(s);
  }
}

void RankOp::OnLaneXferDone(int lane, absl::Status status) {
  if (!status.ok()) {
    bool first = false;
    {
      absl::MutexLock lock(&mu_);
      first = step_error_.ok();
      if (first) step_error_ = status;
    }
    // The other lanes' transfers fail too (their sticky status), so they stop soon.
    if (first) core_->Abort(status);
  }
  if (lanes_[lane].outstanding.fetch_sub(1) != 1) return;
  PostCompleteLaneStep(lane);
}

void RankOp::PostCompleteLaneStep(int lane) {
  core_->runner().Post([self = shared_from_this(), lane] {
    t_runner = &self->core().runner();
    self->CompleteLaneStep(lane);
    t_runner = nullptr;
  });
}

void RankOp::CompleteLaneStep(int lane) {
  const int s = lanes_[lane].step;
  bool failed;
  {
    absl::MutexLock lock(&mu_);
    failed = !step_error_.ok();
  }
  if (failed) return LaneStopped();
  flat_rs_->Reduce(s);
  DriveLane(lane, flat_rs_->NextStep(s));
}

void RankOp::LaneStopped() {
  if (running_lanes_.fetch_sub(1) != 1) return;
  // Every lane's transfers are done: the scratch and the caller's buffers are free.
  flat_rs_->Stop();
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = step_error_;
  }
  Finish(std::move(status));
}

void RankOp::OnXferDone(const Xfer& x, absl::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && step_error_.ok()) step_error_ = std::move(status);
    if (status.ok() && x.fingerprint) got_[x.peer] = true;
  }
  if (outstanding_.fetch_sub(1) != 1) return;
  if (RunsElsewhere()) return ContinueOnRunner();
  if (CompleteStep()) Drive();
}

bool RankOp::CompleteStep() {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = step_error_;
  }
  if (status.ok()) status = AfterStep();
  if (!status.ok()) {
    Finish(std::move(status));
    return false;
  }
  ++step_;
  return true;
}

absl::Status RankOp::DeadlineStatus() const {
  absl::MutexLock lock(&mu_);
  if (finished_) return absl::OkStatus();
  if (fingerprints_ && !fingerprints_done_) {
    std::vector<int> missing;
    for (int k = 0; k < world_; ++k) {
      if (!got_[k]) missing.push_back(k);
    }
    if (!missing.empty()) {
      return MissingRanksError(op_seq_, call_.desc, missing, deadline_ - arrived_at_);
    }
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "op_seq ", op_seq_, " ", FormatOp(call_.desc), ": rank ", rank_,
      " did not finish moving data within ",
      absl::FormatDuration(absl::Ceil(deadline_ - arrived_at_, absl::Milliseconds(1)))));
}

void RankOp::Finish(absl::Status status) {
  DoneCallback done;
  DeadlineTimer::TimerId timer;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    done = std::move(done_);
    timer = timer_;
  }
  core_->CancelTimer(timer);
  core_->Remove(this);
  if (!status.ok()) {
    // The first error of the communicator is what every op reports.
    core_->Abort(status);
    status = core_->status();
  }
  FS_VLOG(2) << "group=" << core_->spec().group_id << " rank=" << rank_ << " op_seq=" << op_seq_
             << " " << FormatOp(call_.desc) << " done: " << status;
  std::move(done)(std::move(status));
}

// --- RingCore -------------------------------------------------------------------------------

void RingCore::Start(int rank, OpCall call, const OpOptions& o, DoneCallback done) {
  if (absl::Status s = CheckRank(rank, spec_); !s.ok()) {
    std::move(done)(s);
    return;
  }
  if (absl::Status s =
          ValidateCall(call, rank, spec_.world_size, o.op_seq, options_.host_memory_only);
      !s.ok()) {
    Abort(s);
    std::move(done)(status());
    return;
  }
  std::shared_ptr<RankOp> op;
  absl::Status failed;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) {
      failed = sticky_;
    } else if (absl::Status s = order_.Next(rank, o.op_seq, call.desc); !s.ok()) {
      failed = std::move(s);
    } else {
      op = std::make_shared<RankOp>(shared_from_this(), rank, spec_.world_size, call, o,
                                    options_.check_fingerprints, options_.chunk_bytes,
                                    std::move(done));
      live_[o.op_seq].push_back(op);
    }
  }
  if (!failed.ok()) {
    Abort(failed);
    std::move(done)(status());
    return;
  }
  FS_VLOG(2) << "group=" << spec_.group_id << " rank=" << rank << " op_seq=" << o.op_seq << " "
             << FormatOp(call.desc) << " started";
  if (spec_.world_size > 1) {
    op->set_timer(options_.timer->Schedule(o.deadline, [weak = std::weak_ptr<RankOp>(op)] {
      std::shared_ptr<RankOp> op = weak.lock();
      if (op == nullptr) return;
      // Aborting fails the transfers this op waits for, and so the op, with the sticky
      // status. The op itself is not finished here: a transfer may be copying into its
      // buffers right now, and only its callback may release them.
      absl::Status s = op->DeadlineStatus();
      if (!s.ok()) op->core().Abort(std::move(s));
    }));
  }
  op->Drive();
}

void RingCore::Abort(absl::Status reason, bool quiet) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  absl::Status status;
  bool busy = false;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) return;
    sticky_ = std::move(reason);
    status = sticky_;
    busy = !live_.empty();
  }
  if (!quiet || busy) {
    FS_LOG(WARNING) << "group=" << spec_.group_id << " ring communicator failed: " << status;
  }
  // Fails every transfer still waiting; their ops finish with the sticky status.
  transport_->Abort(status);
}

void RingCore::Remove(const RankOp* op) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(op->op_seq());
  if (it == live_.end()) return;
  auto& ops = it->second;
  ops.erase(std::remove_if(ops.begin(), ops.end(),
                           [op](const std::shared_ptr<RankOp>& p) { return p.get() == op; }),
            ops.end());
  if (ops.empty()) live_.erase(it);
}

std::vector<PendingOpInfo> RingCore::PendingOps() const {
  std::vector<PendingOpInfo> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  for (const auto& [op_seq, ops] : live_) {
    const RankOp& first = *ops.front();
    PendingOpInfo& p = out.emplace_back(PendingOpOf(op_seq, first.desc(), first.name()));
    absl::Time earliest = first.arrived_at();
    std::vector<bool> arrived(spec_.world_size, false);
    bool all = false;
    for (const std::shared_ptr<RankOp>& op : ops) {
      earliest = std::min(earliest, op->arrived_at());
      bool op_all = false;
      std::vector<bool> got = op->Arrived(&op_all);
      all = all || op_all;
      for (int r = 0; r < spec_.world_size; ++r) arrived[r] = arrived[r] || got[r];
    }
    p.age = now - earliest;
    p.running = all;
    for (int r = 0; r < spec_.world_size; ++r) {
      (all || arrived[r] ? p.arrived_ranks : p.missing_ranks).push_back(r);
    }
  }
  return out;
}

// --- Communicator ---------------------------------------------------------------------------

class RingCommunicator final : public Communicator {
 public:
  explicit RingCommunicator(std::shared_ptr<RingCore> core) : core_(std::move(core)) {}
  ~RingCommunicator() override {
    core_->Abort(absl::AbortedError("ring communicator destroyed"), /*quiet=*/true);
  }

  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& o,
                 DoneCallback done) override {
    core_->Start(o.rank, AllGatherCall(in, out, o.unit), o, std::move(done));
  }
  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& o,
                     DoneCallback done) override {
    core_->Start(o.rank, ReduceScatterCall(in, out, op, o.unit), o, std::move(done));
  }
  void Broadcast(MutableBuffer buf, int root, const OpOptions& o, DoneCallback done) override {
    core_->Start(o.rank, BroadcastCall(buf, root, o.unit), o, std::move(done));
  }
  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& o,
              DoneCallback done) override {
    core_->Start(o.rank, GatherCall(in, out, root, o.unit), o, std::move(done));
  }
  void Abort(absl::Status reason) override { core_->Abort(std::move(reason)); }
  absl::Status status() const override { return core_->status(); }
  std::vector<PendingOpInfo> PendingOps() const override { return core_->PendingOps(); }
  absl::string_view backend_name() const override { return core_->backend_name(); }

 private:
  std::shared_ptr<RingCore> core_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> NewRingCommunicator(
    const GroupSpec& group, std::shared_ptr<Transport> transport, RingOptions options) {
  FS_RETURN_IF_ERROR(CheckGroupSpec(group));
  if (transport == nullptr || transport->world_size() != group.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("group ", group.group_id, ": transport world_size ",
                     transport == nullptr ? 0 : transport->world_size(), " != ", group.world_size));
  }
  std::optional<NodeLayout> layout;
  if (!options.node_of_rank.empty()) {
    if (static_cast<int>(options.node_of_rank.size()) != group.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", group.group_id, ": node_of_rank has ", options.node_of_rank.size(),
                       " entries for world_size ", group.world_size));
    }
    layout = HierarchicalLayout(options.node_of_rank);
  }
  return std::make_unique<RingCommunicator>(std::make_shared<RingCore>(
      group, std::move(transport), std::move(options), std::move(layout)));
}

}  // namespace flatshard::collective
