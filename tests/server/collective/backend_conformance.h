#pragma once
// Conformance tests every Communicator must pass (STYLE §8). A backend test file defines a
// BackendUnderTest and instantiates:
//
//   INSTANTIATE_TEST_SUITE_P(Inproc, BackendConformanceTest,
//                            Combine(Values(&kInproc), Range(1, 9), ValuesIn(AllShardSizes())),
//                            ConformanceName);
//   INSTANTIATE_TEST_SUITE_P(Inproc, BackendFailureTest, Values(&kInproc), FailureName);
//
// BackendConformanceTest checks the data of AllGather, ReduceScatter (sum and avg over float32,
// bfloat16, float16, float64 (the last two not at 1 MiB), with exact expected values),
// Broadcast from every root and Gather, for world sizes 1..8 and per-rank shard sizes
// {0, 1 element, 4097 elements, 1 MiB}.
// BackendFailureTest checks the failure contract of backend.h with 4 ranks: mismatch, deadline,
// sticky errors, Abort mid-op, exactly-once callbacks that may call back in, pending ops.
// Ranks run as threads (RunRanks) or, where order matters, are issued from the test thread.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/backend.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {

using ::flatshard::testing::DoneRecorder;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;

// How a test gets a Communicator for a group whose ranks are all local.
struct BackendUnderTest {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<Communicator>>(const GroupSpec&)> connect;
};

enum class ShardSize { kZero, kOneElement, k4097Elements, kOneMiB };

inline std::vector<ShardSize> AllShardSizes() {
  return {ShardSize::kZero, ShardSize::kOneElement, ShardSize::k4097Elements, ShardSize::kOneMiB};
}

inline std::string ShardSizeName(ShardSize s) {
  switch (s) {
    case ShardSize::kZero:
      return "Empty";
    case ShardSize::kOneElement:
      return "OneElement";
    case ShardSize::k4097Elements:
      return "Elements4097";
    case ShardSize::kOneMiB:
      return "OneMiB";
  }
  return "Unknown";
}

// Elements per shard for `dtype`.
inline size_t ShardElements(ShardSize s, DType dtype) {
  switch (s) {
    case ShardSize::kZero:
      return 0;
    case ShardSize::kOneElement:
      return 1;
    case ShardSize::k4097Elements:
      return 4097;
    case ShardSize::kOneMiB:
      return (size_t{1} << 20) / static_cast<size_t>(ItemSize(dtype));
  }
  return 0;
}

// --- Test-side numerics, independent of server/collective/reduce.cc -------------------------

inline uint16_t TestFloatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);  // finite values only
}
inline float TestBFloat16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t TestFloatToHalf(float f) {
  _Float16 h = static_cast<_Float16>(f);  // the compiler's IEEE conversion, nearest even
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float TestHalfToFloat(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

// Stores `v` (an exactly representable value) as `dtype` at element i of `buf`.
inline void StoreAs(DType dtype, void* buf, size_t i, double v) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(buf)[i] = TestFloatToBFloat16(static_cast<float>(v));
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(buf)[i] = TestFloatToHalf(static_cast<float>(v));
      break;
    default:
      ADD_FAILURE() << "unsupported dtype";
  }
}

inline double LoadAs(DType dtype, const void* buf, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(buf)[i];
    case DType::kFloat64:
      return static_cast<const double*>(buf)[i];
    case DType::kBFloat16:
      return TestBFloat16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::kFloat16:
      return TestHalfToFloat(static_cast<const uint16_t*>(buf)[i]);
    default:
      ADD_FAILURE() << "unsupported dtype";
      return 0;
  }
}

// The value rank k contributes at element j of its ReduceScatter input: small integers, so
// every partial sum is exact in every dtype (|sum| <= 8 * 11 < 256).
inline int ReduceInput(int k, size_t j) { return static_cast<int>((j * 7 + k * 3) % 16) - 4; }

// The exact expected ReduceScatter result: the integer sum, or sum / world rounded the way
// the contract says (float32 division, then one rounding to the half type).
inline double ExpectedReduce(DType dtype, ReduceOp op, int sum, int world) {
  if (op == ReduceOp::kSum) return sum;
  switch (dtype) {
    case DType::kFloat64:
      return static_cast<double>(sum) / world;
    case DType::kFloat32:
      return static_cast<float>(sum) / static_cast<float>(world);
    case DType::kBFloat16:
      return TestBFloat16ToFloat(
          TestFloatToBFloat16(static_cast<float>(sum) / static_cast<float>(world)));
    case DType::kFloat16:
      return TestHalfToFloat(TestFloatToHalf(static_cast<float>(sum) / static_cast<float>(world)));
    default:
      return 0;
  }
}

