#include "server/collective/inproc/inproc_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/deadline_timer.h"
#include "server/collective/op_descriptor.h"
#include "server/collective/reduce.h"
#include "server/collective/worker_pool.h"

namespace flatshard::collective {
namespace {

// ---------------------------------------------------------------------------------------------
// Execution plan of one op: copies and reductions between the ranks' buffers.

struct CopyTask {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
};

// out[0, count) = reduce(srcs[k][0, count)) for the output shard of one rank.
struct ReduceTask {
  uint8_t* dst;
  std::vector<const void*> srcs;
  size_t count;  // elements
};

// A byte range with the index of the output it belongs to (for the in-place exception).
struct Range {
  uintptr_t begin;
  uintptr_t end;
  int owner;
};

Range MakeRange(const void* p, size_t bytes, int owner) {
  auto b = reinterpret_cast<uintptr_t>(p);
  return Range{b, b + bytes, owner};
}

// Writes must be pairwise disjoint; a read may overlap a write only when both are the same
// range of the same output (a ReduceScatter shard reduced in place). Empty ranges never
// conflict. Sorting keeps this O((reads + writes) log writes).
absl::Status CheckOverlaps(std::vector<Range> writes, const std::vector<Range>& reads,
                           bool allow_in_place, uint64_t op_seq, const OpDescriptor& desc) {
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("op_seq ", op_seq, " ", FormatOp(desc),
                                                   ": buffers of different ranks ", what));
  };
  writes.erase(
      std::remove_if(writes.begin(), writes.end(), [](const Range& r) { return r.begin == r.end; }),
      writes.end());
  std::sort(writes.begin(), writes.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < writes.size(); ++i) {
    if (writes[i].begin < writes[i - 1].end) return error("overlap where they are written");
  }
  for (const Range& r : reads) {
    if (r.begin == r.end) continue;
    // First write that ends after the read begins; writes are disjoint, so ends are sorted too.
    auto it = std::upper_bound(writes.begin(), writes.end(), r.begin,
                               [](uintptr_t v, const Range& w) { return v < w.end; });
    for (; it != writes.end() && it->begin < r.end; ++it) {
      const bool in_place =
          allow_in_place && it->begin == r.begin && it->end == r.end && it->owner == r.owner;
      if (!in_place) return error("overlap: an input is overwritten by an output");
    }
  }
  return absl::OkStatus();
}

// One rank's call that arrived at a slot.
struct Arrival {
  OpCall call;
  absl::Time arrived_at;
  absl::Time deadline;
  DoneCallback done;
  DeadlineTimer::TimerId timer = DeadlineTimer::kNoTimer;
};

// All calls for one op_seq.
struct Slot {
  OpDescriptor desc;
  int first_rank = 0;
  std::string name;
  absl::Time first_arrival;
  std::vector<std::optional<Arrival>> arrivals;  // by rank; moved out when running
  std::vector<bool> present;                     // by rank
  int arrived = 0;
  bool running = false;
};

// A callback to run once the lock is released.
struct Completion {
  DoneCallback done;
  DeadlineTimer::TimerId timer = DeadlineTimer::kNoTimer;
};

// ---------------------------------------------------------------------------------------------

// Shared with deadline timer callbacks (which hold weak references), so a communicator can be
// destroyed while timers are still scheduled.
class InprocCore : public std::enable_shared_from_this<InprocCore> {
 public:
  InprocCore(GroupSpec spec, std::shared_ptr<DeadlineTimer> timer, std::shared_ptr<WorkerPool> pool,
             InprocBackendOptions options)
      : spec_(std::move(spec)),
        timer_(std::move(timer)),
        pool_(std::move(pool)),
        options_(options) {}

