#include "server/collective/ucx/same_host_copy.h"

#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/metrics/registry.h"

namespace flatshard::collective::ucx {

const char* AckCodeName(AckCode code) {
  switch (code) {
    case AckCode::kOk:
      return "ok";
    case AckCode::kDenied:
      return "denied";
    case AckCode::kFailed:
      return "failed";
    case AckCode::kAborted:
      return "aborted";
    case AckCode::kMismatch:
      return "size mismatch";
    case AckCode::kReleased:
      return "sender released its buffer";
  }
  return "unknown";
}

uint64_t PidNamespace() {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

namespace {

// Process-unique, never 0, and unlike any earlier process's tokens at the same address.
uint64_t NextToken() {
  static std::atomic<uint64_t> counter{static_cast<uint64_t>(absl::GetCurrentTimeNanos()) ^
                                       (static_cast<uint64_t>(getpid()) << 40)};
  uint64_t t;
  do {
    t = counter.fetch_add(0x9E3779B97F4A7C15ull, std::memory_order_relaxed);
  } while (t == 0);
  return t;
}

}  // namespace

TokenSlot::TokenSlot() : token_(NextToken()), slot_(token_) {}

ProcessCopy::ProcessCopy(const CopyHeader& header, void* dst, size_t chunk_bytes, std::string peer)
    : header_(header),
      dst_(static_cast<char*>(dst)),
      chunk_(std::max<size_t>(chunk_bytes, 4096)),
      peer_(std::move(peer)) {
  // Another pid namespace: the pid names some other process here, never read it.
  const uint64_t ns = PidNamespace();
  if (ns == 0 || ns != header_.pid_namespace) {
    error_ = EPERM;
    state_ = State::kDenied;
  }
}

ProcessCopy::State ProcessCopy::Fail(int err, const char* what) {
  error_ = err;
  // Nothing read and no permission: the caller falls back to UCX.
  if (copied_ == 0 && (err == EPERM || err == ENOSYS)) return state_ = State::kDenied;
  std::string why = err == 0 ? "short read" : std::strerror(err);
  if (err == ESRCH) why += " (the peer daemon exited)";
  status_ =
      absl::UnavailableError(absl::StrCat("same-host copy from ", peer_, " failed after ", copied_,
                                          " of ", header_.bytes, " bytes (", what, "): ", why));
  return state_ = State::kFailed;
}

ProcessCopy::State ProcessCopy::Step() {
  if (state_ != State::kCopying) return state_;
  const pid_t pid = static_cast<pid_t>(header_.pid);
  if (copied_ < header_.bytes) {
    const size_t n = std::min(chunk_, static_cast<size_t>(header_.bytes) - copied_);
    iovec local{dst_ + copied_, n};
    iovec remote{reinterpret_cast<void*>(header_.address + copied_), n};
    const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0) return Fail(errno, "reading its buffer");
    if (got == 0) return Fail(0, "reading its buffer");
    copied_ += static_cast<size_t>(got);  // a partial read continues with the next step
    if (copied_ < header_.bytes) return state_;
  }
  // Every byte is here; they are the sender's only if it still kept the buffer afterwards.
  uint64_t slot = 0;
  iovec local{&slot, sizeof(slot)};
  iovec remote{reinterpret_cast<void*>(header_.token_address), sizeof(slot)};
  if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != sizeof(slot)) {
    return Fail(errno, "reading its token");
  }
  if (slot != header_.token) {
    released_ = true;
    status_ = absl::AbortedError(absl::StrCat("same-host copy from ", peer_,
                                              ": the sender gave up the transfer (its op "
                                              "was aborted) while ",
                                              header_.bytes, " bytes were read"));
    return state_ = State::kFailed;
  }
  return state_ = State::kDone;
}

CopyAck ProcessCopy::Ack() const {
  CopyAck ack;
  ack.copied = copied_;
  ack.error = error_;
  switch (state_) {
    case State::kDone:
      ack.code = static_cast<uint32_t>(AckCode::kOk);
      break;
    case State::kDenied:
      ack.code = static_cast<uint32_t>(AckCode::kDenied);
      break;
    case State::kFailed:
      ack.code = static_cast<uint32_t>(released_ ? AckCode::kReleased : AckCode::kFailed);
      break;
    case State::kCopying:
      ack.code = static_cast<uint32_t>(AckCode::kAborted);
      break;
  }
  return ack;
}

void CountSameHostCopy(const char* result, size_t bytes) {
  static metrics::CounterFamily& copies = metrics::DefaultRegistry().AddCounter(
      "flatshard_same_host_copies_total",
      "Messages received from a same-host daemon with one process_vm_readv copy, by result "
      "(ok, failed, denied: sent over UCX instead)",
      {"result"});
  static metrics::CounterFamily& copied = metrics::DefaultRegistry().AddCounter(
      "flatshard_same_host_copy_bytes_total",
      "Bytes received from same-host daemons with one process_vm_readv copy", {});
  copies.WithLabels({result}).Increment();
  if (bytes > 0) copied.WithLabels({}).Increment(static_cast<double>(bytes));
}

}  // namespace flatshard::collective::ucx