// Distinct, exactly representable float32 values per (rank, element).
inline float ShardValue(int rank, size_t i) {
  return static_cast<float>(rank * 1000000 + static_cast<int>(i % 1000000));
}

inline OpOptions Opts(int rank, uint64_t op_seq, int64_t unit = 3,
                      absl::Duration timeout = absl::Seconds(20)) {
  OpOptions o;
  o.rank = rank;
  o.op_seq = op_seq;
  o.unit = unit;
  o.deadline = absl::Now() + timeout;
  o.name = "test";
  return o;
}

// --- Data conformance -----------------------------------------------------------------------

using ConformanceParam = std::tuple<const BackendUnderTest*, int, ShardSize>;

inline std::string ConformanceName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return absl::StrCat(std::get<0>(info.param)->name, "_World", std::get<1>(info.param), "_",
                      ShardSizeName(std::get<2>(info.param)));
}

class BackendConformanceTest : public ::testing::TestWithParam<ConformanceParam> {
 protected:
  void SetUp() override {
    const BackendUnderTest* backend = std::get<0>(GetParam());
    world_ = std::get<1>(GetParam());
    size_ = std::get<2>(GetParam());
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        backend->connect(GroupSpec::AllLocal("conformance", world_));
    if (absl::IsUnavailable(comm.status()) || absl::IsFailedPrecondition(comm.status())) {
      GTEST_SKIP() << backend->name << " unavailable: " << comm.status();
    }
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(*comm);
  }

  // Runs op(rank, done) on every rank's thread and expects every callback to report OK once.
  void RunOp(const std::function<void(int, absl::AnyInvocable<void(absl::Status)>)>& op) {
    std::vector<DoneRecorder> done(world_);
    RunRanks(world_, [&](int r) {
      op(r, done[r].Callback());
      EXPECT_TRUE(done[r].Wait().ok()) << "rank " << r << ": " << done[r].status();
    });
    for (int r = 0; r < world_; ++r) EXPECT_EQ(done[r].calls(), 1) << "rank " << r;
  }

  int world_ = 1;
  ShardSize size_ = ShardSize::kZero;
  std::unique_ptr<Communicator> comm_;
};