  void Arrive(int rank, OpCall call, const OpOptions& o, DoneCallback done);
  // `quiet`: the communicator is being destroyed, which is not worth a warning by itself.
  void Abort(absl::Status reason, bool quiet = false);
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return sticky_;
  }
  std::vector<PendingOpInfo> PendingOps() const;

 private:
  // Records the first error and moves every waiting (not running) arrival into `out`.
  void SetStickyLocked(absl::Status status, std::vector<Completion>* out, bool quiet = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnDeadline(uint64_t op_seq, int rank);
  // Runs callbacks outside the lock, all with `status`.
  void Fail(std::vector<Completion> completions, const absl::Status& status);
  // Moves the data of a slot whose ranks all arrived. Runs without the lock.
  absl::Status Execute(uint64_t op_seq, const OpDescriptor& desc,
                       const std::vector<std::optional<Arrival>>& arrivals);
  absl::Status ExecuteCopies(uint64_t op_seq, const OpDescriptor& desc,
                             std::vector<CopyTask> tasks);
  absl::Status ExecuteReduce(uint64_t op_seq, const OpDescriptor& desc,
                             const std::vector<std::optional<Arrival>>& arrivals);

  const GroupSpec spec_;
  const std::shared_ptr<DeadlineTimer> timer_;
  const std::shared_ptr<WorkerPool> pool_;
  const InprocBackendOptions options_;

  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Slot> slots_ ABSL_GUARDED_BY(mu_);
  // By rank, from its first op: nothing per rank up front (a world_size nobody joins is free).
  absl::flat_hash_map<int, uint64_t> last_seq_ ABSL_GUARDED_BY(mu_);
};

void InprocCore::Fail(std::vector<Completion> completions, const absl::Status& status) {
  for (Completion& c : completions) {
    timer_->Cancel(c.timer);
    std::move(c.done)(status);
  }
}

void InprocCore::SetStickyLocked(absl::Status status, std::vector<Completion>* out, bool quiet) {
  if (!sticky_.ok()) return;  // the first error wins; nothing is waiting any more
  sticky_ = std::move(status);
  const size_t before = out->size();
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.running) {
      ++it;
      continue;
    }
    for (std::optional<Arrival>& a : it->second.arrivals) {
      if (a) out->push_back(Completion{std::move(a->done), a->timer});
    }
    it = slots_.erase(it);
  }
  const size_t failed = out->size() - before;
  if (!quiet || failed > 0) {
    FS_LOG(WARNING) << "group=" << spec_.group_id << " inproc communicator failed (" << failed
                    << " waiting calls fail with it): " << sticky_;
  }
}

void InprocCore::Arrive(int rank, OpCall call, const OpOptions& o, DoneCallback done) {
  if (absl::Status s = CheckRank(rank, spec_); !s.ok()) {
    std::move(done)(s);  // not a member: nobody waits for this call, so not sticky
    return;
  }
  const uint64_t op_seq = o.op_seq;
  if (absl::Status s = ValidateCall(call, rank, spec_.world_size, op_seq, /*host_only=*/true);
      !s.ok()) {
    Abort(s);
    std::move(done)(status());
    return;
  }
  FS_VLOG(2) << "group=" << spec_.group_id << " rank=" << rank << " op_seq=" << op_seq << " "
             << FormatOp(call.desc) << " arrived";

  std::vector<Completion> failed;
  absl::Status fail_status;
  std::vector<std::optional<Arrival>> ready;  // set when this call completes the slot
  std::vector<DeadlineTimer::TimerId> timers_to_cancel;
  OpDescriptor desc = call.desc;
  bool done_taken = false;  // a moved-from AnyInvocable is not guaranteed to be empty
  {
    absl::MutexLock lock(&mu_);
    if (sticky_.ok() && last_seq_.contains(rank) && op_seq <= last_seq_[rank]) {
      SetStickyLocked(OpSeqOrderError(rank, op_seq, call.desc, last_seq_[rank]), &failed);
    }
    if (sticky_.ok()) {
      last_seq_[rank] = op_seq;
      Slot& slot = slots_[op_seq];
      if (slot.arrived == 0) {
        slot.desc = call.desc;
        slot.first_rank = rank;
        slot.name = o.name;
        slot.first_arrival = absl::Now();
        slot.arrivals.resize(spec_.world_size);
        slot.present.assign(spec_.world_size, false);
      }
      if (call.desc != slot.desc) {
        SetStickyLocked(MismatchError(op_seq, slot.first_rank, slot.desc, rank, call.desc),
                        &failed);
      } else {
        Arrival& a = slot.arrivals[rank].emplace();
        a.call = call;
        a.arrived_at = absl::Now();
        a.deadline = o.deadline;
        a.done = std::move(done);
        done_taken = true;
        slot.present[rank] = true;
        if (++slot.arrived == spec_.world_size) {
          slot.running = true;
          ready = std::move(slot.arrivals);
          slot.arrivals.clear();
          for (std::optional<Arrival>& r : ready) timers_to_cancel.push_back(r->timer);
        } else if (o.deadline != absl::InfiniteFuture()) {
          // The timer's lock is a leaf, so scheduling under ours is safe.
          a.timer = timer_->Schedule(o.deadline, [weak = weak_from_this(), op_seq, rank] {
            if (auto core = weak.lock()) core->OnDeadline(op_seq, rank);
          });
        }
      }
    }
    if (!sticky_.ok()) fail_status = sticky_;
  }
  if (!fail_status.ok()) {
    if (!done_taken) std::move(done)(fail_status);
    Fail(std::move(failed), fail_status);
    return;
  }
  if (ready.empty()) return;

  for (DeadlineTimer::TimerId t : timers_to_cancel) timer_->Cancel(t);
  absl::Status result = Execute(op_seq, desc, ready);
  {
    absl::MutexLock lock(&mu_);
    slots_.erase(op_seq);
    if (!result.ok()) {
      SetStickyLocked(result, &failed);
      result = sticky_;
    }
  }
  FS_VLOG(2) << "group=" << spec_.group_id << " op_seq=" << op_seq << " " << FormatOp(desc)
             << " done: " << result;
  for (std::optional<Arrival>& a : ready) std::move(a->done)(result);
  Fail(std::move(failed), result);
}

