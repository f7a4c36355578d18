// Hierarchical AllGather and ReduceScatter (hierarchical_algorithms.h) run by the ring
// communicator over InprocTransport: the conformance suites with ranks on 2-rank nodes
// (contiguous and interleaved; pipelined in small chunks too), the layouts that apply, the
// bytes that cross nodes, and the documented order of float sums.

#include "server/collective/hierarchical_algorithms.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/collective_engine.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/ring_algorithms.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/server/collective/ring_scratch_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {
namespace {

using ::testing::Combine;
using ::testing::ElementsAre;
using ::testing::Range;
using ::testing::Values;
using ::testing::ValuesIn;

std::vector<int> Nodes(int world, int (*node)(int)) {
  std::vector<int> out(world);
  for (int r = 0; r < world; ++r) out[r] = node(r);
  return out;
}

// A pipeline chunk that divides no shard size of the suites (1 element, 4097, 1 MiB), so
// that every op runs many chunks, a short last one among them.
constexpr size_t kSmallChunk = 4000;

absl::StatusOr<std::unique_ptr<Communicator>> Connect(
    const GroupSpec& g, int (*node)(int), size_t chunk = RingOptions{}.pipeline_chunk_bytes) {
  RingOptions o;
  o.node_of_rank = Nodes(g.world_size, node);
  o.pipeline_chunk_bytes = chunk;
  return NewRingCommunicator(g, std::make_shared<InprocTransport>(g.world_size), o);
}

int Pairs(int r) { return r / 2; }       // ranks 0,1 | 2,3 | ...
int TwoNodes(int r) { return r % 2; }    // ranks 0,2,4,... | 1,3,5,...
int ThreeNodes(int r) { return r % 3; }  // ranks 0,3,... | 1,4,... | 2,5,...

const BackendUnderTest kPairs{"HierarchicalPairs",
                              [](const GroupSpec& g) { return Connect(g, &Pairs); }};
const BackendUnderTest kTwoNodes{"HierarchicalTwoNodes",
                                 [](const GroupSpec& g) { return Connect(g, &TwoNodes); }};
const BackendUnderTest kThreeNodes{"HierarchicalThreeNodes",
                                   [](const GroupSpec& g) { return Connect(g, &ThreeNodes); }};
const BackendUnderTest kPairsChunked{
    "HierarchicalPairsChunked", [](const GroupSpec& g) { return Connect(g, &Pairs, kSmallChunk); }};
const BackendUnderTest kThreeNodesChunked{"HierarchicalThreeNodesChunked", [](const GroupSpec& g) {
                                            return Connect(g, &ThreeNodes, kSmallChunk);
                                          }};

INSTANTIATE_TEST_SUITE_P(Pairs, BackendConformanceTest,
                         Combine(Values(&kPairs), Range(1, 9), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(TwoNodes, BackendConformanceTest,
                         Combine(Values(&kTwoNodes), Values(4, 6, 8), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(ThreeNodes, BackendConformanceTest,
                         Combine(Values(&kThreeNodes), Values(6), ValuesIn(AllShardSizes())),
                         ConformanceName);
// Pipelined: chunks of different phases in flight in one step.
INSTANTIATE_TEST_SUITE_P(PairsChunked, BackendConformanceTest,
                         Combine(Values(&kPairsChunked), Values(4, 6), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(ThreeNodesChunked, BackendConformanceTest,
                         Combine(Values(&kThreeNodesChunked), Values(6), ValuesIn(AllShardSizes())),
                         ConformanceName);
// World 4: two nodes of two ranks, so the failure contract is checked on the hierarchical path.
INSTANTIATE_TEST_SUITE_P(Hierarchical, BackendFailureTest,
                         Values(&kPairs, &kTwoNodes, &kPairsChunked), FailureName);

TEST(HierarchicalLayoutTest, NumbersNodesByLowestRankAndIndexesRanksAscending) {
  std::optional<NodeLayout> l = HierarchicalLayout(std::vector<int>{7, 3, 7, 3});
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->nodes, 2);
  EXPECT_EQ(l->per_node, 2);
  EXPECT_THAT(l->node_of, ElementsAre(0, 1, 0, 1));
  EXPECT_THAT(l->index_of, ElementsAre(0, 0, 1, 1));
  EXPECT_THAT(l->ranks[0], ElementsAre(0, 2));
  EXPECT_THAT(l->ranks[1], ElementsAre(1, 3));
  EXPECT_EQ(l->Rank(1, 1), 3);
}

TEST(HierarchicalLayoutTest, TheFlatRingKeepsOneNodeOneRankPerNodeAndUnevenNodes) {
  EXPECT_FALSE(HierarchicalLayout(std::vector<int>{}).has_value());
  EXPECT_FALSE(HierarchicalLayout(std::vector<int>{0, 0, 0, 0}).has_value());     // one node
  EXPECT_FALSE(HierarchicalLayout(std::vector<int>{0, 1, 2, 3}).has_value());     // one rank each
  EXPECT_FALSE(HierarchicalLayout(std::vector<int>{0, 0, 0, 1, 1}).has_value());  // 3 + 2
  EXPECT_TRUE(HierarchicalLayout(std::vector<int>{0, 0, 1, 1, 2, 2}).has_value());
}

TEST(HierarchicalLayoutTest, NodesOfAddressesGroupsEqualAddresses) {
  EXPECT_THAT(NodesOfAddresses(std::vector<std::string>{"b", "a", "b", "a"}),
              ElementsAre(0, 1, 0, 1));
  EXPECT_THAT(NodesOfAddresses(std::vector<std::string>{}), ElementsAre());
}

TEST(HierarchicalLayoutTest, NodeOfRankOfAnotherWorldSizeIsRefused) {
  RingOptions o;
  o.node_of_rank = {0, 0, 1};
  EXPECT_TRUE(absl::IsInvalidArgument(
      NewRingCommunicator(GroupSpec::AllLocal("g", 4), std::make_shared<InprocTransport>(4), o)
          .status()));
}

// InprocTransport that counts the bytes each node sends to other nodes.
class CountingTransport final : public Transport {
 public:
  explicit CountingTransport(std::vector<int> node_of)
      : node_of_(std::move(node_of)),
        inner_(static_cast<int>(node_of_.size())),
        sent_(node_of_.size(), 0) {}
  int world_size() const override { return inner_.world_size(); }
  void Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) override {
    if (node_of_[src] != node_of_[dst]) {
      absl::MutexLock lock(&mu_);
      sent_[node_of_[src]] += data.bytes;
    }
    inner_.Send(src, dst, tag, data, std::move(done));
  }
  void Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) override {
    inner_.Recv(dst, src, tag, data, std::move(done));
  }
  void Abort(absl::Status reason) override { inner_.Abort(std::move(reason)); }
  size_t SentBy(int node) {
    absl::MutexLock lock(&mu_);
    return sent_[node];
  }

 private:
  const std::vector<int> node_of_;
  InprocTransport inner_;
  absl::Mutex mu_;
  std::vector<size_t> sent_;
};

// One AllGather then one ReduceScatter on every rank; returns each node's inter-node bytes.
std::vector<size_t> InterNodeBytes(const std::vector<int>& node_of, bool hierarchical,
                                   size_t shard_floats) {
  const int world = static_cast<int>(node_of.size());
  auto transport = std::make_shared<CountingTransport>(node_of);
  RingOptions o;
  if (hierarchical) o.node_of_rank = node_of;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", world), transport, o).value();
  std::vector<std::vector<float>> shard(world, std::vector<float>(shard_floats, 1.0f));
  std::vector<std::vector<float>> full(world, std::vector<float>(shard_floats * world, 1.0f));
  const size_t s = shard_floats * 4;
  RunRanks(world, [&](int r) {
    DoneRecorder gathered, reduced;
    comm->AllGather(ConstBuffer{shard[r].data(), s, DType::kFloat32},
                    MutableBuffer{full[r].data(), s * world, DType::kFloat32}, Opts(r, 1),
                    gathered.Callback());
    EXPECT_TRUE(gathered.Wait().ok()) << gathered.status();
    comm->ReduceScatter(ConstBuffer{full[r].data(), s * world, DType::kFloat32},
                        MutableBuffer{shard[r].data(), s, DType::kFloat32}, ReduceOp::kSum,
                        Opts(r, 2), reduced.Callback());
    EXPECT_TRUE(reduced.Wait().ok()) << reduced.status();
  });
  std::vector<size_t> out;
  for (int n = 0; n <= *std::max_element(node_of.begin(), node_of.end()); ++n) {
    out.push_back(transport->SentBy(n));
  }
  return out;
}

TEST(HierarchicalTrafficTest, EachNodeSendsItsBytesOncePerOtherNode) {
  constexpr size_t kShard = 1000;  // floats
  constexpr size_t kFingerprints = 32;
  // 2 nodes x 2 ranks, contiguous: the flat ring sends 3 shards per node and op, hierarchical 2
  // (each of the node's 2 shards once); fingerprints (32 bytes to every remote rank) aside.
  const std::vector<int> pairs = {0, 0, 1, 1};
  const size_t fp = 2 * 2 * 2 * kFingerprints;  // 2 ops x 2 local ranks x 2 remote ranks
  EXPECT_THAT(InterNodeBytes(pairs, true, kShard),
              ElementsAre(2 * 2 * kShard * 4 + fp, 2 * 2 * kShard * 4 + fp));
  EXPECT_THAT(InterNodeBytes(pairs, false, kShard),
              ElementsAre(2 * 3 * kShard * 4 + fp, 2 * 3 * kShard * 4 + fp));
  // Interleaved (rank r on node r % 2): every flat ring hop crosses nodes (2 ranks x 3 shards).
  const std::vector<int> interleaved = {0, 1, 0, 1};
  EXPECT_THAT(InterNodeBytes(interleaved, true, kShard),
              ElementsAre(2 * 2 * kShard * 4 + fp, 2 * 2 * kShard * 4 + fp));
  EXPECT_THAT(InterNodeBytes(interleaved, false, kShard),
              ElementsAre(2 * 6 * kShard * 4 + fp, 2 * 6 * kShard * 4 + fp));
}

// CollectiveGroup's all-reduce (a ReduceScatter then an AllGather over the communicator) of
// `floats` elements, every rank's element k = (rank + 1) * (k % 7 + 1): each node's
// inter-node bytes; every rank's result checked to the element (the sums are exact).
std::vector<size_t> AllReduceInterNodeBytes(const std::vector<int>& node_of, bool hierarchical,
                                            size_t floats) {
  const int world = static_cast<int>(node_of.size());
  auto transport = std::make_shared<CountingTransport>(node_of);
  RingOptions o;
  if (hierarchical) o.node_of_rank = node_of;
  const GroupSpec spec = GroupSpec::AllLocal("g", world);
  CollectiveEngine engine;
  std::shared_ptr<CollectiveGroup> group =
      engine.AddGroup(spec, NewRingCommunicator(spec, transport, o).value()).value();
  std::vector<std::vector<float>> buf(world, std::vector<float>(floats));
  for (int r = 0; r < world; ++r) {
    for (size_t k = 0; k < floats; ++k) buf[r][k] = static_cast<float>((r + 1) * (k % 7 + 1));
  }
  RunRanks(world, [&](int r) {
    DoneRecorder done;
    group->Submit(r,
                  CollectiveOp::AllReduce(
                      3, MutableBuffer{buf[r].data(), floats * 4, DType::kFloat32}, ReduceOp::kSum),
                  done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
  size_t wrong = 0;  // elements off the exact sum, over every rank
  for (int r = 0; r < world; ++r) {
    for (size_t k = 0; k < floats; ++k) {
      wrong += buf[r][k] != ranks_sum * static_cast<float>(k % 7 + 1) ? 1 : 0;
    }
  }
  EXPECT_EQ(wrong, 0u);
  std::vector<size_t> out;
  for (int n = 0; n <= *std::max_element(node_of.begin(), node_of.end()); ++n) {
    out.push_back(transport->SentBy(n));
  }
  return out;
}

TEST(HierarchicalTrafficTest, AllReduceSendsEachNodesPartialOnce) {
  // The all-reduce's halves run hierarchically: each node sends 2 * (N-1)/N of the buffer (its
  // node partial's reduce-scatter and all-gather among the N nodes), whatever L; the flat ring
  // 2 * (W-1)/W per rank that sends across (one per node when contiguous, every rank when
  // interleaved). Fingerprints: 2 ops x L local x (W-L) remote ranks x 32 bytes.
  constexpr size_t kFloats = 4800;  // a multiple of every world size below
  constexpr size_t kBytes = kFloats * 4;
  constexpr size_t kFingerprint = 32;
  // 2 nodes x 2 ranks: hierarchical 2 * 1/2 * B per node, the flat ring 2 * 3/4 * B.
  const size_t fp = 8 * kFingerprint;
  EXPECT_THAT(AllReduceInterNodeBytes({0, 0, 1, 1}, true, kFloats),
              ElementsAre(kBytes + fp, kBytes + fp));
  EXPECT_THAT(AllReduceInterNodeBytes({0, 0, 1, 1}, false, kFloats),
              ElementsAre(3 * kBytes / 2 + fp, 3 * kBytes / 2 + fp));
  // Interleaved: the same hierarchical bytes; the flat ring's every hop crosses nodes.
  EXPECT_THAT(AllReduceInterNodeBytes({0, 1, 0, 1}, true, kFloats),
              ElementsAre(kBytes + fp, kBytes + fp));
  EXPECT_THAT(AllReduceInterNodeBytes({0, 1, 0, 1}, false, kFloats),
              ElementsAre(3 * kBytes + fp, 3 * kBytes + fp));
  // 3 nodes x 2 ranks: 2 * 2/3 * B per node; 2 nodes x 3 ranks: 2 * 1/2 * B per node.
  const size_t fp3 = 2 * 2 * 4 * kFingerprint;
  EXPECT_THAT(AllReduceInterNodeBytes({0, 0, 1, 1, 2, 2}, true, kFloats),
              ElementsAre(4 * kBytes / 3 + fp3, 4 * kBytes / 3 + fp3, 4 * kBytes / 3 + fp3));
  const size_t fp2x3 = 2 * 3 * 3 * kFingerprint;
  EXPECT_THAT(AllReduceInterNodeBytes({0, 0, 0, 1, 1, 1}, true, kFloats),
              ElementsAre(kBytes + fp2x3, kBytes + fp2x3));
}

// ReduceScatter of values whose float32 sum depends on the order: the result is the one the
// header documents (node partials by local index, folded over nodes m+1, ..., m-1, then m).
void ExpectDocumentedSumOrder(const std::vector<int>& node_of,
                              size_t chunk = RingOptions{}.pipeline_chunk_bytes) {
  const int world = static_cast<int>(node_of.size());
  const NodeLayout l = HierarchicalLayout(node_of).value();
  constexpr size_t kShard = 64;
  auto value = [](int rank, size_t j) {
    // Large and small magnitudes, so that rounding depends on the order of additions.
    const float big[] = {1e8f, -1e8f, 3.0f, 1e-3f, 7e7f, -3e7f};
    return big[(rank + j) % 6] * (1.0f + static_cast<float>(j % 5) * 0.1f);
  };
  std::vector<std::vector<float>> in(world, std::vector<float>(kShard * world));
  for (int r = 0; r < world; ++r) {
    for (size_t j = 0; j < in[r].size(); ++j) in[r][j] = value(r, j);
  }
  std::vector<std::vector<float>> out(world, std::vector<float>(kShard));
  RingOptions o;
  o.node_of_rank = node_of;
  o.pipeline_chunk_bytes = chunk;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", world),
                                  std::make_shared<InprocTransport>(world), o)
                  .value();
  RunRanks(world, [&](int r) {
    DoneRecorder done;
    comm->ReduceScatter(ConstBuffer{in[r].data(), kShard * world * 4, DType::kFloat32},
                        MutableBuffer{out[r].data(), kShard * 4, DType::kFloat32}, ReduceOp::kSum,
                        Opts(r, 1), done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  for (int r = 0; r < world; ++r) {
    const int m = l.node_of[r];
    for (size_t j = 0; j < kShard; ++j) {
      const size_t e = r * kShard + j;
      auto partial = [&](int node) {
        float p = 0;
        for (int rank : l.ranks[node]) p += in[rank][e];
        return p;
      };
      float want = partial((m + 1) % l.nodes);
      for (int k = 2; k <= l.nodes; ++k) want += partial((m + k) % l.nodes);
      ASSERT_EQ(out[r][j], want) << "rank " << r << " element " << j;
    }
  }
}

TEST(HierarchicalSumOrderTest, TwoNodesOfTwoRanks) { ExpectDocumentedSumOrder({0, 0, 1, 1}); }
TEST(HierarchicalSumOrderTest, ThreeInterleavedNodesOfTwoRanks) {
  ExpectDocumentedSumOrder({0, 1, 2, 0, 1, 2});
}
// Chunks of 40 bytes (10 floats; 7 chunks, the last of 4 floats): the same order.
TEST(HierarchicalSumOrderTest, PipelinedInChunks) {
  ExpectDocumentedSumOrder({0, 0, 1, 1}, 40);
  ExpectDocumentedSumOrder({0, 1, 2, 0, 1, 2}, 40);
}

TEST(HierarchicalScratchTest, ReduceScatterScratchGoesBackToThePool) {
  constexpr int kWorld = 4;
  constexpr size_t kShard = 256;  // floats
  RingOptions o;
  o.node_of_rank = {0, 0, 1, 1};
  o.scratch = ScratchPool::Create(nullptr);
  const std::vector<size_t> idle = IdleScratchAfterReduceScatters(o, kWorld, kShard, 3);
  ASSERT_EQ(idle.size(), 3u);
  for (size_t op = 0; op < idle.size(); ++op) {
    // Each rank's W*S scratch is back; later ops reuse it instead of allocating more.
    EXPECT_EQ(idle[op], kWorld * kWorld * kShard * 4) << "op " << op + 1;
  }
}

TEST(HierarchicalScratchTest, PipelinedReduceScatterHoldsOneSlotPerChunkInFlight) {
  constexpr int kWorld = 4;
  constexpr size_t kShard = 256;  // floats: 16 chunks of 64 bytes
  RingOptions o;
  o.node_of_rank = {0, 0, 1, 1};
  o.scratch = ScratchPool::Create(nullptr);
  o.pipeline_chunk_bytes = 64;
  const std::vector<size_t> idle = IdleScratchAfterReduceScatters(o, kWorld, kShard, 1);
  ASSERT_EQ(idle.size(), 1u);
  // 2 nodes: 2 chunks in flight, each with W chunks of scratch, per rank.
  EXPECT_EQ(idle[0], kWorld * 2 * kWorld * 64);
}

}  // namespace
}  // namespace flatshard::collective::testing
