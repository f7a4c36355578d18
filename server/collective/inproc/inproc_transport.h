#pragma once
// InprocTransport: the Transport between ranks of one process. A Send and its matching Recv
// meet in a table; whichever comes second copies the bytes with one memcpy (skipped when
// source and destination are the same memory) and completes both callbacks.
//
// Used to run ring_algorithms over local ranks (tests, benchmarks); the inproc Communicator
// itself moves bytes directly and needs no Transport.
//
// Thread safety: thread-safe. Callbacks run on the thread that completed the match, never
// under the transport's lock. Callbacks that a callback triggers on the same thread are
// queued and run after it returns (a trampoline), so chains of sends stay shallow on the
// stack.

#include <deque>
#include <memory>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "server/collective/transport.h"

namespace flatshard::collective {

class InprocTransport final : public Transport {
 public:
  // REQUIRES: world_size >= 1.
  explicit InprocTransport(int world_size);
  ~InprocTransport() override;  // fails pending operations with ABORTED

  int world_size() const override { return world_size_; }
  void Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) override;
  void Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) override;
  void Abort(absl::Status reason) override;

  // Sends and receives posted and not yet matched (for tests).
  size_t unmatched() const;

 private:
  struct PendingSend {
    ConstBuffer data;
    DoneCallback done;
  };
  struct PendingRecv {
    MutableBuffer data;
    DoneCallback done;
  };
  struct Queues {
    std::deque<PendingSend> sends;
    std::deque<PendingRecv> recvs;
  };
  // (src, dst, op_seq, sub)
  using Key = std::tuple<int, int, uint64_t, uint32_t>;

  absl::Status CheckRanks(int a, int b) const;
  // Copies and completes a matched pair outside the lock.
  static void Complete(int src, int dst, MessageTag tag, PendingSend send, PendingRecv recv);

  const int world_size_;
  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key, Queues> table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::collective