void InprocCore::OnDeadline(uint64_t op_seq, int rank) {
  std::vector<Completion> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) return;
    auto it = slots_.find(op_seq);
    if (it == slots_.end() || it->second.running || !it->second.arrivals[rank]) return;
    const Slot& slot = it->second;
    const Arrival& a = *slot.arrivals[rank];
    std::vector<int> missing;
    for (int r = 0; r < spec_.world_size; ++r) {
      if (!slot.present[r]) missing.push_back(r);
    }
    SetStickyLocked(MissingRanksError(op_seq, slot.desc, missing, a.deadline - a.arrived_at),
                    &failed);
    status = sticky_;
  }
  Fail(std::move(failed), status);
}

void InprocCore::Abort(absl::Status reason, bool quiet) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  std::vector<Completion> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    SetStickyLocked(std::move(reason), &failed, quiet);
    status = sticky_;
  }
  Fail(std::move(failed), status);
}

std::vector<PendingOpInfo> InprocCore::PendingOps() const {
  std::vector<PendingOpInfo> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  for (const auto& [op_seq, slot] : slots_) {
    PendingOpInfo& p = out.emplace_back(PendingOpOf(op_seq, slot.desc, slot.name));
    p.age = now - slot.first_arrival;
    p.running = slot.running;
    for (int r = 0; r < spec_.world_size; ++r) {
      (slot.present[r] ? p.arrived_ranks : p.missing_ranks).push_back(r);
    }
  }
  return out;
}

