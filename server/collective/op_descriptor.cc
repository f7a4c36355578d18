#include "server/collective/op_descriptor.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard::collective {
namespace {

// a * b, or nullopt on overflow.
std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

absl::Status Invalid(int rank, uint64_t op_seq, const OpDescriptor& desc, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", rank, " op_seq ", op_seq, " ", FormatOp(desc), ": ", what));
}

bool HasData(const void* data, size_t bytes) { return bytes == 0 || data != nullptr; }

}  // namespace

OpCall AllGatherCall(ConstBuffer in, MutableBuffer out, int64_t unit) {
  OpCall call;
  call.desc.kind = CollectiveKind::kAllGather;
  call.desc.unit = unit;
  call.desc.bytes = in.bytes;
  call.desc.dtype = in.dtype;
  call.in = in;
  call.out = out;
  return call;
}

OpCall ReduceScatterCall(ConstBuffer in, MutableBuffer out, ReduceOp op, int64_t unit) {
  OpCall call;
  call.desc.kind = CollectiveKind::kReduceScatter;
  call.desc.unit = unit;
  call.desc.bytes = out.bytes;
  call.desc.dtype = in.dtype;
  call.desc.reduce_op = op;
  call.in = in;
  call.out = out;
  return call;
}

OpCall BroadcastCall(MutableBuffer buf, int root, int64_t unit) {
  OpCall call;
  call.desc.kind = CollectiveKind::kBroadcast;
  call.desc.unit = unit;
  call.desc.bytes = buf.bytes;
  call.desc.dtype = buf.dtype;
  call.desc.root = root;
  call.in = buf.AsConst();
  call.out = buf;
  return call;
}

OpCall GatherCall(ConstBuffer in, MutableBuffer out, int root, int64_t unit) {
  OpCall call;
  call.desc.kind = CollectiveKind::kGather;
  call.desc.unit = unit;
  call.desc.bytes = in.bytes;
  call.desc.dtype = in.dtype;
  call.desc.root = root;
  call.in = in;
  call.out = out;
  return call;
}

std::string FormatOp(const OpDescriptor& desc) {
  std::string s = absl::StrCat(CollectiveKindName(desc.kind), "(");
  if (desc.unit >= 0) absl::StrAppend(&s, "unit ", desc.unit, ", ");
  absl::StrAppend(&s, desc.bytes, " bytes, ", DTypeName(desc.dtype));
  switch (desc.kind) {
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce:
      absl::StrAppend(&s, ", ", ReduceOpName(desc.reduce_op));
      break;
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kGather:
      absl::StrAppend(&s, ", root ", desc.root);
      break;
    case CollectiveKind::kAllGather:
      break;
  }
  absl::StrAppend(&s, ")");
  return s;
}

std::string FormatRanks(absl::Span<const int> ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

absl::Status CheckRank(int rank, const GroupSpec& group) {
  if (rank < 0 || rank >= group.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " is outside group ", group.group_id, " of world_size ", group.world_size));
  }
  for (int r : group.local_ranks) {
    if (r == rank) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", rank, " of group ", group.group_id, " is not hosted here"));
}

