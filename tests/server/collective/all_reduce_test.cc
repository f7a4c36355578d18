// CollectiveOp::AllReduce: the engine's reduce-scatter + all-gather over a group's Communicator,
// on the inproc backend and on the ring algorithms UCX runs (over InprocTransport here), for
// sum/avg, float32/bfloat16/float16, sizes that are and are not multiples of the world size
// (zero-padded scratch), worlds 1..4; plus op_seq accounting, ordering of later ops, mismatch and
// sticky errors. Values are small integers, so every partial sum is exact in each dtype and the
// only rounding is avg's final division (float32, then one rounding to the dtype), which the
// reference computes the same way: results are compared element-exact.

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/collective_engine.h"
#include "server/collective/inproc/inproc_backend.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/reduce.h"
#include "server/collective/ring_algorithms.h"
#include "tests/testing/rank_group.h"
#if FS_HAVE_UCX
#include "server/collective/ucx/ucx_backend.h"
#endif

namespace flatshard::collective {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

enum class Backend { kInproc, kRing };

std::shared_ptr<CollectiveGroup> AddGroup(CollectiveEngine& engine, Backend backend, int world,
                                          const std::string& id = "job") {
  GroupSpec spec = GroupSpec::AllLocal(id, world);
  std::unique_ptr<Communicator> comm;
  if (backend == Backend::kInproc) {
    static CollectiveBackend* inproc = CreateInprocBackend().value().release();
    comm = inproc->Connect(spec).value();
  } else {
    comm = NewRingCommunicator(spec, std::make_shared<InprocTransport>(world)).value();
  }
  return engine.AddGroup(spec, std::move(comm)).value();
}

// Element i of rank r's input: a small integer, exact in every dtype and in every partial sum.
float Input(int r, size_t i) { return static_cast<float>((r * 7 + static_cast<int>(i) * 3) % 11); }

uint16_t ToHalfBits(DType dtype, float v) {
  return dtype == DType::kBFloat16 ? FloatToBFloat16(v) : FloatToHalf(v);
}
float FromHalfBits(DType dtype, uint16_t b) {
  return dtype == DType::kBFloat16 ? BFloat16ToFloat(b) : HalfToFloat(b);
}

std::vector<uint8_t> Encode(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * ItemSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t b = ToHalfBits(dtype, values[i]);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
  }
  return bytes;
}

float Decode(DType dtype, const std::vector<uint8_t>& bytes, size_t i) {
  if (dtype == DType::kFloat32) {
    float v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, bytes.data() + 2 * i, 2);
  return FromHalfBits(dtype, b);
}

using Param = std::tuple<Backend, int, DType, ReduceOp, size_t>;

class AllReduceTest : public ::testing::TestWithParam<Param> {};

TEST_P(AllReduceTest, EveryRankGetsTheReductionElementExact) {
  const auto [backend, world, dtype, op, n] = GetParam();
  CollectiveEngine engine;
  auto group = AddGroup(engine, backend, world);
  std::vector<std::vector<uint8_t>> bufs(world);
  for (int r = 0; r < world; ++r) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = Input(r, i);
    bufs[r] = Encode(dtype, v);
  }
  RunRanks(world, [&](int r) {
    DoneRecorder done;
    group->Submit(
        r, CollectiveOp::AllReduce(3, MutableBuffer{bufs[r].data(), bufs[r].size(), dtype}, op),
        done.Callback());
    EXPECT_TRUE(done.Wait().ok()) << done.status();
    EXPECT_EQ(group->last_op_seq(r), 2u);  // a reduce-scatter and an all-gather
  });
  for (size_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int r = 0; r < world; ++r) sum += Input(r, i);
    float want = op == ReduceOp::kAvg ? sum / static_cast<float>(world) : sum;
    if (dtype != DType::kFloat32) want = FromHalfBits(dtype, ToHalfBits(dtype, want));
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(Decode(dtype, bufs[r], i), want) << "rank " << r << " element " << i;
    }
  }
  EXPECT_TRUE(group->status().ok());
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, AllReduceTest,
    ::testing::Combine(::testing::Values(Backend::kInproc, Backend::kRing),
                       ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(ReduceOp::kSum, ReduceOp::kAvg),
                       ::testing::Values(size_t{0}, size_t{1}, size_t{12}, size_t{1001})),
    [](const ::testing::TestParamInfo<Param>& info) {
      const Param& p = info.param;
      return std::string(std::get<0>(p) == Backend::kInproc ? "inproc" : "ring") + "_w" +
             std::to_string(std::get<1>(p)) + "_" + std::string(DTypeName(std::get<2>(p))) + "_" +
             std::string(ReduceOpName(std::get<3>(p))) + "_n" + std::to_string(std::get<4>(p));
    });

