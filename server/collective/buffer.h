#pragma once
// Untyped views of memory that collectives read and write: a pointer, a length in bytes, the
// element type (needed by reductions and by the fingerprint every collective carries) and the
// kind of memory (host, pinned host or CUDA device) so a backend can refuse what it cannot reach.
//
// These are non-owning views: whoever hands one to a collective keeps the memory alive and
// untouched until the collective's callback has run. Plain value types; thread-compatible.

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace flatshard::collective {

// Where a buffer lives. kHostPinned is host memory registered/locked for DMA (UCX, CUDA).
enum class MemoryKind : uint8_t { kHost, kHostPinned, kCuda };

// "host", "host_pinned" or "cuda".
absl::string_view MemoryKindName(MemoryKind kind);

// Read-only view. `data` may be null only when `bytes` is 0.
struct ConstBuffer {
  const void* data = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kUInt8;
  MemoryKind kind = MemoryKind::kHost;

  const uint8_t* begin() const { return static_cast<const uint8_t*>(data); }
};

// Writable view. `data` may be null only when `bytes` is 0.
struct MutableBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kUInt8;
  MemoryKind kind = MemoryKind::kHost;

  uint8_t* begin() const { return static_cast<uint8_t*>(data); }
  // A read-only view of the same memory.
  ConstBuffer AsConst() const { return ConstBuffer{data, bytes, dtype, kind}; }
};

}  // namespace flatshard::collective
