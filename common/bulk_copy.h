#pragma once
// BulkCopy: memcpy for the daemon's large copies (shards, unsharded units, committed copies),
// whose stores bypass the caches (non-temporal) once the transfer they belong to is large.
//
// Why: those copies are split into chunks of a few MiB (ParallelCopier, the in-process
// all-gather's pieces, a deferred commit copy), and glibc's memcpy streams only copies larger
// than about 3/4 of the last-level cache, so every chunk was copied with ordinary stores,
// which first read each destination line (read-for-ownership): three memory transfers per
// byte instead of two. On the 2-core CI VM a 4 MiB-chunked copy ran at 8.4 GB/s on one
// thread (memcpy of the whole 256 MiB: 15 GB/s) and 12.4 GB/s streamed; 13.6 and 19.1 GB/s
// on two threads (issue 24: a writeback End is a copy of the unit). A transfer larger than
// the caches gains nothing from leaving its destination in them.

#include <cstddef>

namespace flatshard {

// Transfers of at least this many bytes in all stream their stores: about a server's
// last-level cache, beyond which the destination cannot stay cached for its reader (the
// trainer reads a summoned unit, the optimizer its shards, right after). Below it a copy
// stays as before, so that a mid-sized unit still reaches its reader through the cache.
inline constexpr size_t kBulkStreamMinBytes = size_t{32} << 20;

// Copies `bytes` from `src` to `dst` (which must not overlap), as memcpy. With `stream` the
// stores are non-temporal where the CPU has them (x86-64; elsewhere memcpy), and are ordered
// before anything the caller does after the return (a store fence).
void BulkCopy(void* dst, const void* src, size_t bytes, bool stream);

// Whether a transfer of `total_bytes` in all should stream (kBulkStreamMinBytes).
inline bool BulkShouldStream(size_t total_bytes) { return total_bytes >= kBulkStreamMinBytes; }

}  // namespace flatshard
