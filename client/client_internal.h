#pragma once
// Client internals: Client::Connect with test doubles for the GPU APIs, so tests without a
// GPU can check which CUDA calls a session makes (none for host memory).

#include <memory>

#include "absl/status/statusor.h"
#include "client/cuda_events.h"
#include "client/cuda_ipc.h"
#include "flatshard/client.h"

namespace flatshard::client::internal {

// The CUDA-facing parts of a Client; nullptr members: the real ones.
struct GpuApis {
  std::unique_ptr<DeviceMemoryOpener> opener;
  std::unique_ptr<CudaEventApi> events;
};

// Client::Connect, with `apis` instead of the CUDA runtime. Same errors.
absl::StatusOr<std::unique_ptr<Client>> ConnectWithGpuApis(ClientOptions options, GpuApis apis);

}  // namespace flatshard::client::internal