// Whether got[0, n) holds ShardValue(k, i) + offset; names the first wrong element. (One
// assertion per buffer keeps the 1 MiB cases fast.)
inline ::testing::AssertionResult BlockHolds(const float* got, int k, size_t n, float offset = 0) {
  for (size_t i = 0; i < n; ++i) {
    if (got[i] != ShardValue(k, i) + offset) {
      return ::testing::AssertionFailure() << "block " << k << " element " << i << " is " << got[i]
                                           << ", want " << ShardValue(k, i) + offset;
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_P(BackendConformanceTest, AllGatherIntoSeparateSharedAndInPlaceOutputs) {
  const size_t n = ShardElements(size_, DType::kFloat32);
  std::vector<std::vector<float>> in(world_, std::vector<float>(n));
  for (int r = 0; r < world_; ++r) {
    for (size_t i = 0; i < n; ++i) in[r][i] = ShardValue(r, i);
  }
  {
    SCOPED_TRACE("op 1: every rank has its own output");
    std::vector<std::vector<float>> out(world_, std::vector<float>(n * world_, -1.0f));
    RunOp([&](int r, DoneCallback done) {
      comm_->AllGather(ConstBuffer{in[r].data(), n * 4, DType::kFloat32},
                       MutableBuffer{out[r].data(), n * world_ * 4, DType::kFloat32}, Opts(r, 1),
                       std::move(done));
    });
    for (int r = 0; r < world_; ++r) {
      for (int k = 0; k < world_; ++k) {
        ASSERT_TRUE(BlockHolds(out[r].data() + k * n, k, n)) << "rank " << r;
      }
    }
  }
  std::vector<float> shared(n * world_, -1.0f);
  const MutableBuffer full{shared.data(), n * world_ * 4, DType::kFloat32};
  {
    SCOPED_TRACE("op 2: every rank gathers into one shared buffer (one copy per node)");
    RunOp([&](int r, DoneCallback done) {
      comm_->AllGather(ConstBuffer{in[r].data(), n * 4, DType::kFloat32}, full, Opts(r, 2),
                       std::move(done));
    });
    for (int k = 0; k < world_; ++k) ASSERT_TRUE(BlockHolds(shared.data() + k * n, k, n));
  }
  {
    SCOPED_TRACE("op 3: in place: each shard already sits in its slot of the shared buffer");
    for (int k = 0; k < world_; ++k) {
      for (size_t i = 0; i < n; ++i) shared[k * n + i] = ShardValue(k, i) + 1;
    }
    RunOp([&](int r, DoneCallback done) {
      comm_->AllGather(ConstBuffer{shared.data() + r * n, n * 4, DType::kFloat32}, full, Opts(r, 3),
                       std::move(done));
    });
    for (int k = 0; k < world_; ++k) ASSERT_TRUE(BlockHolds(shared.data() + k * n, k, n, 1));
  }
}

// Runs one ReduceScatter per dtype with `op` and checks every element exactly. `in` and `out`
// are reused across calls (allocating 8 ranks x 8 MiB each time dominates the 1 MiB cases).
inline void CheckReduceScatter(Communicator* comm, int world, ShardSize size, ReduceOp op,
                               uint64_t* op_seq, std::vector<std::vector<uint8_t>>& in,
                               std::vector<std::vector<uint8_t>>& out) {
  // float32 and bfloat16 at every size; float16 and float64 except at 1 MiB (test time).
  std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16};
  if (size != ShardSize::kOneMiB) {
    dtypes.push_back(DType::kFloat16);
    dtypes.push_back(DType::kFloat64);
  }
  in.resize(world);
  out.resize(world);
  for (DType dtype : dtypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t n = ShardElements(size, dtype);
    const size_t item = static_cast<size_t>(ItemSize(dtype));
    // ReduceInput(k, j) depends on j only through j % 16: encode the 16 values once, and the
    // expected result per residue.
    std::vector<uint8_t> encoded(16 * item);
    for (int v = 0; v < 16; ++v) StoreAs(dtype, encoded.data(), v, v - 4);
    double expected[16];
    for (size_t m = 0; m < 16; ++m) {
      int sum = 0;
      for (int k = 0; k < world; ++k) sum += ReduceInput(k, m);
      expected[m] = ExpectedReduce(dtype, op, sum, world);
    }
    for (int k = 0; k < world; ++k) {
      in[k].resize(n * world * item);
      out[k].assign(n * item, 0xff);
      // Rank k's input repeats every 16 elements: write one period, then double it.
      const size_t total = in[k].size();
      const size_t period = std::min(total, 16 * item);
      for (size_t j = 0; j * item < period; ++j) {
        std::memcpy(in[k].data() + j * item, encoded.data() + (ReduceInput(k, j) + 4) * item, item);
      }
      for (size_t filled = period; filled < total; filled *= 2) {
        std::memcpy(in[k].data() + filled, in[k].data(), std::min(filled, total - filled));
      }
    }
    ++*op_seq;
    std::vector<DoneRecorder> done(world);
    RunRanks(world, [&](int r) {
      comm->ReduceScatter(ConstBuffer{in[r].data(), in[r].size(), dtype},
                          MutableBuffer{out[r].data(), out[r].size(), dtype}, op, Opts(r, *op_seq),
                          done[r].Callback());
      EXPECT_TRUE(done[r].Wait().ok()) << "rank " << r << ": " << done[r].status();
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(done[r].calls(), 1);
      for (size_t i = 0; i < n; ++i) {
        const double got = LoadAs(dtype, out[r].data(), i);
        if (got != expected[(r * n + i) % 16]) {
          FAIL() << "rank " << r << " element " << i << " is " << got << ", want "
                 << expected[(r * n + i) % 16];
        }
      }
    }
  }
}

TEST_P(BackendConformanceTest, ReduceScatterSumAndAvgAreExact) {
  uint64_t op_seq = 0;
  std::vector<std::vector<uint8_t>> in, out;
  {
    SCOPED_TRACE("sum");
    CheckReduceScatter(comm_.get(), world_, size_, ReduceOp::kSum, &op_seq, in, out);
  }
  {
    SCOPED_TRACE("avg = sum / world_size");
    CheckReduceScatter(comm_.get(), world_, size_, ReduceOp::kAvg, &op_seq, in, out);
  }
}

TEST_P(BackendConformanceTest, BroadcastFromEveryRoot) {
  const size_t n = ShardElements(size_, DType::kFloat32);
  std::vector<std::vector<float>> buf(world_, std::vector<float>(n));
  for (int root = 0; root < world_; ++root) {
    SCOPED_TRACE(absl::StrCat("root ", root));
    for (int r = 0; r < world_; ++r) {
      for (size_t i = 0; i < n; ++i) buf[r][i] = r == root ? ShardValue(root, i) : -1.0f;
    }
    RunOp([&](int r, DoneCallback done) {
      comm_->Broadcast(MutableBuffer{buf[r].data(), n * 4, DType::kFloat32}, root,
                       Opts(r, root + 1), std::move(done));
    });
    for (int r = 0; r < world_; ++r) ASSERT_TRUE(BlockHolds(buf[r].data(), root, n)) << r;
  }
}

TEST_P(BackendConformanceTest, GatherToRootOnlyRootAllocates) {
  const size_t n = ShardElements(size_, DType::kFloat32);
  std::vector<std::vector<float>> in(world_, std::vector<float>(n));
  for (int r = 0; r < world_; ++r) {
    for (size_t i = 0; i < n; ++i) in[r][i] = ShardValue(r, i);
  }
  uint64_t op_seq = 0;
  for (int root : {0, world_ - 1}) {
    SCOPED_TRACE(absl::StrCat("root ", root));
    std::vector<float> full(n * world_, -1.0f);
    ++op_seq;
    RunOp([&](int r, DoneCallback done) {
      MutableBuffer out;  // non-root ranks allocate nothing
      if (r == root) out = MutableBuffer{full.data(), full.size() * 4, DType::kFloat32};
      comm_->Gather(ConstBuffer{in[r].data(), n * 4, DType::kFloat32}, out, root, Opts(r, op_seq),
                    std::move(done));
    });
    for (int k = 0; k < world_; ++k) ASSERT_TRUE(BlockHolds(full.data() + k * n, k, n));
  }
}

// --- Failure contract -----------------------------------------------------------------------

inline std::string FailureName(const ::testing::TestParamInfo<const BackendUnderTest*>& info) {
  return info.param->name;
}

class BackendFailureTest : public ::testing::TestWithParam<const BackendUnderTest*> {
 protected:
  static constexpr int kWorld = 4;
  static constexpr size_t kShard = 1024;  // floats

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        GetParam()->connect(GroupSpec::AllLocal("failures", kWorld));
    if (absl::IsUnavailable(comm.status()) || absl::IsFailedPrecondition(comm.status())) {
      GTEST_SKIP() << GetParam()->name << " unavailable: " << comm.status();
    }
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(*comm);
    for (int r = 0; r < kWorld; ++r) {
      in_[r].assign(kShard, static_cast<float>(r));
      out_[r].assign(kShard * kWorld, -1.0f);
    }
  }

  void AllGather(int rank, uint64_t op_seq, DoneCallback done,
                 absl::Duration timeout = absl::Seconds(20)) {
    comm_->AllGather(ConstBuffer{in_[rank].data(), kShard * 4, DType::kFloat32},
                     MutableBuffer{out_[rank].data(), kShard * kWorld * 4, DType::kFloat32},
                     Opts(rank, op_seq, 3, timeout), std::move(done));
  }

  std::unique_ptr<Communicator> comm_;
  std::vector<float> in_[kWorld];
  std::vector<float> out_[kWorld];
};

TEST_P(BackendFailureTest, MismatchFailsEveryRankWithAbortedNamingBothOpsAndRanks) {
  DoneRecorder done[kWorld];
  std::vector<float> rs_out(kShard / kWorld);
  // Issued from one thread in rank order, so every backend sees the same arrival order.
  AllGather(0, 1, done[0].Callback());
  AllGather(1, 1, done[1].Callback());
  comm_->ReduceScatter(ConstBuffer{in_[2].data(), kShard * 4, DType::kFloat32},
                       MutableBuffer{rs_out.data(), rs_out.size() * 4, DType::kFloat32},
                       ReduceOp::kSum, Opts(2, 1), done[2].Callback());
  AllGather(3, 1, done[3].Callback());
  for (int r = 0; r < kWorld; ++r) {
    absl::Status s = done[r].Wait();
    EXPECT_TRUE(absl::IsAborted(s)) << "rank " << r << ": " << s;
    EXPECT_EQ(s.message(),
              "collective mismatch at op_seq 1: rank 0 called AllGather(unit 3, 4096 bytes, "
              "float32) but rank 2 called ReduceScatter(unit 3, 1024 bytes, float32, sum)")
        << "rank " << r;
    EXPECT_EQ(done[r].calls(), 1);
  }
  EXPECT_EQ(comm_->status(), done[0].status());
  EXPECT_TRUE(comm_->PendingOps().empty());
}

TEST_P(BackendFailureTest, DeadlineNamesMissingRanksAndIsSticky) {
  DoneRecorder done[kWorld];
  // Rank 2's deadline passes first; rank 0 surely arrived before it, whatever the scheduling.
  AllGather(0, 1, done[0].Callback(), absl::Seconds(5));
  AllGather(2, 1, done[2].Callback(), absl::Milliseconds(100));
  for (int r : {0, 2}) {
    absl::Status s = done[r].Wait();
    EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("op_seq 1 AllGather(unit 3, 4096 bytes, float32): ranks 1, 3 did not "
                          "arrive within "));
  }
  EXPECT_EQ(done[0].status(), done[2].status());
  // Late arrivals and later ops fail with the same status.
  AllGather(1, 1, done[1].Callback());
  AllGather(3, 2, done[3].Callback());
  EXPECT_EQ(done[1].Wait(), done[0].status());
  EXPECT_EQ(done[3].Wait(), done[0].status());
  EXPECT_EQ(comm_->status(), done[0].status());
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(done[r].calls(), 1);
}

TEST_P(BackendFailureTest, AbortMidOpFailsPendingAndLaterOpsWithTheReason) {
  DoneRecorder done[kWorld];
  AllGather(0, 1, done[0].Callback());
  AllGather(1, 1, done[1].Callback());
  AllGather(2, 1, done[2].Callback());
  EXPECT_FALSE(done[0].done());
  const absl::Status reason = absl::UnavailableError("peer daemon node-b is down");
  comm_->Abort(reason);
  for (int r : {0, 1, 2}) EXPECT_EQ(done[r].Wait(), reason);
  AllGather(3, 1, done[3].Callback());
  EXPECT_EQ(done[3].Wait(), reason);
  // The first error wins.
  comm_->Abort(absl::InternalError("second"));
  EXPECT_EQ(comm_->status(), reason);
  DoneRecorder later;
  AllGather(0, 2, later.Callback());
  EXPECT_EQ(later.Wait(), reason);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(done[r].calls(), 1);
}

TEST_P(BackendFailureTest, AbortWithOkStatusBecomesAborted) {
  comm_->Abort(absl::OkStatus());
  EXPECT_TRUE(absl::IsAborted(comm_->status())) << comm_->status();
}

TEST_P(BackendFailureTest, CallbacksRunOnceAndMayCallBackIntoTheCommunicator) {
  // Each rank chains kOps ops from inside the previous op's callback and queries the
  // communicator there: this deadlocks if a callback runs under a backend lock.
  constexpr int kOps = 20;
  absl::Mutex mu;
  int calls[kWorld] = {};
  int finished = 0;
  std::function<void(int, uint64_t)> issue = [&](int r, uint64_t seq) {
    AllGather(r, seq, [&, r, seq](absl::Status s) {
      EXPECT_TRUE(s.ok()) << s;
      (void)comm_->status();
      (void)comm_->PendingOps();
      {
        absl::MutexLock lock(&mu);
        ++calls[r];
        if (seq == kOps) ++finished;
      }
      if (seq < kOps) issue(r, seq + 1);
    });
  };
  RunRanks(kWorld, [&](int r) { issue(r, 1); });
  absl::MutexLock lock(&mu);
  auto all_done = [&]() { return finished == kWorld; };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all_done), absl::Seconds(20)));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(calls[r], kOps);
  for (int r = 0; r < kWorld; ++r) {
    for (int k = 0; k < kWorld; ++k) EXPECT_EQ(out_[r][k * kShard], static_cast<float>(k));
  }
}

