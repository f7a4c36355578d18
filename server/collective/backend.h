#pragma once
// Data-plane interfaces: a CollectiveBackend (one per kind of interconnect: inproc, ucx, nccl)
// connects groups and hands out Communicators; a Communicator runs one group's collectives.
//
// Semantics shared by every implementation (DESIGN.md "Collective order and failure"):
// - One Communicator serves every rank of its group that lives in this daemon. Each op names
//   the rank it is issued for (`OpOptions::rank`); each of the group's `world_size` ranks issues
//   the same sequence of collectives, and the Nth one carries the same `op_seq` on every rank.
// - Every op carries a descriptor (kind, unit, bytes, dtype, reduce op, root). Ranks that
//   issue different descriptors at the same op_seq all fail with ABORTED "collective mismatch
//   at op_seq N: rank a called X but rank b called Y" instead of hanging.
// - Every op has a deadline (`OpOptions::deadline`). When it passes before all ranks arrived,
//   the op fails with DEADLINE_EXCEEDED naming the ranks that did not arrive.
// - Errors are sticky: the first error (mismatch, deadline, bad argument, peer failure, Abort)
//   fails every pending and every later op of the Communicator with that same status.
// - `done` runs exactly once, never under a lock held by the backend. It may run on the
//   calling thread before the call returns (e.g. on the last rank to arrive, which performs
//   the data movement), on another rank's calling thread, or on a backend thread.
// - Buffers must stay valid and untouched until `done` has run.
//
// Thread safety: CollectiveBackend and Communicator implementations are thread-safe; ops of
// different ranks are normally issued from different threads concurrently. Ops of one rank
// must be issued in increasing op_seq order (CollectiveEngine guarantees this).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/rpc_types.h"
#include "server/collective/buffer.h"

namespace flatshard::collective {

// Called exactly once with the op's outcome.
using DoneCallback = absl::AnyInvocable<void(absl::Status)>;

// kAllReduce exists only above the Communicator: CollectiveGroup runs it as a ReduceScatter then
// an AllGather over the group's Communicator (the bandwidth-optimal ring all-reduce on every
// backend), so no Communicator is ever called with it (ValidateCall refuses it) and it never
// goes on the wire.
enum class CollectiveKind : uint8_t { kAllGather, kReduceScatter, kBroadcast, kGather, kAllReduce };
// "AllGather", "ReduceScatter", "Broadcast", "Gather", "AllReduce".
absl::string_view CollectiveKindName(CollectiveKind kind);

// Reductions over floating-point dtypes (float32, float16, bfloat16, float64). kAvg is the sum
// divided by world_size. Half types accumulate in float32 and round once (to nearest even).
// The RPC-level op (common/rpc_types.h): what ReduceScatterGrads asks for is what runs.
using ReduceOp = ::flatshard::ReduceOp;
// "sum", "avg".
absl::string_view ReduceOpName(ReduceOp op);

// Per-op options. Identical on every rank except `rank` and `deadline`.
struct OpOptions {
  // The group member this call is made for. REQUIRES: one of GroupSpec::local_ranks.
  int rank = 0;
  // Per-group sequence number; the Nth collective of every rank carries the same op_seq.
  uint64_t op_seq = 0;
  // When waiting for the other ranks stops (DEADLINE_EXCEEDED). InfiniteFuture: never.
  absl::Time deadline = absl::InfiniteFuture();
  // The unit whose bytes move, for fingerprints and messages; -1 when none.
  int64_t unit = -1;
  // Free text for logs and the pending-op snapshot (e.g. "unshard", "grads"). Not compared.
  std::string name;
};

// One group as a backend sees it.
struct GroupSpec {
  std::string group_id;
  int world_size = 1;
  // The global ranks this daemon hosts, ascending. The inproc backend needs all of them.
  std::vector<int> local_ranks;
  // Multi-daemon groups: for every rank, the address (CollectiveBackend::LocalAddress) of the
  // backend in the daemon that hosts it; empty when every rank is local.
  std::vector<std::string> rank_addresses;
  // The group's rendezvous epoch: a group re-formed under the same id gets a new epoch, and
  // messages of different epochs never match.
  uint64_t epoch = 0;
  // GPU groups: the CUDA device ordinal of each local rank, in the order of `local_ranks`;
  // empty for host-memory groups. Two local ranks may share a device only on backends that
  // stage device memory through the host (NCCL refuses that).
  std::vector<int> local_devices;
  // NCCL groups: the ncclUniqueId (NCCL_UNIQUE_ID_BYTES bytes) rank 0's daemon made for this
  // epoch and the rendezvous handed to every daemon; empty for a group whose every rank is
  // local (the backend then makes one itself).
  std::string nccl_unique_id;

