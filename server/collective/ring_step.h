#pragma once
// One transfer of a step of the algorithms over Transport (ring_algorithms.cc,
// ring_reduce_scatter.cc and hierarchical_algorithms.cc): a step posts its transfers, waits
// for all of them, then does its local work. Also what their pipelines share: the chunk size.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "server/collective/buffer.h"

namespace flatshard::collective {

struct Xfer {
  bool send = false;
  int peer = 0;
  uint32_t sub = 0;
  ConstBuffer src;    // send
  MutableBuffer dst;  // recv
  bool fingerprint = false;
};

inline Xfer SendXfer(int peer, uint32_t sub, const uint8_t* src, size_t bytes) {
  Xfer x;
  x.send = true;
  x.peer = peer;
  x.sub = sub;
  x.src = ConstBuffer{src, bytes};
  return x;
}

inline Xfer RecvXfer(int peer, uint32_t sub, uint8_t* dst, size_t bytes) {
  Xfer x;
  x.peer = peer;
  x.sub = sub;
  x.dst = MutableBuffer{dst, bytes};
  return x;
}

// a mod n in [0, n), for ring positions.
inline int Mod(int a, int n) { return ((a % n) + n) % n; }

// The pipelines' sub-tags stay below this (the hierarchical intra-node tags and the
// fingerprint's lie above).
constexpr uint32_t kPipelineSubLimit = 0x40000000u;

// The pipeline chunk for shard bytes `shard_bytes` of `requested` bytes: a multiple of 8 (so
// of every item size: chunks never split an element), at least 8, at most the shard, and large
// enough that chunks * `subs_per_chunk` stays below kPipelineSubLimit.
inline size_t PipelineChunkBytes(size_t requested, size_t shard_bytes, int subs_per_chunk) {
  const size_t fit = shard_bytes / (kPipelineSubLimit / static_cast<size_t>(subs_per_chunk)) + 1;
  size_t chunk = std::max(std::max<size_t>(requested, fit), size_t{8});
  chunk = (chunk + 7) / 8 * 8;
  return std::max<size_t>(std::min(chunk, shard_bytes), 1);
}

}  // namespace flatshard::collective
