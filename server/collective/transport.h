#pragma once
// Transport: tagged point-to-point messages between the ranks of one group. The collective
// algorithms (ring_algorithms.h) are written once over this interface; the inproc backend
// (inproc/inproc_transport.h, memcpy between local ranks) and the UCX backend (tag API,
// later) implement it.
//
// Matching: a Send(src, dst, tag) matches the Recv(dst, src, tag) with the same triple, in
// posting order per triple, whichever is posted first (early sends wait; they are never
// misrouted). Tags carry the op_seq so messages of different collectives never match; the
// group is implied by the Transport instance (UCX packs it into the wire tag).
//
// Thread safety: implementations are thread-safe. One Transport serves every local rank of
// its group; `src` of a Send and `dst` of a Recv must be local ranks.
//
// Callbacks run exactly once, never under a lock held by the transport, possibly on the
// posting thread before Send/Recv returns or on another rank's (or a progress) thread.

#include <cstdint>
#include <string>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "server/collective/backend.h"
#include "server/collective/buffer.h"

namespace flatshard::collective {

// Identifies a message within its group: the collective (op_seq) and the message within it
// (`sub`, chosen by the algorithm: step, chunk or channel).
struct MessageTag {
  uint64_t op_seq = 0;
  uint32_t sub = 0;

  friend bool operator==(const MessageTag&, const MessageTag&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const MessageTag& t) {
    return H::combine(std::move(h), t.op_seq, t.sub);
  }
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int world_size() const = 0;

  // Sends `data.bytes` bytes from local rank `src` to rank `dst`. `data` must stay valid until
  // `done` runs. `done` gets OK once the bytes are out of `data` (delivered, for inproc), or
  // the error: INVALID_ARGUMENT (bad rank; message size differs from the matching Recv),
  // UNAVAILABLE (peer down), or the abort reason.
  virtual void Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) = 0;

  // Receives exactly `data.bytes` bytes for local rank `dst` from rank `src` into `data`.
  // Errors as for Send; a message of a different size fails both sides with INVALID_ARGUMENT.
  virtual void Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) = 0;

  // Sticky: fails every pending (unmatched) and every later Send/Recv with `reason` (OK
  // becomes ABORTED); the first reason wins. A transfer whose bytes are already moving
  // completes normally; either way a buffer is released only by its callback. Idempotent.
  virtual void Abort(absl::Status reason) = 0;
};

}  // namespace flatshard::collective
