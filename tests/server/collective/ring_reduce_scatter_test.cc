// The flat ring's pipelined ReduceScatter (ring_reduce_scatter.h) run by the ring communicator
// over InprocTransport: the conformance suites in small chunks, the documented sum order to the
// bit for every dtype, op, world size 1..5 and chunk size (tiny ones included), the scratch
// bound, the reduction running behind the next chunk's transfers, and failures mid-pipeline.

#include "server/collective/ring_reduce_scatter.h"

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/ring_algorithms.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/server/collective/ring_scratch_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {
namespace {

using ::testing::Combine;
using ::testing::Range;
using ::testing::Values;
using ::testing::ValuesIn;

// A chunk that divides no shard size of the suites (1 element, 4097, 1 MiB): many chunks per
// block, a short last one among them, an odd count in some.
constexpr size_t kSmallChunk = 4000;

absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& g, size_t chunk) {
  RingOptions o;
  o.pipeline_chunk_bytes = chunk;
  return NewRingCommunicator(g, std::make_shared<InprocTransport>(g.world_size), o);
}

const BackendUnderTest kRingChunked{"RingChunked",
                                    [](const GroupSpec& g) { return Connect(g, kSmallChunk); }};

INSTANTIATE_TEST_SUITE_P(RingChunked, BackendConformanceTest,
                         Combine(Values(&kRingChunked), Range(1, 9), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(RingChunked, BackendFailureTest, Values(&kRingChunked), FailureName);

// --- The sum order, bit for bit --------------------------------------------------------------

// Values whose sums round differently in another order, in range for every dtype.
double OrderSensitiveValue(DType dtype, int rank, size_t j) {
  const double scale = dtype == DType::kFloat64 ? 1e14 : dtype == DType::kFloat32 ? 1e5 : 1;
  const double big[] = {2000 * scale, -1999 * scale, 0.7, 0.013, 1000.3 * scale, -3.7};
  return big[(rank * 7 + j * 3) % 6] * (1.0 + static_cast<double>(j % 5) * 0.1);
}

// A value of `dtype` as the reduction kernels accumulate it (float, or double for float64).
double Load(DType dtype, const std::vector<uint8_t>& buf, size_t i) {
  return LoadAs(dtype, buf.data(), i);
}

// `acc` rounded to `dtype` (float32 arithmetic for every type but float64, as reduce.h says).
double Round(DType dtype, double acc) {
  switch (dtype) {
    case DType::kFloat64:
      return acc;
    case DType::kFloat32:
      return static_cast<float>(acc);
    case DType::kBFloat16:
      return TestBFloat16ToFloat(TestFloatToBFloat16(static_cast<float>(acc)));
    case DType::kFloat16:
      return TestHalfToFloat(TestFloatToHalf(static_cast<float>(acc)));
    default:
      ADD_FAILURE() << "unsupported dtype";
      return 0;
  }
}

// Adds in the accumulator's type: float for every dtype but float64.
double Add(DType dtype, double a, double b) {
  if (dtype == DType::kFloat64) return a + b;
  return static_cast<float>(a) + static_cast<float>(b);
}

// Runs one ReduceScatter and checks every rank's result against the documented order for
// block r: in_{r+1} + in_{r+2} + ... + in_{r-1} + in_r, each partial rounded to the dtype,
// the last sum divided by W (in the accumulator) for kAvg. Returns the elements where the
// ascending-rank order (in_0 + in_1 + ...) would have given another value.
int ExpectDocumentedOrder(int world, DType dtype, ReduceOp op, size_t elements, size_t chunk) {
  SCOPED_TRACE(absl::StrCat("world ", world, " ", DTypeName(dtype), " ", ReduceOpName(op), " ",
                            elements, " elements, chunk ", chunk));
  const size_t item = static_cast<size_t>(ItemSize(dtype));
  const size_t shard = elements * item;
  std::vector<std::vector<uint8_t>> in(world, std::vector<uint8_t>(shard * world));
  std::vector<std::vector<uint8_t>> out(world, std::vector<uint8_t>(shard, 0xff));
  for (int r = 0; r < world; ++r) {
    for (size_t j = 0; j < elements * world; ++j) {
      StoreAs(dtype, in[r].data(), j, Round(dtype, OrderSensitiveValue(dtype, r, j)));
    }
  }
  auto comm = Connect(GroupSpec::AllLocal("g", world), chunk).value();
  RunRanks(world, [&](int r) {
    DoneRecorder done;
    comm->ReduceScatter(ConstBuffer{in[r].data(), shard * world, dtype},
                        MutableBuffer{out[r].data(), shard, dtype}, op, Opts(r, 1),
                        done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  int order_matters = 0;
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < elements; ++i) {
      const size_t e = r * elements + i;
      auto finish = [&](double acc) {
        if (op == ReduceOp::kAvg) {
          acc = dtype == DType::kFloat64 ? acc / world
                                         : static_cast<float>(acc) / static_cast<float>(world);
        }
        return Round(dtype, acc);
      };
      double want;
      if (world == 1) {
        want = finish(Load(dtype, in[r], e));
      } else {
        double p = Load(dtype, in[(r + 1) % world], e);
        for (int k = 2; k < world; ++k) {
          p = Round(dtype, Add(dtype, p, Load(dtype, in[(r + k) % world], e)));
        }
        want = finish(Add(dtype, p, Load(dtype, in[r], e)));
      }
      std::vector<uint8_t> want_bits(item);
      StoreAs(dtype, want_bits.data(), 0, want);
      if (std::memcmp(out[r].data() + i * item, want_bits.data(), item) != 0) {
        ADD_FAILURE() << "rank " << r << " element " << i << " is "
                      << LoadAs(dtype, out[r].data(), i) << ", want " << want;
        return order_matters;
      }
      double ascending = Load(dtype, in[0], e);
      for (int k = 1; k + 1 < world; ++k) {
        ascending = Round(dtype, Add(dtype, ascending, Load(dtype, in[k], e)));
      }
      if (world > 1) ascending = finish(Add(dtype, ascending, Load(dtype, in[world - 1], e)));
      order_matters += ascending != want ? 1 : 0;
    }
  }
  return order_matters;
}

TEST(RingReduceScatterOrderTest, EveryChunkSizeGivesTheUnchunkedRingsBits) {
  // Chunk 1 and 12 round up to 8 and 16 bytes; 40 bytes splits every dtype's elements into
  // chunks of 5 to 20; 1 MiB is one chunk (the unchunked ring).
  for (size_t chunk : {size_t{1}, size_t{12}, size_t{40}, size_t{1} << 20}) {
    for (int world = 1; world <= 5; ++world) {
      for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
        int order_matters = 0;
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          for (size_t elements : {size_t{1}, size_t{3}, size_t{61}}) {
            order_matters += ExpectDocumentedOrder(world, dtype, op, elements, chunk);
          }
        }
        // The values have teeth: another order changes some sums of 3 or more ranks.
        if (world >= 3) {
          EXPECT_GT(order_matters, 0) << "world " << world << " " << DTypeName(dtype);
        }
      }
    }
  }
}

// --- Scratch and overlap ---------------------------------------------------------------------

TEST(RingReduceScatterTest, ScratchIsAFewChunksNotTwoBlocks) {
  constexpr int kWorld = 4;
  constexpr size_t kShard = 256;  // floats: 16 chunks of 64 bytes
  RingOptions o;
  o.scratch = ScratchPool::Create(nullptr);
  o.pipeline_chunk_bytes = 64;
  const std::vector<size_t> idle = IdleScratchAfterReduceScatters(o, kWorld, kShard, 2);
  ASSERT_EQ(idle.size(), 2u);
  for (size_t op = 0; op < idle.size(); ++op) {
    // Per rank a send and a receive chunk for each of the window's 2 chunks, back in the pool
    // (and reused by the second op) instead of 2 blocks of 1 KiB.
    EXPECT_EQ(idle[op], kWorld * 2 * RingReduceScatterSteps::kWindow * 64) << "op " << op + 1;
  }
}

// InprocTransport that calls `on_send` before each Send (on the sending rank's thread).
class HookedTransport final : public Transport {
 public:
  using Hook = std::function<void(int src, MessageTag tag)>;
  HookedTransport(int world, Hook on_send) : inner_(world), on_send_(std::move(on_send)) {}
  int world_size() const override { return inner_.world_size(); }
  void Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) override {
    on_send_(src, tag);
    inner_.Send(src, dst, tag, data, std::move(done));
  }
  void Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) override {
    inner_.Recv(dst, src, tag, data, std::move(done));
  }
  void Abort(absl::Status reason) override { inner_.Abort(std::move(reason)); }

 private:
  InprocTransport inner_;
  const Hook on_send_;
};

