#include "server/collective/collective_engine.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/op_descriptor.h"
#include "server/metrics/daemon_metrics.h"

namespace flatshard::collective {

// An op from submission to completion. `done` is taken exactly once: by the backend's
// callback, the watchdog or the group's destructor, whichever comes first.
struct CollectiveGroup::OpRecord {
  int rank = 0;
  uint64_t op_seq = 0;
  CollectiveOp op;
  absl::Time deadline;
  DeadlineTimer::TimerId watchdog = DeadlineTimer::kNoTimer;
  std::string backend;  // the metrics' label: the group's Communicator::backend_name()

  absl::Mutex mu;
  DoneCallback done ABSL_GUARDED_BY(mu);
  bool taken ABSL_GUARDED_BY(mu) = false;

  // The callback, or null when someone else already took it.
  std::optional<DoneCallback> Take() {
    absl::MutexLock lock(&mu);
    if (taken) return std::nullopt;
    taken = true;
    return std::move(done);
  }
  void Complete(absl::Status status) {
    if (std::optional<DoneCallback> d = Take()) {
      metrics::RecordCollective(CollectiveKindName(op.kind), status.code(), backend,
                                std::max(op.input.bytes, op.output.bytes));
      std::move (*d)(std::move(status));
    }
  }
};

CollectiveOp CollectiveOp::AllGather(int64_t unit, ConstBuffer shard, MutableBuffer full) {
  CollectiveOp op;
  op.kind = CollectiveKind::kAllGather;
  op.unit = unit;
  op.input = shard;
  op.output = full;
  return op;
}

CollectiveOp CollectiveOp::ReduceScatter(int64_t unit, ConstBuffer full, MutableBuffer shard,
                                         ReduceOp reduce) {
  CollectiveOp op;
  op.kind = CollectiveKind::kReduceScatter;
  op.unit = unit;
  op.input = full;
  op.output = shard;
  op.reduce = reduce;
  return op;
}

CollectiveOp CollectiveOp::Broadcast(int64_t unit, MutableBuffer buf, int root) {
  CollectiveOp op;
  op.kind = CollectiveKind::kBroadcast;
  op.unit = unit;
  op.input = buf.AsConst();
  op.output = buf;
  op.root = root;
  return op;
}

CollectiveOp CollectiveOp::AllReduce(int64_t unit, MutableBuffer buf, ReduceOp reduce) {
  CollectiveOp op;
  op.kind = CollectiveKind::kAllReduce;
  op.unit = unit;
  op.input = buf.AsConst();
  op.output = buf;
  op.reduce = reduce;
  return op;
}

CollectiveOp CollectiveOp::Gather(int64_t unit, ConstBuffer shard, MutableBuffer full, int root) {
  CollectiveOp op;
  op.kind = CollectiveKind::kGather;
  op.unit = unit;
  op.input = shard;
  op.output = full;
  op.root = root;
  return op;
}

// --- CollectiveGroup ------------------------------------------------------------------------

CollectiveGroup::CollectiveGroup(GroupSpec spec, std::unique_ptr<Communicator> comm,
                                 std::shared_ptr<DeadlineTimer> timer, EngineOptions options)
    : spec_(std::move(spec)),
      comm_(std::move(comm)),
      backend_name_(comm_->backend_name()),
      timer_(std::move(timer)),
      options_(options) {}

CollectiveGroup::~CollectiveGroup() {
  const absl::Status reason = absl::AbortedError(
      absl::StrCat("group ", spec_.group_id, " was removed from the collective engine"));
  // Backend callbacks find no group any more and complete their records directly.
  comm_->Abort(reason);
  absl::Status status = comm_->status();
  if (status.ok()) status = reason;
  decltype(in_flight_) left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(in_flight_);
  }
  for (auto& [key, rec] : left) {
    timer_->Cancel(rec->watchdog);
    rec->Complete(status);
  }
}

