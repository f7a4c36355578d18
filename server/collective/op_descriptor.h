#pragma once
// What every collective carries so that ranks can check they run the same op: the descriptor
// (kind, unit, bytes, dtype, reduce op, root), its one-line spelling for error messages, its
// fixed-size wire form for backends that exchange it, and the argument checks and error
// statuses every Communicator shares (so inproc, ring and later backends word them alike).
// Thread-safe: pure functions and value types.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "server/collective/backend.h"
#include "server/collective/buffer.h"

namespace flatshard::collective {

// The fingerprint of one rank's call. Fields a kind does not use hold their defaults, so two
// descriptors describe the same op exactly when they compare equal.
struct OpDescriptor {
  CollectiveKind kind = CollectiveKind::kAllGather;
  int64_t unit = -1;
  uint64_t bytes = 0;  // see Communicator: the per-rank shard, or the broadcast buffer
  DType dtype = DType::kUInt8;
  ReduceOp reduce_op = ReduceOp::kSum;  // ReduceScatter only
  int root = 0;                         // Broadcast and Gather only

  friend bool operator==(const OpDescriptor&, const OpDescriptor&) = default;
};

// One rank's call: its descriptor and buffers. Broadcast uses `out` for its buffer and sets
// `in` to the same memory.
struct OpCall {
  OpDescriptor desc;
  ConstBuffer in;
  MutableBuffer out;
};

OpCall AllGatherCall(ConstBuffer in, MutableBuffer out, int64_t unit);
OpCall ReduceScatterCall(ConstBuffer in, MutableBuffer out, ReduceOp op, int64_t unit);
OpCall BroadcastCall(MutableBuffer buf, int root, int64_t unit);
OpCall GatherCall(ConstBuffer in, MutableBuffer out, int root, int64_t unit);

// "AllGather(unit 3, 4096 bytes, float32)", "ReduceScatter(unit 3, 4096 bytes, bfloat16, avg)",
// "Broadcast(unit 3, 64 bytes, uint8, root 2)", "Gather(8 bytes, float32, root 0)" (no unit).
std::string FormatOp(const OpDescriptor& desc);
// "rank 1" or "ranks 1, 3".
std::string FormatRanks(absl::Span<const int> ranks);

// INVALID_ARGUMENT when `rank` is outside [0, world_size) or not in `local_ranks`.
absl::Status CheckRank(int rank, const GroupSpec& group);
// INVALID_ARGUMENT when the spec is malformed: world_size < 1, local ranks out of range,
// unsorted or duplicated.
absl::Status CheckGroupSpec(const GroupSpec& group);

// Checks one rank's call on its own: null data with bytes, sizes (out = in * world_size ...),
// dtypes (ReduceScatter: floating point; bytes a multiple of the item size), root range,
// memory kinds (`host_only`: CUDA buffers are refused). INVALID_ARGUMENT naming rank, op_seq
// and op.
absl::Status ValidateCall(const OpCall& call, int rank, int world_size, uint64_t op_seq,
                          bool host_only);

// ABORTED "collective mismatch at op_seq N: rank A called X but rank B called Y".
absl::Status MismatchError(uint64_t op_seq, int rank_a, const OpDescriptor& a, int rank_b,
                           const OpDescriptor& b);
// DEADLINE_EXCEEDED "op_seq N AllGather(unit 3, ...): ranks 1, 3 did not arrive within 5s".
// The PendingOpInfo of op `op_seq` described by `desc` (kind, unit, bytes) and named `name`;
// age, running and the ranks are the backend's to fill.
PendingOpInfo PendingOpOf(uint64_t op_seq, const OpDescriptor& desc, std::string name);

// INVALID_ARGUMENT "rank R issued op_seq N <op> after op_seq L": ops of a rank must be issued
// in increasing op_seq order.
absl::Status OpSeqOrderError(int rank, uint64_t op_seq, const OpDescriptor& desc,
                             uint64_t last_op_seq);

absl::Status MissingRanksError(uint64_t op_seq, const OpDescriptor& desc,
                               absl::Span<const int> missing, absl::Duration waited);

// Fixed-size, trivially copyable form of (op_seq, descriptor) for backends that exchange
// fingerprints in messages. Little-endian hosts only (every target today).
struct WireDescriptor {
  uint64_t op_seq = 0;
  uint64_t bytes = 0;
  int64_t unit = -1;
  int32_t root = 0;
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t reduce_op = 0;
  uint8_t valid = 0;  // 1 once filled in; a zeroed receive buffer reads as "not arrived"
};
static_assert(sizeof(WireDescriptor) == 32);

WireDescriptor EncodeDescriptor(uint64_t op_seq, const OpDescriptor& desc);
// nullopt when the message is not a valid descriptor (unknown enum values, not filled in).
std::optional<OpDescriptor> DecodeDescriptor(const WireDescriptor& wire);

}  // namespace flatshard::collective
