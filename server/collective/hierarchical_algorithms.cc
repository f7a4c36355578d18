#include "server/collective/hierarchical_algorithms.h"

#include <cstring>
#include <map>
#include <utility>

#include "common/logging.h"
#include "server/collective/reduce.h"

namespace flatshard::collective {
namespace {

// Sub-tags of the intra-node step: apart from the column ring's steps (0..N-2) and the
// fingerprint (0x80000000). Block m of the step travels as kIntraSub | m.
constexpr uint32_t kIntraSub = 0x40000000u;

int Mod(int a, int n) { return ((a % n) + n) % n; }

Xfer Send(int peer, uint32_t sub, const uint8_t* src, size_t bytes) {
  Xfer x;
  x.send = true;
  x.peer = peer;
  x.sub = sub;
  x.src = ConstBuffer{src, bytes};
  return x;
}

Xfer Recv(int peer, uint32_t sub, uint8_t* dst, size_t bytes) {
  Xfer x;
  x.peer = peer;
  x.sub = sub;
  x.dst = MutableBuffer{dst, bytes};
  return x;
}

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
                                     ScratchPool& pool)
    : layout_(layout),
      rank_(rank),
      node_(layout.node_of[rank]),
      index_(layout.index_of[rank]),
      call_(call),
      pool_(pool) {}

bool HierarchicalSteps::Build(int s, std::vector<Xfer>* xfers) {
  return call_.desc.kind == CollectiveKind::kAllGather ? BuildAllGather(s, xfers)
                                                       : BuildReduceScatter(s, xfers);
}

bool HierarchicalSteps::BuildAllGather(int s, std::vector<Xfer>* xfers) {
  const int n = layout_.nodes;
  const size_t bytes = call_.desc.bytes;
  if (s == 0 && call_.in.begin() != OutBlock(rank_)) {
    std::memcpy(OutBlock(rank_), call_.in.begin(), bytes);
  }
  if (s < n - 1) {  // the column ring across nodes, straight in `out`
    const int next = layout_.Rank(Mod(node_ + 1, n), index_);
    const int prev = layout_.Rank(Mod(node_ - 1, n), index_);
    const uint32_t sub = static_cast<uint32_t>(s);
    xfers->push_back(Send(next, sub, OutBlock(layout_.Rank(Mod(node_ - s, n), index_)), bytes));
    xfers->push_back(Recv(prev, sub, OutBlock(layout_.Rank(Mod(node_ - s - 1, n), index_)), bytes));
    return true;
  }
  if (s > n - 1) return false;
  // The node's other ranks get this column's blocks (no copy where they share `out`).
  for (int j = 0; j < layout_.per_node; ++j) {
    if (j == index_) continue;
    const int peer = layout_.Rank(node_, j);
    for (int m = 0; m < n; ++m) {
      const uint32_t sub = kIntraSub | static_cast<uint32_t>(m);
      xfers->push_back(Send(peer, sub, OutBlock(layout_.Rank(m, index_)), bytes));
      xfers->push_back(Recv(peer, sub, OutBlock(layout_.Rank(m, j)), bytes));
    }
  }
  return true;
}

bool HierarchicalSteps::BuildReduceScatter(int s, std::vector<Xfer>* xfers) {
  const int n = layout_.nodes;
  const size_t bytes = call_.desc.bytes;
  if (s == 0) {
    scratch_ = pool_.Acquire(static_cast<size_t>(n) * layout_.per_node * bytes);
    // Every other local rank gets its column's blocks of this rank's input.
    for (int j = 0; j < layout_.per_node; ++j) {
      if (j == index_) continue;
      const int peer = layout_.Rank(node_, j);
      const int k = j < index_ ? j : j - 1;
      for (int m = 0; m < n; ++m) {
        const uint32_t sub = kIntraSub | static_cast<uint32_t>(m);
        xfers->push_back(Send(peer, sub, InBlock(layout_.Rank(m, j)), bytes));
        xfers->push_back(Recv(peer, sub, Received(k, m), bytes));
      }
    }
    return true;
  }
  const int t = s - 1;  // column ring step, as the flat ring over the N node partials
  if (t >= n - 1) return false;
  const int next = layout_.Rank(Mod(node_ + 1, n), index_);
  const int prev = layout_.Rank(Mod(node_ - 1, n), index_);
  const uint32_t sub = static_cast<uint32_t>(t);
  xfers->push_back(Send(next, sub, t == 0 ? Partial(Mod(node_ - 1, n)) : RingSend(), bytes));
  xfers->push_back(Recv(prev, sub, RingRecv(), bytes));
  return true;
}

void HierarchicalSteps::After(int s) {
  if (call_.desc.kind != CollectiveKind::kReduceScatter) return;
  const OpDescriptor& d = call_.desc;
  const size_t count = d.bytes / ItemSize(d.dtype);
  const int n = layout_.nodes;
  if (s == 0) {
    // Node partials of this column, summed over the node's ranks by local index.
    std::vector<const void*> srcs(layout_.per_node);
    for (int m = 0; m < n; ++m) {
      for (int j = 0; j < layout_.per_node; ++j) {
        srcs[j] = j == index_ ? static_cast<const void*>(InBlock(layout_.Rank(m, index_)))
                              : Received(j < index_ ? j : j - 1, m);
      }
      ReduceInto(d.dtype, srcs, Partial(m), count, ReduceOp::kSum, 1);
    }
    return;
  }
  const int t = s - 1;
  const int block = Mod(node_ - t - 2, n);
  const void* srcs[2] = {RingRecv(), Partial(block)};
  if (t < n - 2) {
    ReduceInto(d.dtype, srcs, RingSend(), count, ReduceOp::kSum, 1);
  } else {
    ReduceInto(d.dtype, srcs, call_.out.data, count, d.reduce_op,
               static_cast<int>(layout_.node_of.size()));
    scratch_ = ScratchPool::Scratch();  // back to the pool for the next op
  }
}

}  // namespace flatshard::collective