// Ops submitted behind an all-reduce, without waiting for it, run after its all-gather (they
// get the op_seqs after it) on both the padded (5 elements over 3 ranks) and the unpadded
// path; then an all-reduce chained from a callback on the first one's result. (Buffers an op
// writes stay untouched until it is done: each in-flight op has its own.)
TEST(AllReduceEngineTest, OpsBehindAnAllReduceRunAfterItsAllGather) {
  constexpr int kWorld = 3;
  CollectiveEngine engine;
  auto group = AddGroup(engine, Backend::kRing, kWorld);
  std::vector<std::vector<float>> padded(kWorld, std::vector<float>(5));
  std::vector<std::vector<float>> even(kWorld, std::vector<float>(6));
  std::vector<std::vector<float>> shard(kWorld, std::vector<float>(2));
  std::vector<std::vector<float>> full(kWorld, std::vector<float>(2 * kWorld));
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < 5; ++i) padded[r][i] = static_cast<float>(r + i);
    for (size_t i = 0; i < 6; ++i) even[r][i] = static_cast<float>(2 * r);
    shard[r] = {10.0f * r, 10.0f * r + 1};
  }
  RunRanks(kWorld, [&](int r) {
    DoneRecorder ar1, ar2, ag, chained;
    MutableBuffer p{padded[r].data(), 20, DType::kFloat32};
    group->Submit(
        r, CollectiveOp::AllReduce(1, p, ReduceOp::kSum),
        [&, r, p, cb = ar1.Callback(), next = chained.Callback()](absl::Status s) mutable {
          const bool ok = s.ok();
          cb(std::move(s));
          if (!ok) return;
          // On the reduced values: every rank now holds the sum, so this is x3.
          group->Submit(r, CollectiveOp::AllReduce(1, p, ReduceOp::kSum), std::move(next));
        });
    group->Submit(r,
                  CollectiveOp::AllReduce(2, MutableBuffer{even[r].data(), 24, DType::kFloat32},
                                          ReduceOp::kAvg),
                  ar2.Callback());
    group->Submit(
        r,
        CollectiveOp::AllGather(3, ConstBuffer{shard[r].data(), 8, DType::kFloat32},
                                MutableBuffer{full[r].data(), 8 * kWorld, DType::kFloat32}),
        ag.Callback());
    EXPECT_TRUE(ar1.Wait().ok()) << ar1.status();
    EXPECT_TRUE(ar2.Wait().ok()) << ar2.status();
    EXPECT_TRUE(ag.Wait().ok()) << ag.status();
    EXPECT_TRUE(chained.Wait().ok()) << chained.status();
    EXPECT_EQ(group->last_op_seq(r), 7u);  // 2 + 2 + 1 + 2
  });
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(padded[r][i], 3.0f * (0 + 1 + 2 + 3 * i)) << "rank " << r << " element " << i;
    }
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(even[r][i], (0.0f + 2 + 4) / 3) << "rank " << r;
    for (int k = 0; k < kWorld; ++k) {
      EXPECT_EQ(full[r][2 * k], 10.0f * k);
      EXPECT_EQ(full[r][2 * k + 1], 10.0f * k + 1);
    }
  }
}

