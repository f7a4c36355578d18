#pragma once
// RankDevices: where each rank of a group keeps its memory (host, or one of the daemon's
// GPUs) and the copies between such memories. GroupManager holds one; it knows nothing about
// groups, only ranks: rank r of every group lives on gpus[r % gpus.size()] (--gpus), or in
// host memory when the daemon has no GPUs.
//
// Host-side waits on a device (a stream synchronize, a device copy, which waits for the copy)
// can take as long as the trainer's or the backend's work in front of them. They never run on
// the caller's thread when that could be a gRPC reactor thread: AfterTrainerWrites and
// RunBlocking run them on a worker of the rank's device (one thread per GPU, started on first
// use) and continue in a callback. Host ranks have nothing to wait for: their callbacks run
// inline, on the caller's thread, before the call returns (so a host daemon behaves exactly as
// with synchronous calls).
//
// Thread-safe. The synchronous copy helpers (CopyBytes, CopyOwnRange, ApplyReducedGrad,
// CopyEach) wait for device copies on the calling thread: call them from a worker (inside
// RunBlocking's `work`) or from a collective's completion, never on a reactor thread for a GPU
// rank, and never under a lock other threads need.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "common/plan.h"
#include "server/collective/buffer.h"
#include "server/gpu/device_context.h"
#include "server/shard_store.h"

namespace flatshard::server {

class RankDevices {
 public:
  // `gpus` empty: every rank is a host rank. Null entries are not allowed.
  // `device_ordering` (flatshardd --gpu_device_ordering): whether work that runs entirely on a
  // rank's stream is ordered after the trainer's event on the device (OrderOnDevice) rather
  // than by a host wait.
  explicit RankDevices(std::vector<std::shared_ptr<gpu::DeviceContext>> gpus,
                       bool device_ordering = false);
  // As Stop().
  ~RankDevices();
  RankDevices(const RankDevices&) = delete;
  RankDevices& operator=(const RankDevices&) = delete;

  // Runs the blocking work still queued (its callbacks included) and joins the workers; from
  // then on AfterTrainerWrites and RunBlocking run everything on the caller's thread.
  // Idempotent.
  void Stop();

  bool has_gpus() const { return !gpus_.empty(); }
  // The context rank `rank` lives on; null for host ranks.
  gpu::DeviceContext* DeviceOf(int32_t rank) const;
  // Where `rank`'s buffers go (host, or its GPU).
  Placement PlacementOf(int32_t rank) const;

  // Orders `rank`'s work after the trainer's event `written` and calls `done` once the host
  // has seen the device get past it (the collectives run on the backend's own streams, so a
  // stream-side wait alone would not order them). Host ranks and id 0: `done(OK)` inline. GPU
  // ranks: CheckStream's error first; a completed event calls `done(OK)` inline; otherwise the
  // host wait (bounded by the context's sync_timeout) runs on the device's worker, which then
  // calls `done` with its status (a CUDA error or DEADLINE_EXCEEDED naming the rank).
  void AfterTrainerWrites(int32_t rank, const gpu::IpcEventRef& written,
                          absl::AnyInvocable<void(absl::Status)> done);
  // Device-side ordering (device_ordering(), GPU ranks, the work all on `rank`'s stream):
  // enqueues a stream wait for the trainer's event `written` (nothing for id 0) and returns,
  // with no host wait; copies enqueued next (CopyAsync) and a RecordReady after them are
  // ordered after the trainer's writes. Host ranks: OK, nothing to do.
  // Errors: CheckStream's; WaitFor's (INVALID_ARGUMENT for a bad event), naming the rank.
  absl::Status OrderOnDevice(int32_t rank, const gpu::IpcEventRef& written);
  // Enqueues a copy on `rank`'s stream (memcpy for host ranks) and returns without waiting.
  absl::Status CopyAsync(int32_t rank, void* dst, const void* src, size_t bytes) const;
  // Errors of `rank`'s earlier device work that failed after its operation was answered (a
  // device-ordered copy, a stream wait that timed out): FAILED_PRECONDITION "rank R: work on
  // <device> that was answered already failed: ...". Sticky, as CUDA's stream errors: every
  // later operation of a rank on that device fails. AfterTrainerWrites and OrderOnDevice check
  // it first. OK for host ranks.
  absl::Status CheckStream(int32_t rank) const;
  // Keeps `keep` (buffers that work enqueued on `rank`'s stream uses) alive until that work
  // has run: dropped on the device's worker after a stream synchronize, off the caller's path
  // (an error there is CheckStream's). Host ranks: dropped now.
  void ReleaseAfterStream(int32_t rank, std::shared_ptr<void> keep);
  bool device_ordering() const { return device_ordering_; }

