#pragma once
// Hierarchical AllGather and ReduceScatter for groups whose daemons (nodes) host several ranks
// each: the intra-node part by memory copy, the inter-node part once per node's bytes, so each
// shard crosses the network once per receiving node instead of travelling around a ring of
// every rank. The ring communicator (ring_algorithms.h) runs them in place of its flat ring
// when RingOptions::node_of_rank describes a usable layout (HierarchicalLayout): fingerprints,
// deadlines, sticky errors and transport failures are the ring's.
//
// Notation: N nodes, L ranks on each (every node the same L >= 2, N >= 2), R(m, i) the i-th
// rank (ascending) of node m, S the shard bytes. The ranks with local index i form "column" i:
// R(0, i), ..., R(N-1, i).
// Pipelining: both split every block into chunks of RingOptions::pipeline_chunk_bytes
// (C chunks) and run one chunk's phases behind the previous chunk's, so the intra-node copies
// and reductions of one chunk overlap the inter-node transfer of the next: algorithm step s
// runs phase s - c of every chunk c in flight, C + N - 1 steps in all (1 chunk: the unpipelined
// algorithm). Every step still waits for all its transfers before its local work.
// - AllGather: phases 0..N-2 are the ring within each column across nodes (each rank sends its
//   chunk straight from and into `out`; a node sends L chunks per step), phase N-1 copies the
//   chunk of the column's N blocks to the node's other ranks (a shared `out` needs no copy).
// - ReduceScatter: phase 0 sends each other local rank the chunk of that rank's column's N
//   blocks of this rank's input, then sums the column's chunks over the node (node partial,
//   local index ascending, half types round once); phases 1..N-1 are the ring within the
//   column across nodes as the flat ring does (partials travel in the buffer's dtype).
//   The order of the sum for rank R(m, i)'s block: the node partials of nodes m+1, m+2, ...,
//   m-1 (mod N), then node m's, each node partial summed over its ranks by local index. It
//   differs from the flat ring's (ranks r+1, r+2, ..., r): results are equal to the element
//   where the sums are exact (integers, as in the conformance tests), otherwise they may
//   differ in the last bits; chunking does not change it. Scratch from the ScratchPool:
//   min(N, C) slots (the chunks in flight) of W chunks each per rank: W*S bytes for one
//   chunk, N*W chunks once S is large.
// - AllReduce (NO_SHARD and HYBRID_* gradients): CollectiveGroup runs it as a ReduceScatter
//   then an AllGather of the reduced block (collective_engine.h), so both halves run here:
//   the local ranks' buffers summed by node (local index ascending), the N node partials
//   reduce-scattered and all-gathered around the ring of nodes (one column per local rank),
//   the result copied to every local rank. Its sum order is the ReduceScatter's above, and
//   every rank gets the block owner's bits. No separate all-reduce algorithm: that one would
//   move the same inter-node bytes.
// Inter-node bytes sent per node and op: (N-1)*L*S, against (N*L-1)*S on the flat ring of
// contiguously placed ranks and more when ranks are interleaved; an all-reduce of B = W*S
// bytes sends 2*(N-1)/N*B per node (each node's partial once), the flat ring up to 2*(W-1)/W*B
// per rank. So where both run at the link's rate, the flat ring of contiguous ranks takes
// (N*L-1)/((N-1)*L) times as long (1.5 for 2 x 2, 7/6 for 4 x 2), no more.
//
// Thread safety: a HierarchicalSteps belongs to one op of one rank; its steps run one at a
// time (the ring's RankOp drives them).

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "server/collective/op_descriptor.h"
#include "server/collective/ring_step.h"
#include "server/collective/scratch_pool.h"

namespace flatshard::collective {

// Which node hosts each rank, as the hierarchical algorithms use it.
struct NodeLayout {
  int nodes = 0;
  int per_node = 0;
  std::vector<int> node_of;             // by rank
  std::vector<int> index_of;            // by rank: its position on its node
  std::vector<std::vector<int>> ranks;  // by node: its ranks, ascending

