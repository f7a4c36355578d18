#pragma once
// The inproc backend: every rank of a group lives in this daemon, and collectives move bytes
// with memcpy (and reduce on the host). No Transport is involved: each rank's call for op_seq
// N leaves its buffers in a slot; when the last of the world_size ranks arrives with a
// matching descriptor, that caller performs the whole op directly between the ranks' buffers
// (large ops are split across a few helper threads), then every rank's callback runs once.
//
// Copies per byte: AllGather copies each shard once into each *distinct* output buffer, so
// when the local ranks share one output (one assembled copy per node) every byte of it is
// written exactly once, and a shard already in place (in == own slot of out) is not copied
// at all. Broadcast copies root's buffer once into each distinct other buffer; Gather writes
// root's output once; ReduceScatter reads every input once and writes every output once.
//
// Errors follow the Communicator contract (backend.h), with these messages:
// - mismatch: ABORTED "collective mismatch at op_seq N: rank a called AllGather(unit 3, 4096
//   bytes, float32) but rank b called ReduceScatter(unit 3, ...)" on every rank, sticky;
// - deadline: DEADLINE_EXCEEDED "op_seq N AllGather(unit 3, ...): ranks 1, 3 did not arrive
//   within 5s" for the ranks that arrived, sticky (later arrivals get the same status);
// - buffers of different ranks that partially overlap: INVALID_ARGUMENT, sticky.
//
// Thread safety: the backend and its Communicators are thread-safe. Callbacks never run under
// the communicator's lock, so a callback may issue the next op or Abort.

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "server/collective/backend.h"

namespace flatshard::collective {

struct InprocBackendOptions {
  // Helper threads (per backend) that split large copies and reductions with the rank that
  // completes an op. -1: one less than the hardware threads, at most 7; 0: none.
  int copy_threads = -1;
  // Ops that move fewer bytes than this run on the completing thread alone.
  size_t parallel_min_bytes = size_t{8} << 20;
  // Size of the pieces a large op is split into.
  size_t piece_bytes = size_t{1} << 20;
};

// Never fails today; StatusOr for symmetry with backends that probe hardware.
absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateInprocBackend(
    const InprocBackendOptions& options = {});

}  // namespace flatshard::collective
