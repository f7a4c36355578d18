#include "server/collective/inproc/inproc_transport.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace flatshard::collective {
namespace {

// Per-thread trampoline: a completion that triggers further completions on the same thread
// (send -> callback -> next send -> match -> callback ...) queues them instead of recursing.
struct Trampoline {
  bool running = false;
  std::deque<absl::AnyInvocable<void()>> queue;
};
thread_local Trampoline tls_trampoline;

void Run(absl::AnyInvocable<void()> fn) {
  Trampoline& t = tls_trampoline;
  if (t.running) {
    t.queue.push_back(std::move(fn));
    return;
  }
  t.running = true;
  fn();
  while (!t.queue.empty()) {
    absl::AnyInvocable<void()> next = std::move(t.queue.front());
    t.queue.pop_front();
    next();
  }
  t.running = false;
}

void RunDone(DoneCallback done, absl::Status status) {
  Run([done = std::move(done), status = std::move(status)]() mutable {
    std::move(done)(std::move(status));
  });
}

}  // namespace

InprocTransport::InprocTransport(int world_size) : world_size_(world_size) {
  FS_CHECK(world_size >= 1) << "world_size " << world_size;
}

InprocTransport::~InprocTransport() { Abort(absl::AbortedError("inproc transport destroyed")); }

absl::Status InprocTransport::CheckRanks(int a, int b) const {
  if (a < 0 || a >= world_size_ || b < 0 || b >= world_size_ || a == b) {
    return absl::InvalidArgumentError(absl::StrCat("inproc transport: bad ranks ", a, " -> ", b,
                                                   " for world_size ", world_size_));
  }
  return absl::OkStatus();
}

void InprocTransport::Complete(int src, int dst, MessageTag tag, PendingSend send,
                               PendingRecv recv) {
  absl::Status status;
  if (send.data.bytes != recv.data.bytes) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "message size mismatch at op_seq ", tag.op_seq, " (sub ", tag.sub, "): rank ", src,
        " sent ", send.data.bytes, " bytes but rank ", dst, " expected ", recv.data.bytes));
  } else if (send.data.bytes > 0 && send.data.data != recv.data.data) {
    std::memcpy(recv.data.data, send.data.data, send.data.bytes);
  }
  Run([send = std::move(send), recv = std::move(recv), status]() mutable {
    std::move(send.done)(status);
    std::move(recv.done)(status);
  });
}

void InprocTransport::Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) {
  if (absl::Status s = CheckRanks(src, dst); !s.ok()) return RunDone(std::move(done), s);
  const Key key{src, dst, tag.op_seq, tag.sub};
  PendingRecv recv;
  absl::Status failed;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) {
      failed = sticky_;
    } else {
      Queues& q = table_[key];
      if (q.recvs.empty()) {
        q.sends.push_back(PendingSend{data, std::move(done)});
        return;
      }
      recv = std::move(q.recvs.front());
      q.recvs.pop_front();
      if (q.sends.empty() && q.recvs.empty()) table_.erase(key);
    }
  }
  if (!failed.ok()) return RunDone(std::move(done), std::move(failed));
  Complete(src, dst, tag, PendingSend{data, std::move(done)}, std::move(recv));
}

void InprocTransport::Recv(int dst, int src, MessageTag tag, MutableBuffer data,
                           DoneCallback done) {
  if (absl::Status s = CheckRanks(src, dst); !s.ok()) return RunDone(std::move(done), s);
  const Key key{src, dst, tag.op_seq, tag.sub};
  PendingSend send;
  absl::Status failed;
  {
    absl::MutexLock lock(&mu_);
    if (!sticky_.ok()) {
      failed = sticky_;
    } else {
      Queues& q = table_[key];
      if (q.sends.empty()) {
        q.recvs.push_back(PendingRecv{data, std::move(done)});
        return;
      }
      send = std::move(q.sends.front());
      q.sends.pop_front();
      if (q.sends.empty() && q.recvs.empty()) table_.erase(key);
    }
  }
  if (!failed.ok()) return RunDone(std::move(done), std::move(failed));
  Complete(src, dst, tag, std::move(send), PendingRecv{data, std::move(done)});
}

void InprocTransport::Abort(absl::Status reason) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  absl::flat_hash_map<Key, Queues> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (sticky_.ok()) sticky_ = reason;
    status = sticky_;
    failed.swap(table_);
  }
  for (auto& [key, q] : failed) {
    for (PendingSend& s : q.sends) RunDone(std::move(s.done), status);
    for (PendingRecv& r : q.recvs) RunDone(std::move(r.done), status);
  }
}

size_t InprocTransport::unmatched() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [key, q] : table_) n += q.sends.size() + q.recvs.size();
  return n;
}

}  // namespace flatshard::collective
