#pragma once
// ScratchPool: host scratch buffers that the collective algorithms reuse across ops (the
// reduce-scatter's partial sums, the hierarchical collectives' node copies), so that a
// training loop touches their pages once instead of once per op. A fresh buffer per op costs a
// page fault per 4 KiB page, and page faults are expensive in some VMs (measured on a PVM
// guest: a 64 MiB reduce-scatter across two daemons spent most of its time faulting in
// freshly allocated scratch).
//
// Bounded: at most `keep_bytes` of idle buffers are kept (a buffer larger than that is freed
// when released), and buffers idle for `idle_release` are freed on the timer's thread, so an
// idle daemon holds no scratch.
//
// Thread safety: thread-safe. A Scratch handle is owned by one op; it returns its buffer to the
// pool when destroyed (the pool may be gone by then: the buffer is freed).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/collective/deadline_timer.h"

namespace flatshard::collective {

class ScratchPool : public std::enable_shared_from_this<ScratchPool> {
 public:
  static constexpr size_t kDefaultKeepBytes = size_t{1} << 30;
  static constexpr absl::Duration kDefaultIdleRelease = absl::Seconds(2);

  // One buffer of at least `bytes()` bytes; uninitialized memory (not zeroed).
  class Scratch {
   public:
    Scratch() = default;
    Scratch(Scratch&&) = default;
    // Gives this handle's buffer back before taking the other's.
    Scratch& operator=(Scratch&& other) noexcept;
    ~Scratch() { GiveBack(); }
    uint8_t* data() const { return buf_.get(); }
    size_t bytes() const { return bytes_; }

   private:
    friend class ScratchPool;
    void GiveBack();
    std::weak_ptr<ScratchPool> pool_;
    std::unique_ptr<uint8_t[]> buf_;
    size_t bytes_ = 0;
  };

  // `timer` runs the idle release; null: idle buffers are only freed beyond `keep_bytes`.
  static std::shared_ptr<ScratchPool> Create(std::shared_ptr<DeadlineTimer> timer,
                                             size_t keep_bytes = kDefaultKeepBytes,
                                             absl::Duration idle_release = kDefaultIdleRelease);
  ScratchPool(const ScratchPool&) = delete;
  ScratchPool& operator=(const ScratchPool&) = delete;
  ~ScratchPool();

  // The smallest idle buffer of at least `bytes` (reused pages), else a new one.
  Scratch Acquire(size_t bytes);

  // Idle bytes held (for tests).
  size_t idle_bytes() const;

 private:
  struct Idle {
    std::unique_ptr<uint8_t[]> buf;
    size_t bytes = 0;
    absl::Time since;
  };
  ScratchPool(std::shared_ptr<DeadlineTimer> timer, size_t keep_bytes, absl::Duration idle_release);
  void Release(std::unique_ptr<uint8_t[]> buf, size_t bytes);
  // Frees buffers idle for idle_release_ (on the timer's thread).
  void ReleaseIdle();

  const std::shared_ptr<DeadlineTimer> timer_;
  const size_t keep_bytes_;
  const absl::Duration idle_release_;
  mutable absl::Mutex mu_;
  std::vector<Idle> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_total_ ABSL_GUARDED_BY(mu_) = 0;
  DeadlineTimer::TimerId sweep_ ABSL_GUARDED_BY(mu_) = DeadlineTimer::kNoTimer;
};

}  // namespace flatshard::collective