  // Runs `work` (which may wait on `rank`'s device) and hands its status to `done`: inline for
  // host ranks, on the device's worker for GPU ranks.
  void RunBlocking(int32_t rank, absl::AnyInvocable<absl::Status()> work,
                   absl::AnyInvocable<void(absl::Status)> done);

  // GPU ranks: an event recorded on `rank`'s device now (after the work enqueued so far). id 0
  // for host ranks, and when recording fails (logged: the trainer only loses the ordering hint).
  gpu::IpcEventRef RecordReady(int32_t rank) const;

  // Copies between buffers of any placement (memcpy, or a device copy on `rank`'s stream,
  // waited for).
  absl::Status CopyBytes(int32_t rank, void* dst, const void* src, size_t bytes) const;
  // Where shard rank `r`'s unpadded range of the full padded buffer `full` lies in `full` and
  // in `shard` (bytes 0 when `r` holds no real elements); INTERNAL naming `rank`, the unit and
  // `r` when it does not fit the buffers.
  struct OwnRangeBytes {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
  };
  static absl::StatusOr<OwnRangeBytes> OwnRange(int32_t rank, const Plan& plan,
                                                const PlanUnit& unit, int32_t r, const Buffer& full,
                                                const Buffer& shard);
  // Writes shard rank `r`'s unpadded range of the full padded buffer `full` into `shard`.
  absl::Status CopyOwnRange(int32_t rank, const Plan& plan, const PlanUnit& unit, int32_t r,
                            const Buffer& full, const Buffer& shard) const;
  // `count` elements of `from` at `src` into `to` at `dst` (CastInto's rounding), either side
  // host or `rank`'s device memory: on the host for host ranks; GPU ranks go through the
  // device context (device copies to and from host staging, waited for; no device kernels
  // yet). Mixed precision's casts before an all-gather.
  absl::Status CastBytes(int32_t rank, const void* src, DType from, void* dst, DType to,
                         int64_t count) const;
  // The reduced shard `reduced` into the gradient shard: copied, or added when `accumulate`.
  // A reduced shard of another floating dtype than `dtype` (a reduce_dtype) is cast first:
  // the gradient shard keeps the shards' precision.
  absl::Status ApplyReducedGrad(int32_t rank, collective::ConstBuffer reduced, Buffer& grad,
                                DType dtype, bool accumulate) const;
  // Copies each buffer of `from` into the buffer at the same index of `to` (as many as both
  // have; null entries on either side are skipped): the shards into their committed copies,
  // or back (a rollback). Stops at the first error.
  absl::Status CopyEach(int32_t rank, const std::vector<const Buffer*>& from,
                        const std::vector<const Buffer*>& to) const;

 private:
  // One thread per GPU for the host waits on it, started by the first job.
  struct Lane {
    absl::Mutex mu;
    std::deque<absl::AnyInvocable<void()>> jobs ABSL_GUARDED_BY(mu);
    bool stop ABSL_GUARDED_BY(mu) = false;  // drain the queue, then return
    std::thread thread;  // started once, under RankDevices::lanes_mu_, unless destroying_
  };
  void Post(int32_t rank, absl::AnyInvocable<void()> job);
  static void LaneLoop(Lane* lane);

  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  const bool device_ordering_;
  // Guards starting the lanes' threads. Lock order: lanes_mu_, then a Lane::mu.
  absl::Mutex lanes_mu_;
  bool destroying_ ABSL_GUARDED_BY(lanes_mu_) = false;
  std::vector<std::unique_ptr<Lane>> lanes_;  // one per gpus_ entry
};

}  // namespace flatshard::server