void CollectiveGroup::Submit(int rank, CollectiveOp op, DoneCallback done) {
  if (absl::Status s = CheckRank(rank, spec_); !s.ok()) {
    std::move(done)(s);
    return;
  }
  auto rec = std::make_shared<OpRecord>();
  rec->rank = rank;
  rec->op = std::move(op);
  rec->backend = backend_name_;
  rec->deadline = absl::Now() + rec->op.timeout.value_or(options_.default_timeout);
  {
    absl::MutexLock lock(&rec->mu);
    rec->done = std::move(done);
  }

  absl::Status failed;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) {
      failed = sticky_;
    } else {
      RankQueue& q = ranks_[rank];
      rec->op_seq = q.next_seq;
      q.next_seq += rec->op.kind == CollectiveKind::kAllReduce ? 2 : 1;
      in_flight_[{rank, rec->op_seq}] = rec;
      // The timer's lock is a leaf; scheduling under ours is safe.
      rec->watchdog = timer_->Schedule(rec->deadline + options_.watchdog_grace,
                                       [weak = weak_from_this(), rank, seq = rec->op_seq] {
                                         if (auto g = weak.lock()) g->OnWatchdog(rank, seq);
                                       });
      q.queue.push_back(rec);
      if (q.dispatching) return;  // the dispatching thread issues it, in order
      q.dispatching = true;
    }
  }
  if (!failed.ok()) {
    rec->Complete(std::move(failed));
    return;
  }
  Dispatch(rank);
}

void CollectiveGroup::Dispatch(int rank) {
  // Hand this rank's queue to the communicator in op_seq order, without holding the lock (the
  // backend may complete ops, and run callbacks that Submit again, inside these calls).
  while (true) {
    std::shared_ptr<OpRecord> next;
    {
      absl::MutexLock lock(&mu_);
      RankQueue& q = ranks_[rank];
      if (q.queue.empty()) {
        q.dispatching = false;
        return;
      }
      next = std::move(q.queue.front());
      q.queue.pop_front();
    }
    if (next->op.kind == CollectiveKind::kAllReduce) {
      IssueAllReduce(next);  // dispatches the rest once its all-gather is issued
      return;
    }
    Issue(next);
  }
}

void CollectiveGroup::IssueAllReduce(const std::shared_ptr<OpRecord>& rec) {
  const CollectiveOp& op = rec->op;
  const int rank = rec->rank;
  auto finish = [weak = weak_from_this(), rec](absl::Status s) {
    if (auto g = weak.lock()) {
      g->OnDone(rec, std::move(s));
    } else {
      rec->Complete(std::move(s));  // the group is being destroyed
    }
  };
  const int world = spec_.world_size;
  const MutableBuffer buf = op.output;
  const size_t item = ItemSize(buf.dtype);
  auto refuse = [&](absl::string_view why) {
    OpDescriptor d;
    d.kind = CollectiveKind::kAllReduce;
    d.unit = op.unit;
    d.bytes = buf.bytes;
    d.dtype = buf.dtype;
    d.reduce_op = op.reduce;
    finish(absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " op_seq ", rec->op_seq, " ", FormatOp(d), ": ", why)));
    Dispatch(rank);
  };
  if (!IsFloatingPoint(buf.dtype)) {
    return refuse("reductions need float32, float16, bfloat16 or float64");
  }
  if (buf.bytes % item != 0) return refuse("bytes are not a multiple of the item size");
  if (buf.bytes > 0 && buf.data == nullptr) return refuse("buffer is null");
  const size_t n = buf.bytes / item;
  const size_t per_rank = (n + world - 1) / world;  // elements of each rank's reduced block
  MutableBuffer work = buf;
  std::shared_ptr<std::vector<uint8_t>> scratch;  // zero padding up to world * per_rank
  if (per_rank * world != n) {
    if (buf.kind == MemoryKind::kCuda) {
      return refuse(absl::StrCat("a device buffer's element count must be a multiple of the ",
                                 world, " ranks (pad it)"));
    }
    scratch = std::make_shared<std::vector<uint8_t>>(per_rank * world * item, 0);
    std::memcpy(scratch->data(), buf.data, buf.bytes);
    work = MutableBuffer{scratch->data(), scratch->size(), buf.dtype, MemoryKind::kHost};
  }
  const MutableBuffer own{work.begin() + static_cast<size_t>(rank) * per_rank * item,
                          per_rank * item, buf.dtype, work.kind};
  OpOptions o;
  o.rank = rank;
  o.op_seq = rec->op_seq;
  o.deadline = rec->deadline;
  o.unit = op.unit;
  o.name = op.name;
  auto gathered = [finish, scratch, buf](absl::Status s) mutable {
    if (s.ok() && scratch) std::memcpy(buf.data, scratch->data(), buf.bytes);
    finish(std::move(s));
  };
  auto reduced = [weak = weak_from_this(), rank, o, own, work,
                  gathered = std::move(gathered)](absl::Status s) mutable {
    std::shared_ptr<CollectiveGroup> g = weak.lock();
    if (g == nullptr) {
      gathered(s.ok() ? absl::AbortedError("the group was removed during an all-reduce") : s);
      return;
    }
    if (s.ok()) {
      o.op_seq += 1;
      g->comm_->AllGather(own.AsConst(), work, o, std::move(gathered));
    } else {
      gathered(std::move(s));  // sticky: the rank's later ops fail in the communicator
    }
    g->Dispatch(rank);
  };
  comm_->ReduceScatter(work.AsConst(), own, op.reduce, o, std::move(reduced));
}

