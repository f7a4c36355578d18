#pragma once
// The 64-bit UCX wire tag of a flatshard message, and the group hash it starts with.
//
//   bits 63..48  16  hash(group_id, epoch)     which group incarnation
//   bits 47..38  10  src rank                  world_size <= 1024
//   bits 37..28  10  dst rank
//   bit  27       1  control: a same-host copy's ack (same_host_copy.h), else 0
//   bits 26..12  15  op_seq mod 2^15           which collective
//   bits 11..0   12  sub: 0xFFF for the ring's fingerprint (sub >= 0x80000000),
//                    else sub mod 0xFFF (data step or broadcast chunk)
//
// Folding op_seq and sub is safe because UCX matches messages with equal tags from one sender
// in the order they were sent, and the ring algorithms send and receive every (src, dst,
// sub) stream in the same increasing order: the only requirement is that fewer than 2^15 ops
// of one group are in flight at once. Pure functions; thread-safe.

#include <cstdint>

#include "absl/strings/string_view.h"
#include "server/collective/transport.h"

namespace flatshard::collective::ucx {

inline constexpr int kMaxWorldSize = 1024;
inline constexpr uint64_t kGroupMask = uint64_t{0xFFFF} << 48;
inline constexpr uint64_t kFullMask = ~uint64_t{0};

// Stable across processes and builds (FNV-1a; absl::Hash is seeded per process).
inline uint16_t GroupTagHash(absl::string_view group_id, uint64_t epoch) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint8_t byte) {
    h ^= byte;
    h *= 0x100000001b3ull;
  };
  for (char c : group_id) mix(static_cast<uint8_t>(c));
  mix(0);  // terminates the id, so its bytes and the epoch's cannot trade places
  for (int i = 0; i < 8; ++i) mix(static_cast<uint8_t>(epoch >> (8 * i)));
  return static_cast<uint16_t>(h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48));
}

inline uint64_t WireSub(uint32_t sub) { return (sub & 0x80000000u) != 0 ? 0xFFFu : sub % 0xFFFu; }

// REQUIRES: 0 <= src, dst < kMaxWorldSize.
inline uint64_t MakeTag(uint16_t group_hash, int src, int dst, MessageTag tag,
                        bool control = false) {
  return uint64_t{group_hash} << 48 | static_cast<uint64_t>(src) << 38 |
         static_cast<uint64_t>(dst) << 28 | uint64_t{control} << 27 | (tag.op_seq & 0x7FFFu) << 12 |
         WireSub(tag.sub);
}

}  // namespace flatshard::collective::ucx