TEST_P(BackendFailureTest, PendingOpsShowArrivedAndMissingRanks) {
  DoneRecorder done[kWorld];
  OpOptions o = Opts(0, 1, 7);
  o.name = "unshard";
  comm_->AllGather(ConstBuffer{in_[0].data(), kShard * 4, DType::kFloat32},
                   MutableBuffer{out_[0].data(), kShard * kWorld * 4, DType::kFloat32}, o,
                   done[0].Callback());
  o.rank = 3;
  comm_->AllGather(ConstBuffer{in_[3].data(), kShard * 4, DType::kFloat32},
                   MutableBuffer{out_[3].data(), kShard * kWorld * 4, DType::kFloat32}, o,
                   done[3].Callback());
  std::vector<PendingOpInfo> pending = comm_->PendingOps();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending[0].op_seq, 1u);
  EXPECT_EQ(pending[0].kind, CollectiveKind::kAllGather);
  EXPECT_EQ(pending[0].unit, 7);
  EXPECT_EQ(pending[0].bytes, kShard * 4);
  EXPECT_EQ(pending[0].name, "unshard");
  EXPECT_THAT(pending[0].arrived_ranks, ::testing::ElementsAre(0, 3));
  EXPECT_THAT(pending[0].missing_ranks, ::testing::ElementsAre(1, 2));
  EXPECT_GE(pending[0].age, absl::ZeroDuration());
  EXPECT_FALSE(pending[0].running);
  for (int r : {1, 2}) {
    o.rank = r;
    comm_->AllGather(ConstBuffer{in_[r].data(), kShard * 4, DType::kFloat32},
                     MutableBuffer{out_[r].data(), kShard * kWorld * 4, DType::kFloat32}, o,
                     done[r].Callback());
  }
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(done[r].Wait().ok()) << done[r].status();
  EXPECT_TRUE(comm_->PendingOps().empty());
}