void CollectiveGroup::SubmitAll(int rank, std::vector<CollectiveOp> ops, absl::Duration timeout,
                                DoneCallback done) {
  if (ops.empty()) {
    std::move(done)(absl::OkStatus());
    return;
  }
  // Counts the ops still running; the last completion reports the first error.
  struct Join {
    absl::Mutex mu;
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    absl::Status first ABSL_GUARDED_BY(mu);
    DoneCallback done;  // taken by the last completion only
  };
  auto join = std::make_shared<Join>();
  join->done = std::move(done);
  {
    absl::MutexLock lock(&join->mu);
    join->remaining = ops.size();  // before any Submit: an op may complete inside it
  }
  timeout = std::max(absl::ZeroDuration(), timeout);
  for (CollectiveOp& op : ops) {
    op.timeout = timeout;
    Submit(rank, std::move(op), [join](absl::Status s) {
      absl::Status first;
      {
        absl::MutexLock lock(&join->mu);
        if (!s.ok() && join->first.ok()) join->first = std::move(s);
        if (--join->remaining > 0) return;
        first = join->first;
      }
      std::move(join->done)(std::move(first));
    });
  }
}

void CollectiveGroup::Issue(const std::shared_ptr<OpRecord>& rec) {
  const CollectiveOp& op = rec->op;
  OpOptions o;
  o.rank = rec->rank;
  o.op_seq = rec->op_seq;
  o.deadline = rec->deadline;
  o.unit = op.unit;
  o.name = op.name;
  FS_VLOG(2) << "group=" << spec_.group_id << " rank=" << rec->rank << " op_seq=" << rec->op_seq
             << " unit=" << op.unit << " " << CollectiveKindName(op.kind) << " submitted";
  auto done = [weak = weak_from_this(), rec](absl::Status s) {
    if (auto g = weak.lock()) {
      g->OnDone(rec, std::move(s));
    } else {
      rec->Complete(std::move(s));  // the group is being destroyed
    }
  };
  switch (op.kind) {
    case CollectiveKind::kAllGather:
      comm_->AllGather(op.input, op.output, o, std::move(done));
      break;
    case CollectiveKind::kReduceScatter:
      comm_->ReduceScatter(op.input, op.output, op.reduce, o, std::move(done));
      break;
    case CollectiveKind::kBroadcast:
      comm_->Broadcast(op.output, op.root, o, std::move(done));
      break;
    case CollectiveKind::kGather:
      comm_->Gather(op.input, op.output, op.root, o, std::move(done));
      break;
    case CollectiveKind::kAllReduce:  // Dispatch routes it to IssueAllReduce
      done(absl::InternalError("all-reduce issued as a single op"));
      break;
  }
}

void CollectiveGroup::OnDone(const std::shared_ptr<OpRecord>& rec, absl::Status status) {
  bool first_error = false;
  {
    absl::MutexLock lock(&mu_);
    in_flight_.erase(std::make_pair(rec->rank, rec->op_seq));
    if (!status.ok()) {
      if (sticky_.ok()) {
        sticky_ = status;
        first_error = true;
      }
      status = sticky_;
    }
  }
  timer_->Cancel(rec->watchdog);
  if (first_error) {
    metrics::RecordAbortedCollectives();
    FS_LOG(WARNING) << "group=" << spec_.group_id << " rank=" << rec->rank
                    << " op_seq=" << rec->op_seq << " unit=" << rec->op.unit
                    << " failed; group aborted: " << status;
    comm_->Abort(status);
  }
  rec->Complete(std::move(status));
}

void CollectiveGroup::OnWatchdog(int rank, uint64_t op_seq) {
  std::shared_ptr<OpRecord> rec;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto it = in_flight_.find(std::make_pair(rank, op_seq));
    if (it == in_flight_.end()) return;
    rec = it->second;
    if (sticky_.ok()) {
      metrics::RecordAbortedCollectives();
      const CollectiveOp& op = rec->op;
      sticky_ = absl::DeadlineExceededError(
          absl::StrCat("op_seq ", op_seq, " ", CollectiveKindName(op.kind), "(unit ", op.unit,
                       ") on rank ", rank, ": the backend did not complete it within ",
                       absl::FormatDuration(op.timeout.value_or(options_.default_timeout) +
                                            options_.watchdog_grace),
                       " (engine watchdog)"));
    }
    status = sticky_;
  }
  FS_LOG(ERROR) << "group=" << spec_.group_id << " rank=" << rank << " op_seq=" << op_seq
                << " watchdog fired: " << status;
  comm_->Abort(status);  // a healthy backend now fails the op through OnDone
  {
    absl::MutexLock lock(&mu_);
    if (!in_flight_.erase(std::make_pair(rank, op_seq))) return;
  }
  rec->Complete(status);  // the backend did not: complete it here
}