TEST(RingReduceScatterTest, AChunksReductionRunsAfterTheNextChunkIsPosted) {
  // 2 ranks, 2 chunks of 4 floats: step 0 moves chunk 0, step 1 chunk 1, and chunk 0's sum
  // (rank 0's `out` chunk 0) is written only once step 1's transfers are on their way. The hook
  // runs on the thread that then reduces (the communicator's step runner), so it reads `out`
  // before that thread writes it.
  constexpr int kWorld = 2;
  constexpr size_t kShard = 8;  // floats
  std::vector<std::vector<float>> in(kWorld, std::vector<float>(kShard * kWorld));
  for (int r = 0; r < kWorld; ++r) {
    for (size_t j = 0; j < in[r].size(); ++j) in[r][j] = static_cast<float>(r * 100 + j);
  }
  std::vector<std::vector<float>> out(kWorld, std::vector<float>(kShard, -1.0f));
  absl::Mutex mu;
  std::vector<float> chunk0_when_step1_posted;
  auto transport = std::make_shared<HookedTransport>(kWorld, [&](int src, MessageTag tag) {
    if (src != 0 || tag.sub != 1) return;
    absl::MutexLock lock(&mu);
    chunk0_when_step1_posted.assign(out[0].begin(), out[0].begin() + 4);
  });
  RingOptions o;
  o.pipeline_chunk_bytes = 16;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", kWorld), transport, o).value();
  RunRanks(kWorld, [&](int r) {
    DoneRecorder done;
    comm->ReduceScatter(ConstBuffer{in[r].data(), kShard * kWorld * 4, DType::kFloat32},
                        MutableBuffer{out[r].data(), kShard * 4, DType::kFloat32}, ReduceOp::kSum,
                        Opts(r, 1), done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  absl::MutexLock lock(&mu);
  EXPECT_THAT(chunk0_when_step1_posted, ::testing::ElementsAre(-1.0f, -1.0f, -1.0f, -1.0f));
  for (size_t j = 0; j < kShard; ++j) EXPECT_EQ(out[0][j], in[0][j] + in[1][j]) << j;
}

// InprocTransport that holds rank 0's send of sub-tag `held` until rank 0 sends `release`.
class HoldingTransport final : public Transport {
 public:
  HoldingTransport(int world, uint32_t held, uint32_t release)
      : inner_(world), held_(held), release_(release) {}
  int world_size() const override { return inner_.world_size(); }
  void Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) override {
    if (src == 0 && tag.sub == held_) {
      absl::MutexLock lock(&mu_);
      pending_ = [this, dst, tag, data, done = std::move(done)]() mutable {
        inner_.Send(0, dst, tag, data, std::move(done));
      };
      return;
    }
    if (src == 0 && tag.sub == release_) {
      absl::AnyInvocable<void() &&> held;
      {
        absl::MutexLock lock(&mu_);
        released_ = true;
        held = std::move(pending_);
      }
      if (held) std::move(held)();
    }
    inner_.Send(src, dst, tag, data, std::move(done));
  }
  void Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) override {
    inner_.Recv(dst, src, tag, data, std::move(done));
  }
  void Abort(absl::Status reason) override { inner_.Abort(std::move(reason)); }
  bool released() const {
    absl::MutexLock lock(&mu_);
    return released_;
  }

 private:
  InprocTransport inner_;
  const uint32_t held_, release_;
  mutable absl::Mutex mu_;
  absl::AnyInvocable<void() &&> pending_ ABSL_GUARDED_BY(mu_);
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

TEST(RingReduceScatterTest, OneLaneMovesOnWhileTheOtherLanesChunkIsHeld) {
  // 2 ranks, 4 chunks of 4 floats: lane 0 carries steps 0 (chunk 0) and 2 (chunk 2), lane 1
  // steps 1 and 3. Rank 0's send of step 0 is held until rank 0 sends step 3: lane 1 must
  // finish step 1 and post step 3 while lane 0's first chunk is still on its way. A driver
  // that runs one step at a time never gets there (the op would miss its deadline).
  constexpr int kWorld = 2;
  constexpr size_t kShard = 16;  // floats
  std::vector<std::vector<float>> in(kWorld, std::vector<float>(kShard * kWorld));
  for (int r = 0; r < kWorld; ++r) {
    for (size_t j = 0; j < in[r].size(); ++j) in[r][j] = static_cast<float>(r * 100 + j);
  }
  std::vector<std::vector<float>> out(kWorld, std::vector<float>(kShard));
  auto transport = std::make_shared<HoldingTransport>(kWorld, /*held=*/0, /*release=*/3);
  RingOptions o;
  o.pipeline_chunk_bytes = 16;
  o.check_fingerprints = false;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", kWorld), transport, o).value();
  RunRanks(kWorld, [&](int r) {
    DoneRecorder done;
    comm->ReduceScatter(ConstBuffer{in[r].data(), kShard * kWorld * 4, DType::kFloat32},
                        MutableBuffer{out[r].data(), kShard * 4, DType::kFloat32}, ReduceOp::kSum,
                        Opts(r, 1, 3, absl::Seconds(20)), done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
  });
  EXPECT_TRUE(transport->released());
  for (int r = 0; r < kWorld; ++r) {
    for (size_t j = 0; j < kShard; ++j) {
      EXPECT_EQ(out[r][j], in[0][r * kShard + j] + in[1][r * kShard + j]) << r << " " << j;
    }
  }
}

// --- Failures mid-pipeline -------------------------------------------------------------------

constexpr int kWorld = 4;
constexpr size_t kShard = 1000;  // floats: 63 chunks of 64 bytes, 189 steps per rank

struct Buffers {
  std::vector<std::vector<float>> in{kWorld, std::vector<float>(kShard* kWorld, 1.0f)};
  std::vector<std::vector<float>> out{kWorld, std::vector<float>(kShard)};
};

void StartReduceScatter(Communicator& comm, Buffers& b, int r, uint64_t op_seq, DoneCallback done,
                        absl::Duration timeout = absl::Seconds(20)) {
  comm.ReduceScatter(ConstBuffer{b.in[r].data(), kShard * kWorld * 4, DType::kFloat32},
                     MutableBuffer{b.out[r].data(), kShard * 4, DType::kFloat32}, ReduceOp::kSum,
                     Opts(r, op_seq, 3, timeout), std::move(done));
}

TEST(RingReduceScatterFailureTest, APeerDyingMidPipelineFailsEveryRankWithItsStatus) {
  // The transport fails (as UCX does when a peer daemon dies) at rank 2's 100th chunk send.
  const absl::Status died = absl::UnavailableError("UCX peer of rank 3 failed: connection reset");
  std::shared_ptr<HookedTransport> transport;
  absl::Mutex mu;
  int sends = 0;
  transport = std::make_shared<HookedTransport>(kWorld, [&](int src, MessageTag tag) {
    if (src != 2 || tag.sub >= kPipelineSubLimit) return;
    bool fail;
    {
      absl::MutexLock lock(&mu);
      fail = ++sends == 100;
    }
    if (fail) transport->Abort(died);
  });
  RingOptions o;
  o.pipeline_chunk_bytes = 64;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", kWorld), transport, o).value();
  Buffers b;
  std::vector<DoneRecorder> done(kWorld);
  RunRanks(kWorld, [&](int r) {
    StartReduceScatter(*comm, b, r, 1, done[r].Callback());
    EXPECT_EQ(done[r].Wait(), died) << "rank " << r;
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(done[r].calls(), 1) << "rank " << r;
  EXPECT_EQ(comm->status(), died);
  EXPECT_TRUE(comm->PendingOps().empty());
  DoneRecorder later;
  StartReduceScatter(*comm, b, 0, 2, later.Callback());
  EXPECT_EQ(later.Wait(), died);
}

TEST(RingReduceScatterFailureTest, ADeadlineMidPipelineNamesTheOpAndIsSticky) {
  // Without fingerprints ranks 0-2 start moving chunks at once; rank 3 never comes, so each
  // waits mid-pipeline until its deadline.
  RingOptions o;
  o.pipeline_chunk_bytes = 64;
  o.check_fingerprints = false;
  auto comm = NewRingCommunicator(GroupSpec::AllLocal("g", kWorld),
                                  std::make_shared<InprocTransport>(kWorld), o)
                  .value();
  Buffers b;
  std::vector<DoneRecorder> done(kWorld);
  RunRanks(3, [&](int r) {
    StartReduceScatter(*comm, b, r, 1, done[r].Callback(), absl::Milliseconds(200));
  });
  absl::Status s = done[0].Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("op_seq 1 ReduceScatter(unit 3, 4000 bytes, float32, sum): rank "));
  EXPECT_THAT(std::string(s.message()), HasSubstr(" did not finish moving data within "));
  for (int r : {1, 2}) EXPECT_EQ(done[r].Wait(), s) << "rank " << r;
  StartReduceScatter(*comm, b, 3, 1, done[3].Callback());
  EXPECT_EQ(done[3].Wait(), s);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(done[r].calls(), 1) << "rank " << r;
}

}  // namespace
}  // namespace flatshard::collective::testing
