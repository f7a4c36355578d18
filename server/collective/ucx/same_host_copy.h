#pragma once
// Single-copy transfers between daemons on one host (UcxBackendOptions::same_host_copy_min_bytes).
//
// Daemons on one host talk over TCP loopback by default (UcxBackendOptions::error_handling:
// UCX's shared memory can be wedged by a killed peer), which copies through the kernel; UCX's
// shared-memory transports copy a large message twice (into a segment, out of it), and its
// single-copy transport (CMA) aborts the whole process when a read finds the peer dead.
// This path moves the bytes once, with process_vm_readv driven by flatshard itself, so a dead
// peer is an error of one op:
//
//   sender                                     receiver
//   posts a recv for the ack (control tag)     posts its recv of `bytes` (data tag), as always
//   sends a CopyHeader (data tag): pid, pid    gets 48 bytes instead of `bytes`: a CopyHeader
//     namespace, address, length, token slot   reads the sender's buffer in chunks
//   keeps its buffer                             (process_vm_readv, straight into its own)
//                                              re-reads the token slot: still the token?
//   gets the CopyAck: OK -> done(OK)     <---  sends a CopyAck (control tag) and finishes
//
// The sender clears its token slot before it releases the buffer (its callback), and the
// receiver accepts the bytes only if the slot still held the token after the last chunk, so
// a sender that gave up (its abort, its deadline) never leaves the receiver with bytes of a
// reused buffer. A receiver that may not read the sender (EPERM: ptrace rules such as Yama's
// ptrace_scope >= 1 for processes that are not descendants, another pid namespace) answers
// kDenied before reading anything: the sender then sends the message over UCX as usual and
// keeps doing so for that peer (logged once, counted in flatshard_same_host_copies_total).
//
// Metrics: flatshard_same_host_copies_total{result} (ok, failed, denied) counts received
// messages; flatshard_same_host_copy_bytes_total their bytes. Pure mechanics (no UCX):
// thread-compatible; the UCX backend uses it on its progress thread.

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace flatshard::collective::ucx {

// Messages below this size never go by same-host copy, whatever the options say: receivers of
// larger ones from same-host peers keep room for a header (Request::head).
inline constexpr size_t kMinCopyBytes = size_t{64} << 10;

inline constexpr uint64_t kCopyHeaderMagic = 0x3179706f63736621ull;  // "!fscopy1"

// What the sender sends on the message's own tag instead of the bytes (little-endian host
// order: both ends share a kernel).
struct CopyHeader {
  uint64_t magic = kCopyHeaderMagic;
  uint64_t pid = 0;            // the sender's pid, in its pid namespace
  uint64_t pid_namespace = 0;  // inode of /proc/self/ns/pid: the pid means the same here
  uint64_t address = 0;        // the sender's buffer
  uint64_t bytes = 0;
  uint64_t token_address = 0;  // a uint64_t that holds `token` while the buffer is kept
  uint64_t token = 0;
};

enum class AckCode : uint32_t {
  kOk = 0,
  kDenied = 1,    // nothing read: may not read the sender (send it over UCX instead)
  kFailed = 2,    // the read failed (errno in CopyAck::error)
  kAborted = 3,   // the receiver's op was aborted before it finished
  kMismatch = 4,  // the receiver expected another size
  kReleased = 5,  // the sender's token was gone after the copy: it gave up
};

// What the receiver answers on the control tag.
struct CopyAck {
  uint32_t code = 0;  // AckCode
  int32_t error = 0;  // errno for kFailed
  uint64_t copied = 0;
};

const char* AckCodeName(AckCode code);

// The inode of this process's pid namespace (0 if unknown: never equal to a peer's).
uint64_t PidNamespace();

// A sender's token slot: holds a process-unique token while the receiver may read the
// buffer. Its address travels in the header.
class TokenSlot {
 public:
  TokenSlot();
  uint64_t token() const { return token_; }
  uint64_t address() const { return reinterpret_cast<uint64_t>(&slot_); }
  // Before the buffer goes back to its owner.
  void Release() { slot_.store(0, std::memory_order_seq_cst); }

 private:
  const uint64_t token_;
  std::atomic<uint64_t> slot_;
};

// One receive's copy out of another process, a chunk per Step() so that the caller can stop
// between chunks (an abort).
class ProcessCopy {
 public:
  // `peer` names the sender in errors ("rank 3 (pid 1234)").
  ProcessCopy(const CopyHeader& header, void* dst, size_t chunk_bytes, std::string peer);

  enum class State { kCopying, kDone, kDenied, kFailed };
  // Copies the next chunk; after the last one, checks the token. kFailed: status() says why.
  State Step();
  State state() const { return state_; }
  const absl::Status& status() const { return status_; }
  size_t copied() const { return copied_; }
  // The ack for the state reached (kOk, kDenied, kFailed, kReleased).
  CopyAck Ack() const;

 private:
  State Fail(int err, const char* what);

  const CopyHeader header_;
  char* const dst_;
  const size_t chunk_;
  const std::string peer_;
  size_t copied_ = 0;
  int error_ = 0;
  bool released_ = false;
  State state_ = State::kCopying;
  absl::Status status_;
};

// The metrics above; `result` is "ok", "failed" or "denied".
void CountSameHostCopy(const char* result, size_t bytes);

}  // namespace flatshard::collective::ucx
