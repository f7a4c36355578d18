#pragma once
// The staging communicator: runs a Communicator whose backend reaches only one kind of memory
// (host for inproc and UCX, CUDA for NCCL) on buffers of any kind. A buffer the inner backend
// cannot reach is staged through a buffer of the inner kind: inputs are copied in before the
// inner op is issued, outputs are copied out after the inner op succeeded (a failed op leaves
// every output untouched). Buffers the inner backend reaches pass through without copies, and
// an op none of whose buffers needs staging goes to the inner communicator unchanged.
//
// The special shapes of backend.h keep their meaning:
// - AllGather in place (`in` is the rank's slot of `out`): `in` is copied into its slot of the
//   staged `out`; no separate staging buffer for `in`.
// - Local ranks passing the same AllGather `out` or Broadcast `buf` for one op_seq share one
//   staging buffer, so the inner backend still assembles one copy per node; it is copied out
//   once, when the inner op has completed for every rank sharing it, and only then do their
//   callbacks run. Device staging (NCCL inner) shares per device instead: NCCL ranks live on
//   different GPUs and cannot share a buffer, so each device gets its own copy (all equal
//   after the op) and the first one is copied out, still once.
// - Gather: only root's `out` is staged; other ranks pass an empty `out` to the inner op.
// - Broadcast: `buf` is copied in on root and copied out on the other ranks.
// - ReduceScatter `out` == in + r*S: `out` is that slice of the staged `in`.
//
// Failures of staging itself (allocating a staging buffer, a copy) abort the inner
// communicator with the error, so that, as for any sticky error, every pending and later op of
// the group fails with it instead of waiting for a rank that will not arrive; the failing
// rank's callback gets the communicator's (sticky) status. A failed copy-out reports the error
// to the ranks whose output it was; the output may then be partially written.
//
// Copies never run under a lock. They run on the thread that issues the op (copy-in) and on
// the thread that runs the inner op's callback (copy-out); with the inproc backend that is the
// rank that completes the op. Staging buffers are reused across ops (a few per kind, device
// and size class) so a training loop does not allocate pinned or device memory per step.
//
// Thread safety: as for every Communicator (backend.h). Callbacks run exactly once, never
// under a lock, possibly after the staging communicator was destroyed (it fails pending ops).

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/collective/backend.h"

namespace flatshard::collective {

// Moves bytes between host and device memory for the staging communicator. Real: CUDA
// (cudaMemcpy + pinned host / cudaMalloc'd device staging buffers). Tests: a fake.
// Implementations are thread-safe.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  // A staging buffer of `kind` (kHostPinned or kCuda on `device`), freed with the returned ptr.
  virtual absl::StatusOr<std::shared_ptr<void>> AllocateStaging(MemoryKind kind, int device,
                                                                size_t bytes) = 0;
  // Copies and waits. `device`: the GPU involved.
  virtual absl::Status Copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind,
                            size_t bytes, int device) = 0;
};

// CUDA copies: staging from cudaHostAlloc (portable) and cudaMalloc; each copy is a
// cudaMemcpyAsync on a per-device non-blocking stream, waited for by polling with a deadline
// (`copy_timeout`; DEADLINE_EXCEEDED names the device and bytes).
// Without CUDA every call fails with FAILED_PRECONDITION "built without CUDA"; without a GPU
// they fail with the CUDA error (FAILED_PRECONDITION for a missing driver or device).
// For simulated GPUs (gpu::DeviceContext::CreateSimulated), whose "device" memory is host
// memory: copies are memcpy and staging buffers plain host memory. Never fails.
std::shared_ptr<DeviceCopier> MakeSimulatedDeviceCopier();
std::shared_ptr<DeviceCopier> MakeCudaDeviceCopier();  // FAILED_PRECONDITION copies w/o CUDA
std::shared_ptr<DeviceCopier> MakeCudaDeviceCopier(absl::Duration copy_timeout);

// A Communicator that runs `inner` (which moves `inner_kind` memory: kHost for inproc/UCX,
// kCuda for NCCL) for buffers of any kind: buffers the inner backend cannot reach are staged
// through buffers of its kind (copy in before, copy out after the inner op succeeded; a failed
// op leaves the output untouched). `spec` gives each local rank's device (local_devices) for
// the staging buffers and copies. Everything else (fingerprints, deadlines, sticky errors,
// PendingOps, Abort) is the inner communicator's. backend_name(): the inner one's, with
// "+staging" appended when `inner_kind` is a host kind ("ucx+staging"); "nccl" stays "nccl".
// Staging kind: kHostPinned when `inner_kind` is a host kind, else kCuda. A rank without an
// entry in `spec.local_devices` uses device 0.
// REQUIRES: `inner` and `copier` are not null.
std::unique_ptr<Communicator> MakeStagingCommunicator(std::unique_ptr<Communicator> inner,
                                                      MemoryKind inner_kind, const GroupSpec& spec,
                                                      std::shared_ptr<DeviceCopier> copier);

}  // namespace flatshard::collective
