#pragma once
// The collective algorithms, written once over Transport (as in gloo): any Transport becomes
// a Communicator. The UCX backend will use this for ranks in different daemons; tests run it
// over InprocTransport.
//
// Every op of a group with world_size > 1 proceeds in two phases:
// 1. Fingerprint exchange (RingOptions::check_fingerprints): each rank sends its 32-byte
//    descriptor (op_seq, kind, unit, bytes, dtype, reduce op, root) to every other rank. Every
//    rank then compares all descriptors with rank 0's, so all ranks reach the same verdict:
//    ABORTED "collective mismatch at op_seq N: rank 0 called X but rank k called Y". A rank
//    whose deadline passes in this phase knows exactly who has not arrived:
//    DEADLINE_EXCEEDED "op_seq N X: ranks 1, 3 did not arrive within 5s".
// 2. Data, with S the shard bytes and W the world size:
//    - AllGather: ring, W-1 steps; step s sends block (r-s) to r+1 and receives block
//      (r-s-1) from r-1, straight into `out` (no staging).
//    - ReduceScatter: ring, W-1 ring steps; partial sums travel in the buffer's dtype (half
//      types round at every step), the last adds the own block, divides for kAvg and writes
//      `out`. Pipelined in RingOptions::pipeline_chunk_bytes chunks on two lanes, so one
//      chunk moves while the other's reduction runs and each link has two messages in
//      flight; sum order and results as unchunked, scratch a few chunks
//      (ring_reduce_scatter.h).
//    - Broadcast: a pipelined chain root -> root+1 -> ... in RingOptions::chunk_bytes pieces.
//    - Gather: direct; every rank sends its shard to root.
//    With RingOptions::node_of_rank naming several nodes of equally many (>= 2) ranks,
//    AllGather and ReduceScatter run hierarchically instead (hierarchical_algorithms.h: the
//    intra-node part by copies, each node's bytes over the network once; its sum order).
//    Reduce-scatter scratch comes from a ScratchPool (scratch_pool.h), reused across ops.
// Each step waits for its sends and receives before the next starts (for the flat
// reduce-scatter: the next step of its lane); any failure aborts the communicator (sticky)
// and with it the Transport. A reduce-scatter step's local work (its reduction, then posting
// the next step) runs on a thread of the communicator's own, not on the thread that completed
// the transfer: a transport's progress thread (UCX) keeps moving the other ranks' and chunks'
// bytes meanwhile.
//
// Thread safety: the returned Communicator is thread-safe and follows the contract in
// backend.h. Callbacks run on whatever thread completes the last transfer of an op (for
// InprocTransport, another rank's calling thread).

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/collective/backend.h"
#include "server/collective/deadline_timer.h"
#include "server/collective/scratch_pool.h"
#include "server/collective/transport.h"

namespace flatshard::collective {

struct RingOptions {
  // Exchange descriptors before moving data (mismatch detection, missing-rank deadlines).
  bool check_fingerprints = true;
  // Refuse CUDA buffers (the transport moves host memory only).
  bool host_memory_only = true;
  // Broadcast pipeline piece.
  size_t chunk_bytes = size_t{1} << 20;
  // Deadline watchdog; null: the communicator starts its own.
  std::shared_ptr<DeadlineTimer> timer;
  // Communicator::backend_name(): the backend whose Transport the ring runs over.
  std::string backend_name = "ring";
  // Which node hosts each rank (any ids; equal ids share a node; NodesOfAddresses makes them
  // from GroupSpec::rank_addresses). Empty, or a layout HierarchicalLayout refuses: the flat
  // ring runs every op. The same on every daemon of the group, or ops never match.
  std::vector<int> node_of_rank;
  // Reused scratch; null: the communicator makes its own (on `timer`).
  std::shared_ptr<ScratchPool> scratch;
  // The reduce-scatter's and the hierarchical algorithms' pipeline chunk
  // (ring_reduce_scatter.h, hierarchical_algorithms.h); the same on every daemon of the group.
  size_t pipeline_chunk_bytes = size_t{4} << 20;
};

// A Communicator for `group`'s local ranks over `transport`, which the communicator aborts
// when it fails and keeps alive while it needs it. INVALID_ARGUMENT for a malformed spec, a
// transport of a different world size or a node_of_rank without one entry per rank.
absl::StatusOr<std::unique_ptr<Communicator>> NewRingCommunicator(
    const GroupSpec& group, std::shared_ptr<Transport> transport, RingOptions options = {});

}  // namespace flatshard::collective