absl::Status CheckGroupSpec(const GroupSpec& group) {
  if (group.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group ", group.group_id, ": world_size must be >= 1, got ", group.world_size));
  }
  for (size_t i = 0; i < group.local_ranks.size(); ++i) {
    int r = group.local_ranks[i];
    if (r < 0 || r >= group.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("group ", group.group_id, ": local rank ", r,
                                                     " outside world_size ", group.world_size));
    }
    if (i > 0 && r <= group.local_ranks[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", group.group_id, ": local ranks must be ascending and unique"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCall(const OpCall& call, int rank, int world_size, uint64_t op_seq,
                          bool host_only) {
  const OpDescriptor& d = call.desc;
  const bool needs_out = d.kind != CollectiveKind::kGather || rank == d.root;
  if (!HasData(call.in.data, call.in.bytes)) return Invalid(rank, op_seq, d, "input is null");
  if (needs_out && !HasData(call.out.data, call.out.bytes)) {
    return Invalid(rank, op_seq, d, "output is null");
  }
  if (host_only &&
      (call.in.kind == MemoryKind::kCuda || (needs_out && call.out.kind == MemoryKind::kCuda))) {
    return Invalid(rank, op_seq, d, "this backend cannot access cuda memory");
  }
  if ((d.kind == CollectiveKind::kBroadcast || d.kind == CollectiveKind::kGather) &&
      (d.root < 0 || d.root >= world_size)) {
    return Invalid(rank, op_seq, d, absl::StrCat("root must be in [0, ", world_size, ")"));
  }
  if (needs_out && call.out.dtype != call.in.dtype) {
    return Invalid(rank, op_seq, d,
                   absl::StrCat("output dtype ", DTypeName(call.out.dtype),
                                " differs from input dtype ", DTypeName(call.in.dtype)));
  }
  switch (d.kind) {
    case CollectiveKind::kAllReduce:
      return Invalid(
          rank, op_seq, d,
          "an all-reduce runs through CollectiveGroup (reduce-scatter, then all-gather)");
    case CollectiveKind::kBroadcast:
      return absl::OkStatus();
    case CollectiveKind::kAllGather:
    case CollectiveKind::kGather: {
      if (!needs_out) return absl::OkStatus();
      std::optional<uint64_t> want = CheckedMul(call.in.bytes, world_size);
      if (!want || call.out.bytes != *want) {
        return Invalid(rank, op_seq, d,
                       absl::StrCat("output has ", call.out.bytes, " bytes, want ", call.in.bytes,
                                    " x ", world_size, " ranks"));
      }
      return absl::OkStatus();
    }
    case CollectiveKind::kReduceScatter: {
      if (!IsFloatingPoint(d.dtype)) {
        return Invalid(rank, op_seq, d, "reductions need float32, float16, bfloat16 or float64");
      }
      std::optional<uint64_t> want = CheckedMul(call.out.bytes, world_size);
      if (!want || call.in.bytes != *want) {
        return Invalid(rank, op_seq, d,
                       absl::StrCat("input has ", call.in.bytes, " bytes, want ", call.out.bytes,
                                    " x ", world_size, " ranks"));
      }
      if (call.out.bytes % ItemSize(d.dtype) != 0) {
        return Invalid(rank, op_seq, d,
                       absl::StrCat("shard bytes are not a multiple of ", ItemSize(d.dtype)));
      }
      return absl::OkStatus();
    }
  }
  return Invalid(rank, op_seq, d, "unknown collective");
}

absl::Status MismatchError(uint64_t op_seq, int rank_a, const OpDescriptor& a, int rank_b,
                           const OpDescriptor& b) {
  if (rank_b < rank_a) return MismatchError(op_seq, rank_b, b, rank_a, a);
  return absl::AbortedError(absl::StrCat("collective mismatch at op_seq ", op_seq, ": rank ",
                                         rank_a, " called ", FormatOp(a), " but rank ", rank_b,
                                         " called ", FormatOp(b)));
}

PendingOpInfo PendingOpOf(uint64_t op_seq, const OpDescriptor& desc, std::string name) {
  PendingOpInfo p;
  p.op_seq = op_seq;
  p.kind = desc.kind;
  p.unit = desc.unit;
  p.bytes = desc.bytes;
  p.name = std::move(name);
  return p;
}

absl::Status OpSeqOrderError(int rank, uint64_t op_seq, const OpDescriptor& desc,
                             uint64_t last_op_seq) {
  return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " issued op_seq ", op_seq, " ",
                                                 FormatOp(desc), " after op_seq ", last_op_seq));
}

absl::Status MissingRanksError(uint64_t op_seq, const OpDescriptor& desc,
                               absl::Span<const int> missing, absl::Duration waited) {
  // Deadlines are computed from the caller's clock reading; round up to milliseconds so a
  // 5 s timeout reads "5s", not "4.999987s".
  absl::Duration shown = absl::Ceil(waited, absl::Milliseconds(1));
  return absl::DeadlineExceededError(absl::StrCat("op_seq ", op_seq, " ", FormatOp(desc), ": ",
                                                  FormatRanks(missing), " did not arrive within ",
                                                  absl::FormatDuration(shown)));
}

WireDescriptor EncodeDescriptor(uint64_t op_seq, const OpDescriptor& desc) {
  WireDescriptor w;
  w.op_seq = op_seq;
  w.bytes = desc.bytes;
  w.unit = desc.unit;
  w.root = desc.root;
  w.kind = static_cast<uint8_t>(desc.kind);
  w.dtype = static_cast<uint8_t>(desc.dtype);
  w.reduce_op = static_cast<uint8_t>(desc.reduce_op);
  w.valid = 1;
  return w;
}

std::optional<OpDescriptor> DecodeDescriptor(const WireDescriptor& w) {
  if (w.valid != 1 || w.kind > static_cast<uint8_t>(CollectiveKind::kGather) ||
      w.dtype > static_cast<uint8_t>(DType::kBool) ||
      w.reduce_op > static_cast<uint8_t>(ReduceOp::kAvg)) {
    return std::nullopt;
  }
  OpDescriptor d;
  d.kind = static_cast<CollectiveKind>(w.kind);
  d.unit = w.unit;
  d.bytes = w.bytes;
  d.dtype = static_cast<DType>(w.dtype);
  d.reduce_op = static_cast<ReduceOp>(w.reduce_op);
  d.root = w.root;
  return d;
}

}  // namespace flatshard::collective