absl::Status InprocCore::Execute(uint64_t op_seq, const OpDescriptor& desc,
                                 const std::vector<std::optional<Arrival>>& arrivals) {
  const int world = spec_.world_size;
  const size_t s = desc.bytes;
  std::vector<CopyTask> tasks;
  switch (desc.kind) {
    case CollectiveKind::kReduceScatter:
      return ExecuteReduce(op_seq, desc, arrivals);
    case CollectiveKind::kAllGather: {
      // Each shard is copied once into each distinct output buffer.
      std::vector<uint8_t*> outs;
      for (const std::optional<Arrival>& a : arrivals) {
        uint8_t* d = a->call.out.begin();
        if (std::find(outs.begin(), outs.end(), d) == outs.end()) outs.push_back(d);
      }
      for (uint8_t* d : outs) {
        for (int k = 0; k < world; ++k) {
          tasks.push_back(CopyTask{d + k * s, arrivals[k]->call.in.begin(), s});
        }
      }
      break;
    }
    case CollectiveKind::kGather: {
      uint8_t* d = arrivals[desc.root]->call.out.begin();
      for (int k = 0; k < world; ++k) {
        tasks.push_back(CopyTask{d + k * s, arrivals[k]->call.in.begin(), s});
      }
      break;
    }
    case CollectiveKind::kBroadcast: {
      const uint8_t* src = arrivals[desc.root]->call.in.begin();
      std::vector<uint8_t*> outs;
      for (const std::optional<Arrival>& a : arrivals) {
        uint8_t* d = a->call.out.begin();
        if (std::find(outs.begin(), outs.end(), d) == outs.end()) outs.push_back(d);
      }
      for (uint8_t* d : outs) tasks.push_back(CopyTask{d, src, s});
      break;
    }
  }
  return ExecuteCopies(op_seq, desc, std::move(tasks));
}

absl::Status InprocCore::ExecuteCopies(uint64_t op_seq, const OpDescriptor& desc,
                                       std::vector<CopyTask> tasks) {
  // A shard that already sits in its slot (in place) is not copied.
  tasks.erase(std::remove_if(tasks.begin(), tasks.end(),
                             [](const CopyTask& t) { return t.bytes == 0 || t.dst == t.src; }),
              tasks.end());
  if (tasks.empty()) return absl::OkStatus();
  std::vector<Range> writes, reads;
  size_t total = 0;
  for (const CopyTask& t : tasks) {
    writes.push_back(MakeRange(t.dst, t.bytes, -1));
    reads.push_back(MakeRange(t.src, t.bytes, -2));
    total += t.bytes;
  }
  FS_RETURN_IF_ERROR(CheckOverlaps(std::move(writes), reads, false, op_seq, desc));

  if (pool_ == nullptr || pool_->num_helpers() == 0 || total < options_.parallel_min_bytes) {
    for (const CopyTask& t : tasks) std::memcpy(t.dst, t.src, t.bytes);
    return absl::OkStatus();
  }
  const size_t piece = std::max<size_t>(options_.piece_bytes, 4096);
  std::vector<CopyTask> pieces;
  for (const CopyTask& t : tasks) {
    for (size_t off = 0; off < t.bytes; off += piece) {
      pieces.push_back(CopyTask{t.dst + off, t.src + off, std::min(piece, t.bytes - off)});
    }
  }
  pool_->ParallelFor(pieces.size(),
                     [&](size_t i) { std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes); });
  return absl::OkStatus();
}