TEST_P(BackendFailureTest, BadArgumentsFailStickyWithInvalidArgument) {
  DoneRecorder first, bad, later;
  AllGather(0, 1, first.Callback());
  // Rank 1's output is one float short.
  comm_->AllGather(ConstBuffer{in_[1].data(), kShard * 4, DType::kFloat32},
                   MutableBuffer{out_[1].data(), kShard * kWorld * 4 - 4, DType::kFloat32},
                   Opts(1, 1), bad.Callback());
  absl::Status s = bad.Wait();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 op_seq 1 AllGather(unit 3"));
  EXPECT_EQ(first.Wait(), s);  // the waiting rank does not hang
  AllGather(2, 1, later.Callback());
  EXPECT_EQ(later.Wait(), s);
}

TEST_P(BackendFailureTest, UnknownRankFailsOnlyThatCall) {
  DoneRecorder bad;
  AllGather(0, 1, [](absl::Status) {});  // rank 0 waits; the comm is destroyed at the end
  comm_->AllGather(ConstBuffer{in_[0].data(), kShard * 4, DType::kFloat32},
                   MutableBuffer{out_[0].data(), kShard * kWorld * 4, DType::kFloat32},
                   Opts(kWorld, 1), bad.Callback());
  EXPECT_TRUE(absl::IsInvalidArgument(bad.Wait())) << bad.status();
  EXPECT_TRUE(comm_->status().ok()) << comm_->status();
}

TEST_P(BackendFailureTest, RepeatedOpSeqOnOneRankIsAnError) {
  DoneRecorder first, again;
  AllGather(0, 5, first.Callback());
  AllGather(0, 5, again.Callback());
  absl::Status s = again.Wait();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0 issued op_seq 5"));
  EXPECT_EQ(first.Wait(), s);
}

TEST_P(BackendFailureTest, DestroyingTheCommunicatorFailsPendingOps) {
  DoneRecorder done[2];
  AllGather(0, 1, done[0].Callback());
  AllGather(1, 1, done[1].Callback());
  comm_.reset();
  for (DoneRecorder& d : done) {
    EXPECT_TRUE(absl::IsAborted(d.Wait())) << d.status();
    EXPECT_EQ(d.calls(), 1);
  }
}

TEST_P(BackendFailureTest, ZeroByteOpsStillCheckFingerprints) {
  DoneRecorder done[kWorld];
  for (int r = 0; r < kWorld; ++r) {
    comm_->AllGather(ConstBuffer{nullptr, 0, DType::kFloat32},
                     MutableBuffer{nullptr, 0, DType::kFloat32}, Opts(r, 1, r == 3 ? 4 : 3),
                     done[r].Callback());
  }
  for (int r = 0; r < kWorld; ++r) {
    absl::Status s = done[r].Wait();
    EXPECT_TRUE(absl::IsAborted(s)) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("rank 0 called AllGather(unit 3, 0 bytes, float32) but rank 3 called "
                          "AllGather(unit 4, 0 bytes, float32)"));
  }
}

}  // namespace flatshard::collective::testing