TEST(AllReduceEngineTest, MismatchedRanksFailWithAbortedAndTheGroupStaysFailed) {
  CollectiveEngine engine;
  auto group = AddGroup(engine, Backend::kInproc, 2);
  std::vector<float> a(4, 1), b(2, 1), out(4);
  DoneRecorder d0, d1, later;
  RunRanks(2, [&](int r) {
    if (r == 0) {
      group->Submit(
          0,
          CollectiveOp::AllReduce(7, MutableBuffer{a.data(), 16, DType::kFloat32}, ReduceOp::kSum),
          d0.Callback());
    } else {
      group->Submit(1,
                    CollectiveOp::AllGather(7, ConstBuffer{b.data(), 8, DType::kFloat32},
                                            MutableBuffer{out.data(), 16, DType::kFloat32}),
                    d1.Callback());
    }
  });
  EXPECT_EQ(d0.Wait().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(d0.status().message(), HasSubstr("collective mismatch at op_seq 1"));
  EXPECT_EQ(d1.Wait().code(), absl::StatusCode::kAborted);
  group->Submit(
      1, CollectiveOp::AllReduce(8, MutableBuffer{a.data(), 16, DType::kFloat32}, ReduceOp::kSum),
      later.Callback());
  EXPECT_EQ(later.Wait().code(), absl::StatusCode::kAborted);
}

TEST(AllReduceEngineTest, RefusesIntegersAndUnpaddedDeviceBuffersNamingTheOp) {
  CollectiveEngine engine;
  auto group = AddGroup(engine, Backend::kInproc, 1);
  std::vector<int32_t> ints(4);
  DoneRecorder done;
  group->Submit(
      0, CollectiveOp::AllReduce(5, MutableBuffer{ints.data(), 16, DType::kInt32}, ReduceOp::kSum),
      done.Callback());
  EXPECT_EQ(done.Wait().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(done.status().message(), HasSubstr("AllReduce(unit 5, 16 bytes, int32, sum)"));
  EXPECT_THAT(done.status().message(), HasSubstr("float32"));

  CollectiveEngine engine2;
  auto pair = AddGroup(engine2, Backend::kInproc, 2);
  float fake_device[3] = {0, 0, 0};  // never dereferenced: refused before any copy
  DoneRecorder dev;
  pair->Submit(
      0,
      CollectiveOp::AllReduce(6, MutableBuffer{fake_device, 12, DType::kFloat32, MemoryKind::kCuda},
                              ReduceOp::kSum),
      dev.Callback());
  EXPECT_EQ(dev.Wait().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dev.status().message(), HasSubstr("multiple of the 2 ranks"));
}

#if FS_HAVE_UCX
// Daemons over UCX, as flatshardd runs them: one UcxBackend (its own UCX worker) and one
// CollectiveEngine per daemon, each with the group's communicator for its local ranks; layouts
// of 2 daemons x 2 ranks and 3 daemons x 1 rank. bfloat16 avg over an odd size (padding).
TEST(AllReduceUcxTest, DaemonsAllReduceOverUcx) {
  constexpr size_t kN = 1001;
  const std::vector<std::vector<int>> layouts = {{0, 0, 1, 1}, {0, 1, 2}};
  std::vector<std::unique_ptr<CollectiveBackend>> daemons;
  for (int d = 0; d < 3; ++d) daemons.push_back(CreateUcxBackend({}).value());
  uint64_t epoch = 0;
  for (const std::vector<int>& layout : layouts) {
    const int world = static_cast<int>(layout.size());
    std::vector<std::unique_ptr<CollectiveEngine>> engines;
    std::vector<std::shared_ptr<CollectiveGroup>> groups;
    ++epoch;  // a fresh group per layout, the same epoch on every daemon
    for (int d = 0; d <= layout.back(); ++d) {
      GroupSpec spec;
      spec.group_id = "ucx-all-reduce";
      spec.epoch = epoch;
      spec.world_size = world;
      for (int r = 0; r < world; ++r) {
        spec.rank_addresses.push_back(daemons[layout[r]]->LocalAddress());
        if (layout[r] == d) spec.local_ranks.push_back(r);
      }
      engines.push_back(std::make_unique<CollectiveEngine>());
      groups.push_back(engines.back()->AddGroup(spec, daemons[d]->Connect(spec).value()).value());
    }
    std::vector<std::vector<float>> values(world, std::vector<float>(kN));
    std::vector<std::vector<uint8_t>> bufs(world);
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < kN; ++i) values[r][i] = Input(r, i);
      bufs[r] = Encode(DType::kBFloat16, values[r]);
    }
    RunRanks(world, [&](int r) {
      DoneRecorder done;
      groups[layout[r]]->Submit(
          r,
          CollectiveOp::AllReduce(
              0, MutableBuffer{bufs[r].data(), bufs[r].size(), DType::kBFloat16}, ReduceOp::kAvg),
          done.Callback());
      EXPECT_TRUE(done.Wait().ok()) << "rank " << r << ": " << done.status();
    });
    for (size_t i = 0; i < kN; ++i) {
      float sum = 0;
      for (int r = 0; r < world; ++r) sum += Input(r, i);
      const float want = FromHalfBits(DType::kBFloat16, ToHalfBits(DType::kBFloat16, sum / world));
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(Decode(DType::kBFloat16, bufs[r], i), want) << "rank " << r << " element " << i;
      }
    }
  }
}
#endif

}  // namespace
}  // namespace flatshard::collective