absl::Status InprocCore::ExecuteReduce(uint64_t op_seq, const OpDescriptor& desc,
                                       const std::vector<std::optional<Arrival>>& arrivals) {
  const int world = spec_.world_size;
  const size_t s = desc.bytes;
  if (s == 0) return absl::OkStatus();
  const size_t item = static_cast<size_t>(ItemSize(desc.dtype));
  std::vector<ReduceTask> tasks;
  std::vector<Range> writes, reads;
  for (int r = 0; r < world; ++r) {
    ReduceTask t;
    t.dst = arrivals[r]->call.out.begin();
    t.count = s / item;
    writes.push_back(MakeRange(t.dst, s, r));
    for (int k = 0; k < world; ++k) {
      const uint8_t* src = arrivals[k]->call.in.begin() + r * s;
      t.srcs.push_back(src);
      reads.push_back(MakeRange(src, s, r));
    }
    tasks.push_back(std::move(t));
  }
  FS_RETURN_IF_ERROR(CheckOverlaps(std::move(writes), reads, true, op_seq, desc));

  const size_t total = s * world * world;  // bytes read
  if (pool_ == nullptr || pool_->num_helpers() == 0 || total < options_.parallel_min_bytes) {
    for (const ReduceTask& t : tasks) {
      ReduceInto(desc.dtype, t.srcs, t.dst, t.count, desc.reduce_op, world);
    }
    return absl::OkStatus();
  }
  // Pieces sized so that each reads about piece_bytes from all ranks together.
  const size_t piece_elems = std::max<size_t>(options_.piece_bytes / (item * world), size_t{4096});
  struct Piece {
    const ReduceTask* task;
    size_t first;
    size_t count;
  };
  std::vector<Piece> pieces;
  for (const ReduceTask& t : tasks) {
    for (size_t e = 0; e < t.count; e += piece_elems) {
      pieces.push_back(Piece{&t, e, std::min(piece_elems, t.count - e)});
    }
  }
  pool_->ParallelFor(pieces.size(), [&](size_t i) {
    const Piece& p = pieces[i];
    std::vector<const void*> srcs(p.task->srcs.size());
    for (size_t k = 0; k < srcs.size(); ++k) {
      srcs[k] = static_cast<const uint8_t*>(p.task->srcs[k]) + p.first * item;
    }
    ReduceInto(desc.dtype, srcs, p.task->dst + p.first * item, p.count, desc.reduce_op, world);
  });
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

class InprocCommunicator final : public Communicator {
 public:
  explicit InprocCommunicator(std::shared_ptr<InprocCore> core) : core_(std::move(core)) {}
  ~InprocCommunicator() override {
    core_->Abort(absl::AbortedError("inproc communicator destroyed"), /*quiet=*/true);
  }

  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& o,
                 DoneCallback done) override {
    core_->Arrive(o.rank, AllGatherCall(in, out, o.unit), o, std::move(done));
  }
  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& o,
                     DoneCallback done) override {
    core_->Arrive(o.rank, ReduceScatterCall(in, out, op, o.unit), o, std::move(done));
  }
  void Broadcast(MutableBuffer buf, int root, const OpOptions& o, DoneCallback done) override {
    core_->Arrive(o.rank, BroadcastCall(buf, root, o.unit), o, std::move(done));
  }
  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& o,
              DoneCallback done) override {
    core_->Arrive(o.rank, GatherCall(in, out, root, o.unit), o, std::move(done));
  }
  void Abort(absl::Status reason) override { core_->Abort(std::move(reason)); }
  absl::Status status() const override { return core_->status(); }
  std::vector<PendingOpInfo> PendingOps() const override { return core_->PendingOps(); }
  absl::string_view backend_name() const override { return "inproc"; }

 private:
  std::shared_ptr<InprocCore> core_;
};

class InprocBackend final : public CollectiveBackend {
 public:
  explicit InprocBackend(const InprocBackendOptions& options)
      : options_(options), timer_(std::make_shared<DeadlineTimer>()) {
    int helpers = options.copy_threads;
    if (helpers < 0) {
      const int hw = static_cast<int>(std::thread::hardware_concurrency());
      helpers = std::clamp(hw - 1, 0, 7);
    }
    pool_ = std::make_shared<WorkerPool>(helpers);
  }

  absl::string_view Name() const override { return "inproc"; }
  bool IsViable() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind != MemoryKind::kCuda; }

  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& group) override {
    FS_RETURN_IF_ERROR(CheckGroupSpec(group));
    if (static_cast<int>(group.local_ranks.size()) != group.world_size) {
      std::vector<int> remote;
      for (int r = 0; r < group.world_size; ++r) {
        if (std::find(group.local_ranks.begin(), group.local_ranks.end(), r) ==
            group.local_ranks.end()) {
          remote.push_back(r);
        }
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", group.group_id, ": the inproc backend needs every rank in this daemon; ",
          FormatRanks(remote), " live elsewhere"));
    }
    FS_LOG(INFO) << "group=" << group.group_id << " inproc communicator for " << group.world_size
                 << " ranks";
    return std::make_unique<InprocCommunicator>(
        std::make_shared<InprocCore>(group, timer_, pool_, options_));
  }

 private:
  const InprocBackendOptions options_;
  // Shared with communicators, which may outlive the backend.
  std::shared_ptr<DeadlineTimer> timer_;
  std::shared_ptr<WorkerPool> pool_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateInprocBackend(
    const InprocBackendOptions& options) {
  return std::make_unique<InprocBackend>(options);
}

}  // namespace flatshard::collective
