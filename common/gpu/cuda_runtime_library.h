#pragma once
// The CUDA runtime (libcudart), loaded with dlopen on first use rather than linked, so one build
// of the daemon, CLI, client library and Python module runs on hosts without CUDA (README "GPU
// nodes"). Code keeps calling cudaMalloc & co. as declared by <cuda_runtime_api.h>: this
// library defines those entry points itself (hidden visibility: never exported from our .so
// files, never interposing on a libcudart that torch loads), each forwarding to the loaded
// libcudart.
//
// The search (common/dynamic_library.h): $FLATSHARD_CUDA_LIBRARY (a file path), then
// libcudart.so.<major> (the major version of the headers this build used) through the dynamic
// loader, then /usr/local/cuda/lib64 and /usr/local/cuda/targets/<arch>-linux/lib.
// Where it is missing, every forwarded call returns cudaErrorSharedObjectInitFailed, and
// gpu::CudaStatus() turns that into this library's FAILED_PRECONDITION.
//
// Thread safety: thread-safe; the library is loaded once, by the first call of any thread.

#include <string>

#include "absl/status/status.h"

namespace flatshard::gpu {

// The environment variable that names libcudart's file explicitly.
inline constexpr char kCudaLibraryEnv[] = "FLATSHARD_CUDA_LIBRARY";

// OK once libcudart is loaded with every entry point flatshard calls (loads it on the first
// call). FAILED_PRECONDITION otherwise, naming the library and every place tried with the
// loader's reason, or saying the build has no CUDA support.
absl::Status CudaRuntimeAvailable();

// The file libcudart was loaded from (as given to dlopen); empty when it is not loaded.
std::string CudaRuntimePath();

}  // namespace flatshard::gpu