  // A spec whose every rank 0..world_size-1 is local.
  static GroupSpec AllLocal(std::string group_id, int world_size);
};

// A pending op, for `flatshardctl pending`: which ranks arrived, which are missing.
struct PendingOpInfo {
  uint64_t op_seq = 0;
  CollectiveKind kind = CollectiveKind::kAllGather;
  int64_t unit = -1;
  size_t bytes = 0;                // the descriptor's bytes (see Communicator)
  std::string name;                // OpOptions::name of the first rank that arrived
  std::vector<int> arrived_ranks;  // ascending
  std::vector<int> missing_ranks;  // ascending; as far as this daemon knows
  absl::Duration age;              // since the first rank arrived
  bool running = false;            // all ranks arrived; data is moving
};

// One group's collectives over one backend. See the file comment for the shared contract.
//
// Buffer shapes, with S = the per-rank shard in bytes and W = world_size:
// - AllGather:     in = S bytes; out = W*S bytes; out[r*S, (r+1)*S) = rank r's in. `in` may be
//                  exactly the rank's own slot of `out` (in place). Several local ranks may pass
//                  the same `out` (one assembled copy per node); each shard is copied once.
//                  Descriptor bytes: S.
// - ReduceScatter: in = W*S bytes; out = S bytes; out = reduce over ranks of in[r*S, (r+1)*S)
//                  for this rank r. dtype must be floating point; bytes a multiple of its size.
//                  `out` may be exactly in + r*S. Descriptor bytes: S.
// - Broadcast:     buf = B bytes on every rank; afterwards every buf holds root's bytes.
//                  Several local ranks may pass the same buffer. Descriptor bytes: B.
// - Gather:        in = S bytes; on `root` out = W*S bytes laid out as for AllGather; on other
//                  ranks `out` is ignored and may be empty (they allocate nothing).
//                  Descriptor bytes: S.
// Zero-byte ops are valid and still synchronise, check fingerprints and consume an op_seq.
//
// Errors passed to `done`: INVALID_ARGUMENT (bad rank, sizes, dtype, overlapping buffers,
// op_seq not increasing), ABORTED (mismatch, Abort), DEADLINE_EXCEEDED, UNAVAILABLE (peer
// down), and whatever a sticky error was. All but a bad `rank` are sticky.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& options,
                         DoneCallback done) = 0;
  virtual void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op,
                             const OpOptions& options, DoneCallback done) = 0;
  virtual void Broadcast(MutableBuffer buf, int root, const OpOptions& options,
                         DoneCallback done) = 0;
  virtual void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& options,
                      DoneCallback done) = 0;

  // Sticky: fails every pending op (those still waiting for ranks or data) and every later op
  // with `reason` (an OK reason becomes ABORTED "aborted"). The first error wins: after an
  // earlier error, Abort changes nothing. Ops whose data is already being copied locally
  // complete normally. Idempotent; may be called from a callback.
  virtual void Abort(absl::Status reason) = 0;

  // OK, or the sticky error.
  virtual absl::Status status() const = 0;

  // Snapshot of the ops that have not completed, ascending by op_seq.
  virtual std::vector<PendingOpInfo> PendingOps() const = 0;

  // The data plane that moves this communicator's bytes, set by the backend that created it
  // (the metrics' `backend` label, so it is never inferred from a GroupSpec): "inproc", "ucx",
  // "nccl"; a ring over another Transport says so (RingOptions::backend_name); a staging
  // communicator over a host backend appends "+staging" ("ucx+staging": device memory staged
  // through the host) and over NCCL keeps "nccl" (device memory moves natively).
  // "unknown" only for an implementation that does not say (test fakes).
  virtual absl::string_view backend_name() const { return "unknown"; }
};

// A data-plane backend. Implementations: inproc/, ucx/ (later), nccl/ (later). Thread-safe.
class CollectiveBackend {
 public:
  virtual ~CollectiveBackend() = default;

  // "inproc", "ucx", "nccl".
  virtual absl::string_view Name() const = 0;
  // Libraries, devices and permissions needed at run time are present.
  virtual bool IsViable() const = 0;
  // Whether ops on buffers of `kind` are possible.
  virtual bool Supports(MemoryKind kind) const = 0;
  // What peers need to reach this backend (the UCX worker address), published at rendezvous
  // as GroupSpec::rank_addresses; empty for backends without remote peers.
  virtual std::string LocalAddress() const { return ""; }
  // Settings every daemon of a multi-daemon group must share for their ops to match, as
  // "key=value" words (UCX: "hierarchical=on"), published at rendezvous; "" for none.
  virtual std::string GroupSettings() const { return ""; }
  // A Communicator for `group`'s local ranks. INVALID_ARGUMENT for a malformed spec,
  // FAILED_PRECONDITION when this backend cannot host the group (e.g. inproc with remote ranks).
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& group) = 0;
};

}  // namespace flatshard::collective
