#include "common/gpu/cuda_runtime_library.h"

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"

#if FS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/dynamic_library.h"
#endif

namespace flatshard::gpu {

#if FS_HAVE_CUDA

// Every libcudart function flatshard (tests included) calls: X(return type, name, parameters,
// arguments). A name that <cuda_runtime_api.h> maps to a versioned symbol by macro is resolved
// under that symbol. The two that return strings are handled on their own below.
#define FS_CUDART_FUNCTIONS(X)                                                                  \
  X(cudaGetLastError, (), ())                                                                   \
  X(cudaGetDeviceCount, (int* count), (count))                                                  \
  X(cudaGetDeviceProperties, (cudaDeviceProp * prop, int device), (prop, device))               \
  X(cudaDeviceGetPCIBusId, (char* bus, int len, int device), (bus, len, device))                \
  X(cudaGetDevice, (int* device), (device))                                                     \
  X(cudaSetDevice, (int device), (device))                                                      \
  X(cudaDeviceSynchronize, (), ())                                                              \
  X(cudaMalloc, (void** ptr, size_t size), (ptr, size))                                         \
  X(cudaFree, (void* ptr), (ptr))                                                               \
  X(cudaMallocHost, (void** ptr, size_t size), (ptr, size))                                     \
  X(cudaHostAlloc, (void** ptr, size_t size, unsigned flags), (ptr, size, flags))               \
  X(cudaFreeHost, (void* ptr), (ptr))                                                           \
  X(cudaHostRegister, (void* ptr, size_t size, unsigned flags), (ptr, size, flags))             \
  X(cudaHostUnregister, (void* ptr), (ptr))                                                     \
  X(cudaPointerGetAttributes, (cudaPointerAttributes * attributes, const void* ptr),            \
    (attributes, ptr))                                                                          \
  X(cudaMemcpy, (void* dst, const void* src, size_t count, cudaMemcpyKind kind),                \
    (dst, src, count, kind))                                                                    \
  X(cudaMemcpyAsync,                                                                            \
    (void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream),       \
    (dst, src, count, kind, stream))                                                            \
  X(cudaMemset, (void* ptr, int value, size_t count), (ptr, value, count))                      \
  X(cudaMemsetAsync, (void* ptr, int value, size_t count, cudaStream_t stream),                 \
    (ptr, value, count, stream))                                                                \
  X(cudaStreamCreateWithFlags, (cudaStream_t * stream, unsigned flags), (stream, flags))        \
  X(cudaStreamDestroy, (cudaStream_t stream), (stream))                                         \
  X(cudaStreamQuery, (cudaStream_t stream), (stream))                                           \
  X(cudaStreamSynchronize, (cudaStream_t stream), (stream))                                     \
  X(cudaStreamWaitEvent, (cudaStream_t stream, cudaEvent_t event, unsigned flags),              \
    (stream, event, flags))                                                                     \
  X(cudaLaunchHostFunc, (cudaStream_t stream, cudaHostFn_t fn, void* data), (stream, fn, data)) \
  X(cudaEventCreateWithFlags, (cudaEvent_t * event, unsigned flags), (event, flags))            \
  X(cudaEventDestroy, (cudaEvent_t event), (event))                                             \
  X(cudaEventRecord, (cudaEvent_t event, cudaStream_t stream), (event, stream))                 \
  X(cudaEventQuery, (cudaEvent_t event), (event))                                               \
  X(cudaIpcGetMemHandle, (cudaIpcMemHandle_t * handle, void* ptr), (handle, ptr))               \
  X(cudaIpcOpenMemHandle, (void** ptr, cudaIpcMemHandle_t handle, unsigned flags),              \
    (ptr, handle, flags))                                                                       \
  X(cudaIpcCloseMemHandle, (void* ptr), (ptr))                                                  \
  X(cudaIpcGetEventHandle, (cudaIpcEventHandle_t * handle, cudaEvent_t event), (handle, event)) \
  X(cudaIpcOpenEventHandle, (cudaEvent_t * event, cudaIpcEventHandle_t handle), (event, handle))

#define FS_CUDART_STR_(x) #x
#define FS_CUDART_STR(x) FS_CUDART_STR_(x)  // expands a versioning macro first

namespace {

// The loaded library and its entry points; immutable once loaded.
struct CudaRuntime {
#define FS_CUDART_POINTER(name, params, args) decltype(&::name) name = nullptr;
  FS_CUDART_FUNCTIONS(FS_CUDART_POINTER)
#undef FS_CUDART_POINTER
  decltype(&::cudaGetErrorName) cudaGetErrorName = nullptr;
  decltype(&::cudaGetErrorString) cudaGetErrorString = nullptr;
  std::unique_ptr<DynamicLibrary> library;
};

absl::StatusOr<CudaRuntime> Load() {
  const DynamicLibrarySpec spec{
      .name = "the CUDA runtime",
      .soname = absl::StrCat("libcudart.so.", CUDART_VERSION / 1000),
      .env_var = kCudaLibraryEnv,
      .fallback_dirs = CudaToolkitLibraryDirs(),
  };
  absl::StatusOr<std::unique_ptr<DynamicLibrary>> library = DynamicLibrary::Open(spec);
  if (!library.ok()) return library.status();
  CudaRuntime rt;
#define FS_CUDART_RESOLVE(name, params, args) \
  if (absl::Status s = (*library)->Resolve(FS_CUDART_STR(name), &rt.name); !s.ok()) return s;
  FS_CUDART_FUNCTIONS(FS_CUDART_RESOLVE)
  FS_CUDART_RESOLVE(cudaGetErrorName, , )
  FS_CUDART_RESOLVE(cudaGetErrorString, , )
#undef FS_CUDART_RESOLVE
  rt.library = *std::move(library);
  return rt;
}

// Loaded by the first caller; never unloaded (CUDA work may still run in exit handlers).
const absl::StatusOr<CudaRuntime>& Runtime() {
  static const auto* const runtime = new absl::StatusOr<CudaRuntime>(Load());
  return *runtime;
}

}  // namespace

absl::Status CudaRuntimeAvailable() { return Runtime().status(); }

std::string CudaRuntimePath() { return Runtime().ok() ? Runtime()->library->path() : ""; }

}  // namespace flatshard::gpu

