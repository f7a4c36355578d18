#include "server/collective/hierarchical_algorithms.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "common/bulk_copy.h"
#include "common/logging.h"
#include "server/collective/reduce.h"

namespace flatshard::collective {
namespace {

// Sub-tags of the intra-node step: apart from the column ring's (below kPipelineSubLimit) and
// the fingerprint (0x80000000). Block m of the step travels as kIntraSub | m.
constexpr uint32_t kIntraSub = kPipelineSubLimit;

}  // namespace

std::optional<NodeLayout> HierarchicalLayout(absl::Span<const int> node_of_rank) {
  NodeLayout l;
  std::map<int, int> number;  // node id -> node number, by lowest rank
  for (size_t r = 0; r < node_of_rank.size(); ++r) {
    auto [it, added] = number.try_emplace(node_of_rank[r], static_cast<int>(l.ranks.size()));
    if (added) l.ranks.emplace_back();
    l.node_of.push_back(it->second);
    l.index_of.push_back(static_cast<int>(l.ranks[it->second].size()));
    l.ranks[it->second].push_back(static_cast<int>(r));
  }
  l.nodes = static_cast<int>(l.ranks.size());
  if (l.nodes < 2) return std::nullopt;
  l.per_node = static_cast<int>(l.ranks[0].size());
  if (l.per_node < 2) return std::nullopt;
  for (const std::vector<int>& node : l.ranks) {
    if (static_cast<int>(node.size()) != l.per_node) return std::nullopt;
  }
  return l;
}

std::vector<int> NodesOfAddresses(absl::Span<const std::string> rank_addresses) {
  std::map<std::string, int, std::less<>> ids;
  std::vector<int> out;
  out.reserve(rank_addresses.size());
  for (const std::string& a : rank_addresses) {
    out.push_back(ids.try_emplace(a, static_cast<int>(ids.size())).first->second);
  }
  return out;
}

bool RunsHierarchically(const OpDescriptor& desc) {
  return desc.bytes > 0 &&
         (desc.kind == CollectiveKind::kAllGather || desc.kind == CollectiveKind::kReduceScatter);
}

HierarchicalSteps::HierarchicalSteps(const NodeLayout& layout, int rank, const OpCall& call,
                                     ScratchPool& pool, size_t chunk_bytes)
    : layout_(layout),
      rank_(rank),
      node_(layout.node_of[rank]),
      index_(layout.index_of[rank]),
      call_(call),
      pool_(pool),
      chunk_(PipelineChunkBytes(chunk_bytes, call.desc.bytes, layout.nodes)),
      chunks_(static_cast<int>((call.desc.bytes + chunk_ - 1) / chunk_)),
      slots_(std::min(layout.nodes, chunks_)),
      slot_bytes_(static_cast<size_t>(layout.nodes) * layout.per_node * chunk_) {}

uint32_t HierarchicalSteps::RingSub(int c, int p) const {
  return static_cast<uint32_t>(c) * static_cast<uint32_t>(layout_.nodes) + static_cast<uint32_t>(p);
}

uint32_t HierarchicalSteps::IntraSub(int c, int m) const { return kIntraSub | RingSub(c, m); }

bool HierarchicalSteps::Build(int s, std::vector<Xfer>* xfers) {
  const bool ag = call_.desc.kind == CollectiveKind::kAllGather;
  if (s == 0) {
    if (ag && call_.in.begin() != OutBlock(rank_)) {
      BulkCopy(OutBlock(rank_), call_.in.begin(), call_.desc.bytes,
               BulkShouldStream(call_.desc.bytes));
    }
    if (!ag) scratch_ = pool_.Acquire(static_cast<size_t>(slots_) * slot_bytes_);
  }
  if (FirstChunk(s) > LastChunk(s)) return false;
  for (int c = FirstChunk(s); c <= LastChunk(s); ++c) {
    if (ag) {
      BuildAllGather(c, s - c, xfers);
    } else {
      BuildReduceScatter(c, s - c, xfers);
    }
  }
  return true;
}

void HierarchicalSteps::BuildAllGather(int c, int p, std::vector<Xfer>* xfers) {
  const int n = layout_.nodes;
  const size_t off = ChunkOffset(c), len = ChunkLen(c);
  if (p < n - 1) {  // the column ring across nodes, straight in `out`
    const int next = layout_.Rank(Mod(node_ + 1, n), index_);
    const int prev = layout_.Rank(Mod(node_ - 1, n), index_);
    xfers->push_back(SendXfer(next, RingSub(c, p),
                              OutBlock(layout_.Rank(Mod(node_ - p, n), index_)) + off, len));
    xfers->push_back(RecvXfer(prev, RingSub(c, p),
                              OutBlock(layout_.Rank(Mod(node_ - p - 1, n), index_)) + off, len));
    return;
  }
  // The node's other ranks get this column's chunks (no copy where they share `out`).
  for (int j = 0; j < layout_.per_node; ++j) {
    if (j == index_) continue;
    const int peer = layout_.Rank(node_, j);
    for (int m = 0; m < n; ++m) {
      xfers->push_back(
          SendXfer(peer, IntraSub(c, m), OutBlock(layout_.Rank(m, index_)) + off, len));
      xfers->push_back(RecvXfer(peer, IntraSub(c, m), OutBlock(layout_.Rank(m, j)) + off, len));
    }
  }
}

void HierarchicalSteps::BuildReduceScatter(int c, int p, std::vector<Xfer>* xfers) {
  const int n = layout_.nodes;
  const size_t off = ChunkOffset(c), len = ChunkLen(c);
  if (p == 0) {
    // Every other local rank gets its column's chunks of this rank's input.
    for (int j = 0; j < layout_.per_node; ++j) {
      if (j == index_) continue;
      const int peer = layout_.Rank(node_, j);
      const int k = j < index_ ? j : j - 1;
      for (int m = 0; m < n; ++m) {
        xfers->push_back(SendXfer(peer, IntraSub(c, m), InBlock(layout_.Rank(m, j)) + off, len));
        xfers->push_back(RecvXfer(peer, IntraSub(c, m), Received(c, k, m), len));
      }
    }
    return;
  }
  const int t = p - 1;  // column ring step, as the flat ring over the N node partials
  const int next = layout_.Rank(Mod(node_ + 1, n), index_);
  const int prev = layout_.Rank(Mod(node_ - 1, n), index_);
  xfers->push_back(
      SendXfer(next, RingSub(c, t), t == 0 ? Partial(c, Mod(node_ - 1, n)) : RingSend(c), len));
  xfers->push_back(RecvXfer(prev, RingSub(c, t), RingRecv(c), len));
}

void HierarchicalSteps::After(int s) {
  if (call_.desc.kind != CollectiveKind::kReduceScatter) return;
  for (int c = FirstChunk(s); c <= LastChunk(s); ++c) AfterReduceScatter(c, s - c);
  if (s == chunks_ + layout_.nodes - 2) {
    scratch_ = ScratchPool::Scratch();  // back to the pool for the next op
  }
}

void HierarchicalSteps::AfterReduceScatter(int c, int p) {
  const OpDescriptor& d = call_.desc;
  const size_t off = ChunkOffset(c);
  const size_t count = ChunkLen(c) / ItemSize(d.dtype);
  const int n = layout_.nodes;
  if (p == 0) {
    // Node partials of this column, summed over the node's ranks by local index.
    std::vector<const void*> srcs(layout_.per_node);
    for (int m = 0; m < n; ++m) {
      for (int j = 0; j < layout_.per_node; ++j) {
        srcs[j] = j == index_ ? static_cast<const void*>(InBlock(layout_.Rank(m, index_)) + off)
                              : Received(c, j < index_ ? j : j - 1, m);
      }
      ReduceInto(d.dtype, srcs, Partial(c, m), count, ReduceOp::kSum, 1);
    }
    return;
  }
  const int t = p - 1;
  const int block = Mod(node_ - t - 2, n);
  const void* srcs[2] = {RingRecv(c), Partial(c, block)};
  if (t < n - 2) {
    ReduceInto(d.dtype, srcs, RingSend(c), count, ReduceOp::kSum, 1);
  } else {
    ReduceInto(d.dtype, srcs, call_.out.begin() + off, count, d.reduce_op,
               static_cast<int>(layout_.node_of.size()));
  }
}

}  // namespace flatshard::collective
