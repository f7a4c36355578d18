#include "server/collective/local_rendezvous.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace flatshard::collective {

absl::Status OpSeqOrder::Next(int rank, uint64_t op_seq, const OpDescriptor& desc) {
  auto [it, first] = last_.try_emplace(rank, op_seq);
  if (first) return absl::OkStatus();
  if (op_seq <= it->second) return OpSeqOrderError(rank, op_seq, desc, it->second);
  it->second = op_seq;
  return absl::OkStatus();
}

LocalRendezvous::LocalRendezvous(GroupSpec spec, LocalRendezvousOptions options)
    : spec_(std::move(spec)), options_(std::move(options)) {
  FS_CHECK(options_.timer != nullptr) << "LocalRendezvous needs a DeadlineTimer";
}

int LocalRendezvous::LocalIndex(int rank) const {
  // local_ranks is ascending (CheckGroupSpec): no per-rank table for a huge all-local group.
  auto it = std::lower_bound(spec_.local_ranks.begin(), spec_.local_ranks.end(), rank);
  if (it == spec_.local_ranks.end() || *it != rank) return -1;
  return static_cast<int>(it - spec_.local_ranks.begin());
}

void LocalRendezvous::SetStickyLocked(absl::Status status, std::vector<RendezvousCall>* out,
                                      bool quiet) {
  if (!sticky_.ok()) return;  // the first error wins; nothing is waiting any more
  sticky_ = std::move(status);
  const size_t before = out->size();
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.running) {  // the owner completes it
      ++it;
      continue;
    }
    for (std::optional<RendezvousCall>& c : it->second.calls) {
      if (c) out->push_back(std::move(*c));
    }
    it = slots_.erase(it);
  }
  const size_t failed = out->size() - before;
  if (!quiet || failed > 0) {
    FS_LOG(WARNING) << options_.log_name << " failed (" << failed
                    << " waiting calls fail with it): " << sticky_;
  }
}

void LocalRendezvous::FailCalls(std::vector<RendezvousCall> calls, const absl::Status& status) {
  for (RendezvousCall& c : calls) {
    options_.timer->Cancel(c.timer);
    std::move(c.done)(status);
  }
}

RendezvousOp LocalRendezvous::TakeLocked(std::map<uint64_t, Slot>::iterator it) {
  Slot& slot = it->second;
  slot.running = true;
  RendezvousOp op;
  op.op_seq = it->first;
  op.desc = slot.desc;
  op.name = slot.name;
  op.calls.reserve(slot.calls.size());
  for (std::optional<RendezvousCall>& c : slot.calls) {
    if (c->deadline < op.deadline) {
      op.deadline = c->deadline;
      op.budget = c->deadline - c->arrived_at;
    }
    op.calls.push_back(std::move(*c));
  }
  slot.calls.clear();
  return op;
}

std::optional<RendezvousOp> LocalRendezvous::Arrive(OpCall call, const OpOptions& o,
                                                    DoneCallback done) {
  const int rank = o.rank;
  if (absl::Status s = CheckRank(rank, spec_); !s.ok()) {
    std::move(done)(s);  // not a member: nobody waits for this call, so not sticky
    return std::nullopt;
  }
  const int index = LocalIndex(rank);
  const uint64_t op_seq = o.op_seq;
  absl::Status bad = ValidateCall(call, rank, spec_.world_size, op_seq, options_.host_only);
  if (bad.ok() && options_.check_call) bad = options_.check_call(call, rank, op_seq);
  FS_VLOG(2) << options_.log_name << " rank=" << rank << " op_seq=" << op_seq << " "
             << FormatOp(call.desc) << " arrived";

  std::vector<RendezvousCall> failed;
  absl::Status fail;
  std::optional<RendezvousOp> ready;
  bool taken = false;  // a moved-from AnyInvocable is not guaranteed to be empty
  {
    absl::MutexLock lock(&mu_);
    if (sticky_.ok() && !bad.ok()) SetStickyLocked(std::move(bad), &failed, /*quiet=*/false);
    if (sticky_.ok() && closed_) SetStickyLocked(closed_reason_, &failed, /*quiet=*/true);
    if (sticky_.ok()) {
      if (absl::Status s = order_.Next(rank, op_seq, call.desc); !s.ok()) {
        SetStickyLocked(std::move(s), &failed, /*quiet=*/false);
      }
    }
    if (sticky_.ok()) {
      auto it = slots_.try_emplace(op_seq).first;
      Slot& slot = it->second;
      if (slot.arrived == 0) {
        slot.desc = call.desc;
        slot.first_rank = rank;
        slot.name = o.name;
        slot.first_arrival = absl::Now();
        slot.calls.resize(local_count());
      }
      if (options_.compare_descriptors && call.desc != slot.desc) {
        // The arguments are read before SetStickyLocked erases the slot.
        SetStickyLocked(MismatchError(op_seq, slot.first_rank, slot.desc, rank, call.desc), &failed,
                        /*quiet=*/false);
      } else {
        RendezvousCall& c = slot.calls[index].emplace();
        c.rank = rank;
        c.call = call;
        c.done = std::move(done);
        c.arrived_at = absl::Now();
        c.deadline = o.deadline;
        taken = true;
        if (++slot.arrived == local_count() && options_.hand_over_on_arrival) {
          ready = TakeLocked(it);
        } else if (o.deadline != absl::InfiniteFuture()) {
          // The timer's lock is a leaf, so scheduling under ours is safe.
          c.timer = options_.timer->Schedule(o.deadline, [weak = weak_from_this(), op_seq, index] {
            if (auto self = weak.lock()) self->OnDeadline(op_seq, index);
          });
        }
      }
    }
    if (!sticky_.ok()) fail = sticky_;
  }
  if (!fail.ok()) {
    if (!taken) std::move(done)(fail);
    FailCalls(std::move(failed), fail);
    return std::nullopt;
  }
  if (ready) {
    for (const RendezvousCall& c : ready->calls) options_.timer->Cancel(c.timer);
  }
  return ready;
}

