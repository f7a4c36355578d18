#include "common/gpu/cuda_util.h"

#include <sys/prctl.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/gpu/cuda_runtime_library.h"

#if FS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flatshard::gpu {

#if FS_HAVE_CUDA

absl::Status CudaStatus(int err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Without libcudart every call fails alike; say why instead of an error code.
  if (absl::Status loaded = CudaRuntimeAvailable(); !loaded.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", loaded.message()));
  }
  const auto e = static_cast<cudaError_t>(err);
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNotSupported:
      return absl::FailedPreconditionError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorMapBufferObjectFailed:
      return absl::InvalidArgumentError(message);
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalAddress:
    case cudaErrorHardwareStackError:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

namespace {
std::string UuidString(const cudaUUID_t& u) {
  const auto* b = reinterpret_cast<const unsigned char*>(u.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}
}  // namespace

absl::StatusOr<std::vector<GpuDevice>> ListGpus() {
  if (absl::Status loaded = CudaRuntimeAvailable(); !loaded.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("no usable GPU: ", loaded.message()));
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("no usable GPU: ", CudaStatus(err, "cudaGetDeviceCount").message()));
  }
  if (count == 0) return absl::FailedPreconditionError("no usable GPU: the driver reports none");
  std::vector<GpuDevice> gpus;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    FS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, d),
                            absl::StrCat("cudaGetDeviceProperties(", d, ")"));
    GpuDevice g;
    g.ordinal = d;
    g.uuid = UuidString(prop.uuid);
    g.name = prop.name;
    g.total_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), d) == cudaSuccess) g.pci_bus_id = bus;
    gpus.push_back(std::move(g));
  }
  return gpus;
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) {
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
}

ScopedCudaDevice::~ScopedCudaDevice() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    cudaSetDevice(previous_);
  }
}

#else  // !FS_HAVE_CUDA

absl::Status CudaStatus(int err, absl::string_view what) {
  if (err == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", err));
}

absl::StatusOr<std::vector<GpuDevice>> ListGpus() {
  return absl::FailedPreconditionError(
      absl::StrCat("no usable GPU: ", CudaRuntimeAvailable().message()));
}

ScopedCudaDevice::ScopedCudaDevice(int /*device*/)
    : status_(absl::FailedPreconditionError("built without CUDA")) {}
ScopedCudaDevice::~ScopedCudaDevice() = default;

#endif  // FS_HAVE_CUDA

absl::Status PollUntilDone(absl::FunctionRef<absl::StatusOr<bool>()> probe, absl::Duration timeout,
                           absl::string_view what) {
  constexpr absl::Duration kSpin = absl::Microseconds(200);
  constexpr absl::Duration kMinNap = absl::Microseconds(10);
  constexpr absl::Duration kMaxNap = absl::Milliseconds(1);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (;;) {
    absl::StatusOr<bool> done = probe();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": not done within ", absl::FormatDuration(timeout)));
    }
    const absl::Duration waited = now - start;
    if (waited > kSpin) {
      // Linux delays a sleeping thread's wakeup by its timer slack (50 us by default), which
      // would dominate these naps; once per thread, ask for 1 us.
      static thread_local const bool slack_set = ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
      (void)slack_set;
      absl::SleepFor(std::min({std::max(waited / 16, kMinNap), kMaxNap, deadline - now}));
    }
  }
}

absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) {
  absl::StatusOr<std::vector<GpuDevice>> gpus = ListGpus();
  if (!gpus.ok()) return gpus.status();
  for (const GpuDevice& g : *gpus) {
    if (g.uuid == uuid) return g.ordinal;
  }
  return absl::NotFoundError(absl::StrCat("GPU ", uuid, " is not visible to this process (",
                                          gpus->size(),
                                          " GPU(s) visible; check "
                                          "CUDA_VISIBLE_DEVICES)"));
}

}  // namespace flatshard::gpu