absl::Status CollectiveGroup::SetSticky(absl::Status reason) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  bool first = false;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    first = sticky_.ok();
    if (first) sticky_ = std::move(reason);
    status = sticky_;
  }
  if (first) {
    metrics::RecordAbortedCollectives();
    FS_LOG(WARNING) << "group=" << spec_.group_id << " aborted: " << status;
  }
  return status;
}

void CollectiveGroup::Abort(absl::Status reason) {
  const absl::Status status = SetSticky(std::move(reason));
  // The caller may hold locks that the pending ops' callbacks take (GroupManager does), so the
  // backend is aborted from the watchdog thread. The callback keeps the group alive until then.
  timer_->Schedule(absl::Now(),
                   [self = shared_from_this(), status] { self->comm_->Abort(status); });
}

void CollectiveGroup::AbortNow(absl::Status reason) { comm_->Abort(SetSticky(std::move(reason))); }

absl::Status CollectiveGroup::status() const {
  absl::MutexLock lock(&mu_);
  return sticky_;
}

std::vector<PendingOpInfo> CollectiveGroup::PendingOps() const { return comm_->PendingOps(); }

uint64_t CollectiveGroup::last_op_seq(int rank) const {
  absl::MutexLock lock(&mu_);
  auto it = ranks_.find(rank);
  return it == ranks_.end() ? 0 : it->second.next_seq - 1;
}

// --- CollectiveEngine -----------------------------------------------------------------------

CollectiveEngine::CollectiveEngine(EngineOptions options)
    : options_(options), timer_(std::make_shared<DeadlineTimer>()) {}

CollectiveEngine::~CollectiveEngine() {
  absl::flat_hash_map<std::string, std::shared_ptr<CollectiveGroup>> groups;
  {
    absl::MutexLock lock(&mu_);
    groups.swap(groups_);
  }
  for (auto& [id, g] : groups) g->AbortNow(absl::AbortedError("collective engine shut down"));
}

absl::StatusOr<std::shared_ptr<CollectiveGroup>> CollectiveEngine::AddGroup(
    const GroupSpec& spec, std::unique_ptr<Communicator> comm) {
  FS_RETURN_IF_ERROR(CheckGroupSpec(spec));
  if (comm == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("group ", spec.group_id, ": no communicator"));
  }
  std::shared_ptr<CollectiveGroup> group(
      new CollectiveGroup(spec, std::move(comm), timer_, options_));
  absl::MutexLock lock(&mu_);
  if (!groups_.emplace(spec.group_id, group).second) {
    return absl::AlreadyExistsError(absl::StrCat("group ", spec.group_id, " already exists"));
  }
  FS_LOG(INFO) << "group=" << spec.group_id << " added to the collective engine (world_size "
               << spec.world_size << ", " << spec.local_ranks.size() << " local ranks)";
  return group;
}

absl::StatusOr<std::shared_ptr<CollectiveGroup>> CollectiveEngine::FindGroup(
    absl::string_view group_id) const {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(group_id);
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown group ", group_id));
  }
  return it->second;
}

absl::Status CollectiveEngine::RemoveGroup(absl::string_view group_id, absl::Status reason) {
  std::shared_ptr<CollectiveGroup> group;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(group_id);
    if (it == groups_.end()) return absl::NotFoundError(absl::StrCat("unknown group ", group_id));
    group = std::move(it->second);
    groups_.erase(it);
  }
  group->Abort(std::move(reason));
  return absl::OkStatus();
}

std::vector<std::string> CollectiveEngine::GroupIds() const {
  std::vector<std::string> ids;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, g] : groups_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

void CollectiveEngine::Submit(absl::string_view group_id, int rank, CollectiveOp op,
                              DoneCallback done) {
  absl::StatusOr<std::shared_ptr<CollectiveGroup>> group = FindGroup(group_id);
  if (!group.ok()) {
    std::move(done)(group.status());
    return;
  }
  (*group)->Submit(rank, std::move(op), std::move(done));
}

}  // namespace flatshard::collective
