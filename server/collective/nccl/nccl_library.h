#pragma once
// NCCL (libnccl.so.2), loaded with dlopen on first use rather than linked, so one daemon build
// runs on hosts without NCCL: GPU groups then stage device memory through host memory
// (server/collective/staging/), and --gpu_collectives=nccl refuses to start with this library's
// error. nccl_backend.cc keeps calling ncclAllGather & co. as declared by <nccl.h>: this
// library defines those entry points itself (hidden visibility, never exported, never
// interposing on another NCCL in the process), each forwarding to the loaded libnccl.
//
// The search (common/dynamic_library.h): $FLATSHARD_NCCL_LIBRARY (a file path), then
// libnccl.so.2 through the dynamic loader, then /usr/local/cuda/lib64 and
// /usr/local/cuda/targets/<arch>-linux/lib. Where it is missing, every forwarded call returns
// ncclSystemError and ncclGetLastError() says why.
//
// Thread safety: thread-safe; the library is loaded once, by the first call of any thread.

#include "absl/status/status.h"

namespace flatshard::collective {

// The environment variable that names libnccl's file explicitly.
inline constexpr char kNcclLibraryEnv[] = "FLATSHARD_NCCL_LIBRARY";

// OK once libnccl is loaded with every entry point flatshard calls (loads it on the first
// call). FAILED_PRECONDITION otherwise, naming the library and every place tried with the
// loader's reason.
absl::Status NcclAvailable();

}  // namespace flatshard::collective