// The forwarding definitions of the CUDA runtime's entry points (see the header).
#define FS_CUDART_FORWARD(name, params, args)                                \
  extern "C" __attribute__((visibility("hidden"))) cudaError_t name params { \
    const auto& rt = ::flatshard::gpu::Runtime();                            \
    if (!rt.ok()) return cudaErrorSharedObjectInitFailed;                    \
    return rt->name args;                                                    \
  }
FS_CUDART_FUNCTIONS(FS_CUDART_FORWARD)
#undef FS_CUDART_FORWARD

extern "C" __attribute__((visibility("hidden"))) const char* cudaGetErrorName(cudaError_t error) {
  const auto& rt = ::flatshard::gpu::Runtime();
  return rt.ok() ? rt->cudaGetErrorName(error) : "cudaErrorSharedObjectInitFailed";
}

extern "C" __attribute__((visibility("hidden"))) const char* cudaGetErrorString(cudaError_t error) {
  const auto& rt = ::flatshard::gpu::Runtime();
  return rt.ok() ? rt->cudaGetErrorString(error) : "libcudart could not be loaded";
}

#else  // !FS_HAVE_CUDA

absl::Status CudaRuntimeAvailable() {
  return absl::FailedPreconditionError(
      "this flatshard was built without CUDA (FLATSHARD_WITH_CUDA)");
}

std::string CudaRuntimePath() { return ""; }

}  // namespace flatshard::gpu

#endif  // FS_HAVE_CUDA
