// MakeCudaDeviceCopier: staging buffers from cudaHostAlloc / cudaMalloc, copies on a
// non-blocking stream per device, each waited for with a deadline.

#include <cstdlib>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/gpu/cuda_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/staging/staging_communicator.h"

#if FS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace flatshard::collective {

#if FS_HAVE_CUDA

namespace {

using gpu::CudaStatus;
using gpu::PollUntilDone;
using gpu::ScopedCudaDevice;

class CudaDeviceCopier final : public DeviceCopier {
 public:
  explicit CudaDeviceCopier(absl::Duration timeout) : timeout_(timeout) {}
  ~CudaDeviceCopier() override {
    for (auto& [device, stream] : streams_) {
      ScopedCudaDevice scoped(device);
      if (cudaStreamDestroy(stream) != cudaSuccess) cudaGetLastError();
    }
  }

  absl::StatusOr<std::shared_ptr<void>> AllocateStaging(MemoryKind kind, int device,
                                                        size_t bytes) override {
    if (kind == MemoryKind::kHost) {
      void* p = std::malloc(bytes == 0 ? 1 : bytes);
      if (p == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat("malloc(", bytes, ") failed"));
      }
      return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    }
    ScopedCudaDevice scoped(device);
    FS_RETURN_IF_ERROR(scoped.status());
    void* p = nullptr;
    if (kind == MemoryKind::kHostPinned) {
      FS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
                              absl::StrCat("cudaHostAlloc(", bytes, ")"));
      return std::shared_ptr<void>(p, [](void* q) {
        if (cudaFreeHost(q) != cudaSuccess) cudaGetLastError();
      });
    }
    FS_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes),
                            absl::StrCat("device ", device, ": cudaMalloc(", bytes, ")"));
    return std::shared_ptr<void>(p, [device](void* q) {
      ScopedCudaDevice scoped(device);
      if (cudaFree(q) != cudaSuccess) cudaGetLastError();
    });
  }

  absl::Status Copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind,
                    size_t bytes, int device) override {
    if (bytes == 0) return absl::OkStatus();
    const std::string what =
        absl::StrCat("device ", device, ": copy of ", bytes, " bytes ", MemoryKindName(src_kind),
                     " -> ", MemoryKindName(dst_kind));
    ScopedCudaDevice scoped(device);
    FS_RETURN_IF_ERROR(scoped.status());
    FS_ASSIGN_OR_RETURN(cudaStream_t stream, StreamFor(device));
    cudaEvent_t done = nullptr;
    FS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
                            absl::StrCat(what, ": cudaEventCreateWithFlags"));
    absl::Status s = CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream),
                                absl::StrCat(what, ": cudaMemcpyAsync"));
    if (s.ok()) s = CudaStatus(cudaEventRecord(done, stream), absl::StrCat(what, ": record"));
    if (s.ok()) s = WaitFor(done, what);
    if (!s.ok()) cudaGetLastError();
    // Destroying an event whose work is pending is allowed: CUDA releases it afterwards.
    cudaEventDestroy(done);
    return s;
  }

 private:
  absl::StatusOr<cudaStream_t> StreamFor(int device) {
    {
      absl::MutexLock lock(&mu_);
      auto it = streams_.find(device);
      if (it != streams_.end()) return it->second;
    }
    cudaStream_t stream = nullptr;
    FS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                            absl::StrCat("device ", device, ": cudaStreamCreateWithFlags"));
    cudaStream_t lost = nullptr;
    cudaStream_t kept = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto [it, inserted] = streams_.emplace(device, stream);
      if (!inserted) lost = stream;
      kept = it->second;
    }
    if (lost != nullptr) cudaStreamDestroy(lost);
    return kept;
  }

  // Polls `event` until done or the deadline (gpu::PollUntilDone's latency policy).
  absl::Status WaitFor(cudaEvent_t event, const std::string& what) {
    return PollUntilDone(
        [&]() -> absl::StatusOr<bool> {
          const cudaError_t err = cudaEventQuery(event);
          if (err == cudaSuccess) return true;
          if (err == cudaErrorNotReady) return false;
          return CudaStatus(err, what);
        },
        timeout_, what);
  }

  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<int, cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::shared_ptr<DeviceCopier> MakeCudaDeviceCopier(absl::Duration copy_timeout) {
  return std::make_shared<CudaDeviceCopier>(copy_timeout);
}

#else  // !FS_HAVE_CUDA

namespace {
class NoCudaDeviceCopier final : public DeviceCopier {
 public:
  absl::StatusOr<std::shared_ptr<void>> AllocateStaging(MemoryKind kind, int device,
                                                        size_t bytes) override {
    return absl::FailedPreconditionError(absl::StrCat("staging buffer of ", bytes, " bytes (",
                                                      MemoryKindName(kind), ", device ", device,
                                                      "): built without CUDA"));
  }
  absl::Status Copy(void*, MemoryKind dst_kind, const void*, MemoryKind src_kind, size_t bytes,
                    int device) override {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", device, ": copy of ", bytes, " bytes ", MemoryKindName(src_kind),
                     " -> ", MemoryKindName(dst_kind), ": built without CUDA"));
  }
};
}  // namespace

std::shared_ptr<DeviceCopier> MakeCudaDeviceCopier(absl::Duration) {
  return std::make_shared<NoCudaDeviceCopier>();
}

#endif  // FS_HAVE_CUDA

std::shared_ptr<DeviceCopier> MakeCudaDeviceCopier() {
  return MakeCudaDeviceCopier(absl::Minutes(2));
}

}  // namespace flatshard::collective
