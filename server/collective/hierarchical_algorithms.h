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
// - AllGather: N-1 ring steps within each column across nodes (each rank sends S per step
//   straight from and into `out`; a node sends L*S per step), then one step in which every
//   rank copies its column's N blocks to the node's other ranks (a shared `out` needs no copy).
// - ReduceScatter: one step in which every rank sends each other local rank that rank's
//   column's N blocks of its input; every rank then sums its column's blocks over the node
//   (node partial, local index ascending, half types round once), then N-1 ring steps within
//   the column across nodes as the flat ring does (partials travel in the buffer's dtype).
//   The order of the sum for rank R(m, i)'s block: the node partials of nodes m+1, m+2, ...,
//   m-1 (mod N), then node m's, each node partial summed over its ranks by local index. It
//   differs from the flat ring's (ranks r+1, r+2, ..., r): results are equal to the element
//   where the sums are exact (integers, as in the conformance tests), otherwise they may
//   differ in the last bits. Scratch: W*S bytes per rank, from the ScratchPool.
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
// per rank.
//
// Thread safety: a HierarchicalSteps belongs to one op of one rank; its steps run one at a
// time (the ring's RankOp drives them).

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
  HierarchicalSteps(const NodeLayout& layout, int rank, const OpCall& call, ScratchPool& pool);

  // Fills the transfers of algorithm step `s` (0, 1, ... in order) and does the local work
  // that precedes them; false when the op has no step `s`.
  bool Build(int s, std::vector<Xfer>* xfers);
  // The local work after every transfer of step `s` succeeded.
  void After(int s);

 private:
  uint8_t* OutBlock(int r) const { return call_.out.begin() + r * call_.desc.bytes; }
  const uint8_t* InBlock(int r) const { return call_.in.begin() + r * call_.desc.bytes; }
  // ReduceScatter scratch: the node partials P[m] (by node), then the blocks received from
  // the other local ranks G[k][m]; the column ring's send and receive blocks reuse G.
  uint8_t* Partial(int m) const { return scratch_.data() + m * call_.desc.bytes; }
  uint8_t* Received(int k, int m) const {
    return scratch_.data() + (layout_.nodes * (k + 1) + m) * call_.desc.bytes;
  }
  uint8_t* RingSend() const { return Received(0, 0); }
  uint8_t* RingRecv() const { return Received(0, 1); }
  bool BuildAllGather(int s, std::vector<Xfer>* xfers);
  bool BuildReduceScatter(int s, std::vector<Xfer>* xfers);

  const NodeLayout& layout_;
  const int rank_;
  const int node_;
  const int index_;
  const OpCall call_;
  ScratchPool& pool_;
  ScratchPool::Scratch scratch_;
};

}  // namespace flatshard::collective