std::optional<RendezvousOp> LocalRendezvous::TakeReady() {
  std::optional<RendezvousOp> op;
  {
    absl::MutexLock lock(&mu_);
    auto it = slots_.begin();
    if (it == slots_.end() || it->second.running || it->second.arrived != local_count()) {
      return std::nullopt;
    }
    op = TakeLocked(it);
  }
  for (const RendezvousCall& c : op->calls) options_.timer->Cancel(c.timer);
  return op;
}

void LocalRendezvous::WaitForWork(absl::Time until) const {
  absl::MutexLock lock(&mu_);
  auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!sticky_.ok() || closed_) return true;
    auto it = slots_.begin();
    return it != slots_.end() && !it->second.running && it->second.arrived == local_count();
  };
  mu_.AwaitWithDeadline(absl::Condition(&work), until);
}

absl::Status LocalRendezvous::Finish(uint64_t op_seq, absl::Status result) {
  std::vector<RendezvousCall> failed;
  {
    absl::MutexLock lock(&mu_);
    slots_.erase(op_seq);
    if (result.ok()) return result;
    SetStickyLocked(std::move(result), &failed, /*quiet=*/false);
    result = sticky_;
  }
  FailCalls(std::move(failed), result);
  return result;
}

absl::Status LocalRendezvous::Fail(absl::Status reason, bool quiet, bool drop_running) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  std::vector<RendezvousCall> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    SetStickyLocked(std::move(reason), &failed, quiet);
    if (drop_running) slots_.clear();  // only running ones are left
    status = sticky_;
  }
  FailCalls(std::move(failed), status);
  return status;
}

void LocalRendezvous::Close(absl::Status reason, bool fail) {
  std::vector<RendezvousCall> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    closed_reason_ = reason;
    if (fail || !slots_.empty()) SetStickyLocked(std::move(reason), &failed, /*quiet=*/true);
    status = sticky_;
  }
  FailCalls(std::move(failed), status);
}

bool LocalRendezvous::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

absl::Status LocalRendezvous::status() const {
  absl::MutexLock lock(&mu_);
  return sticky_;
}

void LocalRendezvous::OnDeadline(uint64_t op_seq, int index) {
  std::vector<RendezvousCall> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) return;
    auto it = slots_.find(op_seq);
    if (it == slots_.end() || it->second.running || !it->second.calls[index]) return;
    const Slot& slot = it->second;
    const RendezvousCall& c = *slot.calls[index];
    const absl::Duration budget = c.deadline - c.arrived_at;
    absl::Status s;
    if (slot.arrived == local_count()) {  // waits for TakeReady behind a running op
      s = options_.overdue ? options_.overdue(op_seq, slot.desc, slot.name, budget)
                           : absl::DeadlineExceededError(absl::StrCat(
                                 "op_seq ", op_seq, " ", FormatOp(slot.desc),
                                 ": every local rank arrived but the op did not start within ",
                                 absl::FormatDuration(absl::Ceil(budget, absl::Milliseconds(1)))));
    } else {
      std::vector<int> missing;
      for (int i = 0; i < local_count(); ++i) {
        if (!slot.calls[i]) missing.push_back(spec_.local_ranks[i]);
      }
      s = MissingRanksError(op_seq, slot.desc, missing, budget);
    }
    SetStickyLocked(std::move(s), &failed, /*quiet=*/false);
    status = sticky_;
  }
  FailCalls(std::move(failed), status);
}

std::vector<PendingOpInfo> LocalRendezvous::PendingOps() const {
  std::vector<PendingOpInfo> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  for (const auto& [op_seq, slot] : slots_) {
    PendingOpInfo& p = out.emplace_back(PendingOpOf(op_seq, slot.desc, slot.name));
    p.age = now - slot.first_arrival;
    p.running = slot.running;
    for (int i = 0; i < local_count(); ++i) {
      const bool present = slot.running || slot.calls[i].has_value();
      (present ? p.arrived_ranks : p.missing_ranks).push_back(spec_.local_ranks[i]);
    }
  }
  return out;
}

}  // namespace flatshard::collective
