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

// WeightsReader::Connect with `opener` instead of CUDA IPC (device versions of a daemon with
// simulated GPUs). Same errors.
struct WeightsReaderAccess {
  static absl::StatusOr<std::unique_ptr<WeightsReader>> Connect(
      ClientOptions options, std::unique_ptr<DeviceMemoryOpener> opener);
};

}  // namespace flatshard::client::internal
