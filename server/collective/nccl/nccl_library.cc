#include "server/collective/nccl/nccl_library.h"

#include <nccl.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/dynamic_library.h"

// Every libnccl function flatshard calls, as X(name, parameters, arguments); the two that
// return strings are handled on their own below.
#define FS_NCCL_FUNCTIONS(X)                                                                     \
  X(ncclGetUniqueId, (ncclUniqueId * id), (id))                                                  \
  X(ncclCommInitRankConfig,                                                                      \
    (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config),            \
    (comm, nranks, id, rank, config))                                                            \
  X(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t * error), (comm, error))               \
  X(ncclCommFinalize, (ncclComm_t comm), (comm))                                                 \
  X(ncclCommDestroy, (ncclComm_t comm), (comm))                                                  \
  X(ncclCommAbort, (ncclComm_t comm), (comm))                                                    \
  X(ncclGroupStart, (), ())                                                                      \
  X(ncclGroupEnd, (), ())                                                                        \
  X(ncclAllGather,                                                                               \
    (const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,           \
     cudaStream_t stream),                                                                       \
    (send, recv, count, type, comm, stream))                                                     \
  X(ncclReduceScatter,                                                                           \
    (const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,            \
     ncclComm_t comm, cudaStream_t stream),                                                      \
    (send, recv, count, type, op, comm, stream))                                                 \
  X(ncclBroadcast,                                                                               \
    (const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm, \
     cudaStream_t stream),                                                                       \
    (send, recv, count, type, root, comm, stream))                                               \
  X(ncclSend,                                                                                    \
    (const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,             \
     cudaStream_t stream),                                                                       \
    (send, count, type, peer, comm, stream))                                                     \
  X(ncclRecv,                                                                                    \
    (void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,                   \
     cudaStream_t stream),                                                                       \
    (recv, count, type, peer, comm, stream))

namespace flatshard::collective {
namespace {

// The loaded library and its entry points; immutable once loaded.
struct Nccl {
#define FS_NCCL_POINTER(name, params, args) decltype(&::name) name = nullptr;
  FS_NCCL_FUNCTIONS(FS_NCCL_POINTER)
#undef FS_NCCL_POINTER
  decltype(&::ncclGetErrorString) ncclGetErrorString = nullptr;
  decltype(&::ncclGetLastError) ncclGetLastError = nullptr;
  std::unique_ptr<DynamicLibrary> library;
};

absl::StatusOr<Nccl> Load() {
  const DynamicLibrarySpec spec{
      .name = "NCCL",
      .soname = absl::StrCat("libnccl.so.", NCCL_MAJOR),
      .env_var = kNcclLibraryEnv,
      .fallback_dirs = CudaToolkitLibraryDirs(),
  };
  absl::StatusOr<std::unique_ptr<DynamicLibrary>> library = DynamicLibrary::Open(spec);
  if (!library.ok()) return library.status();
  Nccl nccl;
#define FS_NCCL_RESOLVE(name, params, args) \
  if (absl::Status s = (*library)->Resolve(#name, &nccl.name); !s.ok()) return s;
  FS_NCCL_FUNCTIONS(FS_NCCL_RESOLVE)
  FS_NCCL_RESOLVE(ncclGetErrorString, , )
  FS_NCCL_RESOLVE(ncclGetLastError, , )
#undef FS_NCCL_RESOLVE
  nccl.library = *std::move(library);
  return nccl;
}

// Loaded by the first caller; never unloaded (communicators may be aborted at exit).
const absl::StatusOr<Nccl>& Library() {
  static const auto* const nccl = new absl::StatusOr<Nccl>(Load());
  return *nccl;
}

}  // namespace

absl::Status NcclAvailable() { return Library().status(); }

}  // namespace flatshard::collective

// The forwarding definitions of NCCL's entry points (see the header).
#define FS_NCCL_FORWARD(name, params, args)                                   \
  extern "C" __attribute__((visibility("hidden"))) ncclResult_t name params { \
    const auto& nccl = ::flatshard::collective::Library();                    \
    if (!nccl.ok()) return ncclSystemError;                                   \
    return nccl->name args;                                                   \
  }
FS_NCCL_FUNCTIONS(FS_NCCL_FORWARD)
#undef FS_NCCL_FORWARD

extern "C" __attribute__((visibility("hidden"))) const char* ncclGetErrorString(
    ncclResult_t result) {
  const auto& nccl = ::flatshard::collective::Library();
  return nccl.ok() ? nccl->ncclGetErrorString(result) : "libnccl could not be loaded";
}

extern "C" __attribute__((visibility("hidden"))) const char* ncclGetLastError(ncclComm_t comm) {
  const auto& nccl = ::flatshard::collective::Library();
  if (nccl.ok()) return nccl->ncclGetLastError(comm);
  static const std::string* const why = new std::string(nccl.status().message());
  return why->c_str();
}