  int Rank(int node, int index) const { return ranks[node][index]; }
};

// The layout of `node_of_rank` (any distinct values name the nodes; nodes are numbered in the
// order of their lowest rank), or nullopt when the hierarchical algorithms do not apply: fewer
// than 2 nodes, a node with a single rank, or nodes with different numbers of ranks (the flat
// ring runs those groups).
std::optional<NodeLayout> HierarchicalLayout(absl::Span<const int> node_of_rank);

// Node ids from GroupSpec::rank_addresses: ranks with equal addresses share a node.
std::vector<int> NodesOfAddresses(absl::Span<const std::string> rank_addresses);

// Whether the hierarchical algorithms run `desc` (AllGather and ReduceScatter of > 0 bytes).
bool RunsHierarchically(const OpDescriptor& desc);

// One rank's part of one hierarchical op. REQUIRES: RunsHierarchically(call.desc), `layout`
// outlives it, the call passed ValidateCall.
class HierarchicalSteps {
 public:
  // `chunk_bytes`: the pipeline's chunk (PipelineChunkBytes, ring_step.h); the same on every
  // rank of the group (message tags depend on it).
  HierarchicalSteps(const NodeLayout& layout, int rank, const OpCall& call, ScratchPool& pool,
                    size_t chunk_bytes = kDefaultChunkBytes);
  static constexpr size_t kDefaultChunkBytes = size_t{4} << 20;

  // Fills the transfers of algorithm step `s` (0, 1, ... in order) and does the local work
  // that precedes them; false when the op has no step `s`.
  bool Build(int s, std::vector<Xfer>* xfers);
  // The local work after every transfer of step `s` succeeded.
  void After(int s);

 private:
  uint8_t* OutBlock(int r) const { return call_.out.begin() + r * call_.desc.bytes; }
  const uint8_t* InBlock(int r) const { return call_.in.begin() + r * call_.desc.bytes; }
  size_t ChunkOffset(int c) const { return static_cast<size_t>(c) * chunk_; }
  size_t ChunkLen(int c) const { return std::min(chunk_, call_.desc.bytes - ChunkOffset(c)); }
  // The chunks in phase `s - c` at step s: [first, last], empty when first > last.
  int FirstChunk(int s) const { return std::max(0, s - (layout_.nodes - 1)); }
  int LastChunk(int s) const { return std::min(chunks_ - 1, s); }
  // Sub-tag of chunk c's ring phase p or intra-node block m: unique within the op.
  uint32_t RingSub(int c, int p) const;
  uint32_t IntraSub(int c, int m) const;
  // ReduceScatter scratch of chunk c (its slot): the node partials P[m] (by node), then the
  // chunks received from the other local ranks G[k][m]; the column ring's send and receive
  // chunks reuse G (phase 0's local work is done with it by then).
  uint8_t* Slot(int c) const { return scratch_.data() + (c % slots_) * slot_bytes_; }
  uint8_t* Partial(int c, int m) const { return Slot(c) + m * chunk_; }
  uint8_t* Received(int c, int k, int m) const {
    return Slot(c) + (layout_.nodes * (k + 1) + m) * chunk_;
  }
  uint8_t* RingSend(int c) const { return Received(c, 0, 0); }
  uint8_t* RingRecv(int c) const { return Received(c, 0, 1); }
  void BuildAllGather(int c, int p, std::vector<Xfer>* xfers);
  void BuildReduceScatter(int c, int p, std::vector<Xfer>* xfers);
  void AfterReduceScatter(int c, int p);

  const NodeLayout& layout_;
  const int rank_;
  const int node_;
  const int index_;
  const OpCall call_;
  ScratchPool& pool_;
  const size_t chunk_;  // bytes, min(chunk_bytes, S)
  const int chunks_;
  const int slots_;
  const size_t slot_bytes_;
  ScratchPool::Scratch scratch_;
};

}  // namespace flatshard::collective
