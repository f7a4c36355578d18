// The staging communicator over the real inproc backend, with a fake DeviceCopier that treats
// "kCuda" buffers as host memory and records every copy: the conformance and failure suites
// with every buffer device-kind (world sizes 1..4), the same with host buffers over a
// device-kind inner communicator, and the copies each shape makes (in place, shared outputs,
// Gather, Broadcast, ReduceScatter into its input, pass-through), failing copies and
// allocations, staging-buffer reuse and per-rank devices.

#include "server/collective/staging/staging_communicator.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_backend.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {
namespace {

using ::testing::Combine;
using ::testing::HasSubstr;
using ::testing::Range;
using ::testing::Values;
using ::testing::ValuesIn;

struct CopyRecord {
  void* dst;
  MemoryKind dst_kind;
  const void* src;
  MemoryKind src_kind;
  size_t bytes;
  int device;
};

// Staging buffers are malloc'd host memory (filled with 0xcd); copies are memcpy.
class FakeCopier : public DeviceCopier {
 public:
  absl::StatusOr<std::shared_ptr<void>> AllocateStaging(MemoryKind kind, int device,
                                                        size_t bytes) override {
    absl::MutexLock lock(&mu_);
    if (fail_alloc_) return absl::ResourceExhaustedError("fake: no pinned memory left");
    ++allocations_;
    kinds_.push_back(kind);
    devices_.push_back(device);
    void* p = std::malloc(bytes);
    std::memset(p, 0xcd, bytes);
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
  absl::Status Copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind,
                    size_t bytes, int device) override {
    CopyRecord r{dst, dst_kind, src, src_kind, bytes, device};
    {
      absl::MutexLock lock(&mu_);
      if (fail_ && fail_(r)) return absl::InternalError("fake: copy failed");
      copies_.push_back(r);
    }
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  void FailCopiesWhere(std::function<bool(const CopyRecord&)> f) {
    absl::MutexLock lock(&mu_);
    fail_ = std::move(f);
  }
  void FailAllocations() {
    absl::MutexLock lock(&mu_);
    fail_alloc_ = true;
  }
  std::vector<CopyRecord> copies() const {
    absl::MutexLock lock(&mu_);
    return copies_;
  }
  void ClearCopies() {
    absl::MutexLock lock(&mu_);
    copies_.clear();
  }
  int allocations() const {
    absl::MutexLock lock(&mu_);
    return allocations_;
  }
  std::vector<MemoryKind> kinds() const {
    absl::MutexLock lock(&mu_);
    return kinds_;
  }
  std::vector<int> devices() const {
    absl::MutexLock lock(&mu_);
    return devices_;
  }

 private:
  mutable absl::Mutex mu_;
  std::function<bool(const CopyRecord&)> fail_ ABSL_GUARDED_BY(mu_);
  bool fail_alloc_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<CopyRecord> copies_ ABSL_GUARDED_BY(mu_);
  int allocations_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<MemoryKind> kinds_ ABSL_GUARDED_BY(mu_);
  std::vector<int> devices_ ABSL_GUARDED_BY(mu_);
};

// Hands every buffer to `inner` as `kind`: lets the shared conformance suites, which use host
// vectors, run with device-kind buffers.
class AsKind final : public Communicator {
 public:
  AsKind(std::unique_ptr<Communicator> inner, MemoryKind kind)
      : inner_(std::move(inner)), kind_(kind) {}
  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& o, DoneCallback d) override {
    in.kind = out.kind = kind_;
    inner_->AllGather(in, out, o, std::move(d));
  }
  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& o,
                     DoneCallback d) override {
    in.kind = out.kind = kind_;
    inner_->ReduceScatter(in, out, op, o, std::move(d));
  }
  void Broadcast(MutableBuffer buf, int root, const OpOptions& o, DoneCallback d) override {
    buf.kind = kind_;
    inner_->Broadcast(buf, root, o, std::move(d));
  }
  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& o,
              DoneCallback d) override {
    in.kind = out.kind = kind_;
    inner_->Gather(in, out, root, o, std::move(d));
  }
  void Abort(absl::Status reason) override { inner_->Abort(std::move(reason)); }
  absl::Status status() const override { return inner_->status(); }
  std::vector<PendingOpInfo> PendingOps() const override { return inner_->PendingOps(); }

 private:
  std::unique_ptr<Communicator> inner_;
  const MemoryKind kind_;
};

CollectiveBackend& SharedInproc() {
  static CollectiveBackend* backend = CreateInprocBackend().value().release();
  return *backend;
}

absl::StatusOr<std::unique_ptr<Communicator>> Staged(const GroupSpec& spec, MemoryKind inner_kind,
                                                     MemoryKind buffer_kind,
                                                     std::shared_ptr<DeviceCopier> copier) {
  absl::StatusOr<std::unique_ptr<Communicator>> inner = SharedInproc().Connect(spec);
  if (!inner.ok()) return inner.status();
  // inproc refuses device memory: over a device-kind inner it sees the fake device staging
  // buffers (host memory) as host buffers.
  if (inner_kind == MemoryKind::kCuda) {
    *inner = std::make_unique<AsKind>(*std::move(inner), MemoryKind::kHost);
  }
  return std::unique_ptr<Communicator>(std::make_unique<AsKind>(
      MakeStagingCommunicator(*std::move(inner), inner_kind, spec, std::move(copier)),
      buffer_kind));
}

// Device buffers over the host inproc backend (the UCX/inproc case).
const BackendUnderTest kDeviceOverHost{"DeviceBuffersOverHostInner", [](const GroupSpec& g) {
                                         return Staged(g, MemoryKind::kHost, MemoryKind::kCuda,
                                                       std::make_shared<FakeCopier>());
                                       }};
// Host buffers over a device-kind inner communicator (the NCCL case; inproc moves the fake
// "device" staging buffers).
const BackendUnderTest kHostOverDevice{"HostBuffersOverDeviceInner", [](const GroupSpec& g) {
                                         return Staged(g, MemoryKind::kCuda, MemoryKind::kHost,
                                                       std::make_shared<FakeCopier>());
                                       }};

INSTANTIATE_TEST_SUITE_P(Staging, BackendConformanceTest,
                         Combine(Values(&kDeviceOverHost), Range(1, 5), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(StagingToDevice, BackendConformanceTest,
                         Combine(Values(&kHostOverDevice), Values(1, 3),
                                 Values(ShardSize::kOneElement, ShardSize::k4097Elements)),
                         ConformanceName);
// The NCCL layout: host buffers over a device-kind inner, one rank per GPU.
const BackendUnderTest kHostOverDevicePerGpu{
    "HostBuffersOverDeviceInnerOneRankPerGpu", [](const GroupSpec& g) {
      GroupSpec spec = g;
      for (int r = 0; r < g.world_size; ++r) {
        spec.local_devices.push_back(r);
      }
      return Staged(spec, MemoryKind::kCuda, MemoryKind::kHost, std::make_shared<FakeCopier>());
    }};

INSTANTIATE_TEST_SUITE_P(Staging, BackendFailureTest, Values(&kDeviceOverHost, &kHostOverDevice),
                         FailureName);
INSTANTIATE_TEST_SUITE_P(StagingToDevicePerGpu, BackendConformanceTest,
                         Combine(Values(&kHostOverDevicePerGpu), Values(3),
                                 Values(ShardSize::kOneElement, ShardSize::k4097Elements)),
                         ConformanceName);

// --- Copies per shape ------------------------------------------------------------------------

constexpr int kWorld = 4;
constexpr size_t kS = 1000;  // floats per shard

class StagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = GroupSpec::AllLocal("staging", kWorld);
    spec_.local_devices = {4, 5, 6, 7};
    auto inner = SharedInproc().Connect(spec_);
    ASSERT_TRUE(inner.ok()) << inner.status();
    comm_ = MakeStagingCommunicator(*std::move(inner), MemoryKind::kHost, spec_, copier_);
  }

  // Runs op(r, done) on every rank's thread; returns each rank's status.
  std::vector<absl::Status> Run(const std::function<void(int, DoneCallback)>& op) {
    std::vector<::flatshard::testing::DoneRecorder> done(kWorld);
    ::flatshard::testing::RunRanks(kWorld, [&](int r) {
      op(r, done[r].Callback());
      (void)done[r].Wait();
    });
    std::vector<absl::Status> out;
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(done[r].calls(), 1) << "rank " << r;
      out.push_back(done[r].status());
    }
    return out;
  }

  static ConstBuffer Dev(const std::vector<float>& v, size_t offset = 0, size_t n = 0) {
    return ConstBuffer{v.data() + offset, (n == 0 ? v.size() - offset : n) * 4, DType::kFloat32,
                       MemoryKind::kCuda};
  }
  static MutableBuffer DevOut(std::vector<float>& v) {
    return MutableBuffer{v.data(), v.size() * 4, DType::kFloat32, MemoryKind::kCuda};
  }
  int CopiesInto(MemoryKind dst_kind) const {
    int n = 0;
    for (const CopyRecord& c : copier_->copies()) n += c.dst_kind == dst_kind;
    return n;
  }

  GroupSpec spec_;
  std::shared_ptr<FakeCopier> copier_ = std::make_shared<FakeCopier>();
  std::unique_ptr<Communicator> comm_;
  std::vector<float> in_[kWorld];
};

std::vector<float> Shard(int r, size_t n = kS) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = ShardValue(r, i);
  return v;
}

TEST_F(StagingTest, AllGatherSeparateOutputsCopyEachShardInAndEachOutputOutOnce) {
  std::vector<std::vector<float>> in(kWorld), out(kWorld, std::vector<float>(kS * kWorld, -1));
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->AllGather(Dev(in[r]), DevOut(out[r]), Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int r = 0; r < kWorld; ++r) {
    for (int k = 0; k < kWorld; ++k) ASSERT_TRUE(BlockHolds(out[r].data() + k * kS, k, kS));
  }
  std::vector<CopyRecord> copies = copier_->copies();
  ASSERT_EQ(copies.size(), 2u * kWorld);
  int in_copies = 0, out_copies = 0;
  for (const CopyRecord& c : copies) {
    if (c.dst_kind == MemoryKind::kHostPinned) {
      EXPECT_EQ(c.src_kind, MemoryKind::kCuda);
      EXPECT_EQ(c.bytes, kS * 4);
      ++in_copies;
    } else {
      EXPECT_EQ(c.dst_kind, MemoryKind::kCuda);
      EXPECT_EQ(c.src_kind, MemoryKind::kHostPinned);
      EXPECT_EQ(c.bytes, kS * 4 * kWorld);
      ++out_copies;
    }
  }
  EXPECT_EQ(in_copies, kWorld);
  EXPECT_EQ(out_copies, kWorld);
}

TEST_F(StagingTest, SharedOutputIsStagedAndCopiedOutOnce) {
  std::vector<std::vector<float>> in(kWorld);
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  std::vector<float> shared(kS * kWorld, -1);
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->AllGather(Dev(in[r]), DevOut(shared), Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int k = 0; k < kWorld; ++k) ASSERT_TRUE(BlockHolds(shared.data() + k * kS, k, kS));
  EXPECT_EQ(CopiesInto(MemoryKind::kHostPinned), kWorld);
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), 1);
}

TEST_F(StagingTest, InPlaceSharedOutputCopiesEachSlotInAndTheWholeOutOnce) {
  std::vector<float> shared(kS * kWorld);
  for (int k = 0; k < kWorld; ++k) {
    for (size_t i = 0; i < kS; ++i) shared[k * kS + i] = ShardValue(k, i);
  }
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->AllGather(Dev(shared, r * kS, kS), DevOut(shared), Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int k = 0; k < kWorld; ++k) ASSERT_TRUE(BlockHolds(shared.data() + k * kS, k, kS));
  std::vector<CopyRecord> copies = copier_->copies();
  ASSERT_EQ(copies.size(), kWorld + 1u);
  for (const CopyRecord& c : copies) {
    if (c.dst_kind == MemoryKind::kHostPinned) {
      EXPECT_EQ(c.bytes, kS * 4);  // each slot, into its slot of the one staging buffer
    } else {
      EXPECT_EQ(c.bytes, kS * 4 * kWorld);
      EXPECT_EQ(c.dst, shared.data());
    }
  }
}

TEST_F(StagingTest, BroadcastCopiesInOnRootAndOutOnOtherRanks) {
  std::vector<std::vector<float>> buf(kWorld, std::vector<float>(kS, -1));
  buf[2] = Shard(2);
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->Broadcast(DevOut(buf[r]), 2, Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(BlockHolds(buf[r].data(), 2, kS)) << r;
  EXPECT_EQ(CopiesInto(MemoryKind::kHostPinned), 1);
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), kWorld - 1);
  for (const CopyRecord& c : copier_->copies()) {
    if (c.dst_kind == MemoryKind::kCuda) {
      EXPECT_NE(c.dst, buf[2].data()) << "root copied out";
    }
  }
  // One buffer shared by every rank: one copy in, one copy out.
  copier_->ClearCopies();
  std::vector<float> shared = Shard(1);
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->Broadcast(DevOut(shared), 1, Opts(r, 2), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  ASSERT_TRUE(BlockHolds(shared.data(), 1, kS));
  EXPECT_EQ(CopiesInto(MemoryKind::kHostPinned), 1);
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), 1);
}

TEST_F(StagingTest, GatherStagesOnlyRootsOutput) {
  std::vector<std::vector<float>> in(kWorld);
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  std::vector<float> full(kS * kWorld, -1);
  std::vector<float> ignored(kS * kWorld, -7);  // non-root ranks pass it: never touched
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->Gather(Dev(in[r]), DevOut(r == 3 ? full : ignored), 3, Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int k = 0; k < kWorld; ++k) ASSERT_TRUE(BlockHolds(full.data() + k * kS, k, kS));
  for (float f : ignored) ASSERT_EQ(f, -7);
  EXPECT_EQ(CopiesInto(MemoryKind::kHostPinned), kWorld);
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), 1);
  // Non-root ranks with an empty output work too.
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         MutableBuffer out{nullptr, 0, DType::kFloat32, MemoryKind::kCuda};
         if (r == 0) out = DevOut(full);
         comm_->Gather(Dev(in[r]), out, 0, Opts(r, 2), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST_F(StagingTest, ReduceScatterIntoItsOwnSliceOfTheInput) {
  std::vector<std::vector<float>> in(kWorld, std::vector<float>(kS * kWorld));
  for (int r = 0; r < kWorld; ++r) {
    for (size_t j = 0; j < in[r].size(); ++j) in[r][j] = static_cast<float>(ReduceInput(r, j));
  }
  const std::vector<std::vector<float>> before = in;
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         MutableBuffer out{in[r].data() + r * kS, kS * 4, DType::kFloat32, MemoryKind::kCuda};
         comm_->ReduceScatter(Dev(in[r]), out, ReduceOp::kSum, Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int r = 0; r < kWorld; ++r) {
    for (size_t j = 0; j < in[r].size(); ++j) {
      const size_t slot = j / kS;
      float want = before[r][j];
      if (slot == static_cast<size_t>(r)) {
        int sum = 0;
        for (int k = 0; k < kWorld; ++k) sum += ReduceInput(k, j);
        want = static_cast<float>(sum);
      }
      ASSERT_EQ(in[r][j], want) << "rank " << r << " element " << j;
    }
  }
  EXPECT_EQ(CopiesInto(MemoryKind::kHostPinned), kWorld);  // W*S each
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), kWorld);        // S each, into the slice
  for (const CopyRecord& c : copier_->copies()) {
    EXPECT_EQ(c.bytes, c.dst_kind == MemoryKind::kCuda ? kS * 4 : kS * 4 * kWorld);
  }
}

TEST_F(StagingTest, PassThroughBuffersMakeNoCopiesAndNoStaging) {
  for (MemoryKind kind : {MemoryKind::kHost, MemoryKind::kHostPinned}) {
    SCOPED_TRACE(MemoryKindName(kind));
    const uint64_t base = kind == MemoryKind::kHost ? 0 : 10;
    std::vector<std::vector<float>> in(kWorld), out(kWorld, std::vector<float>(kS * kWorld));
    for (int r = 0; r < kWorld; ++r) in[r] = Shard(r, kS * kWorld);
    for (const absl::Status& s : Run([&](int r, DoneCallback d) {
           ConstBuffer i{in[r].data(), kS * 4, DType::kFloat32, kind};
           MutableBuffer o{out[r].data(), kS * kWorld * 4, DType::kFloat32, kind};
           comm_->AllGather(
               i, o, Opts(r, base + 1), [&, r, i, o, d = std::move(d)](absl::Status s) mutable {
                 if (!s.ok()) return d(s);
                 ConstBuffer full{in[r].data(), kS * kWorld * 4, DType::kFloat32, kind};
                 MutableBuffer shard{out[r].data(), kS * 4, DType::kFloat32, kind};
                 comm_->ReduceScatter(
                     full, shard, ReduceOp::kSum, Opts(r, base + 2),
                     [&, r, o, d = std::move(d)](absl::Status s) mutable {
                       if (!s.ok()) return d(s);
                       comm_->Broadcast(
                           o, 0, Opts(r, base + 3),
                           [&, r, o, d = std::move(d)](absl::Status s) mutable {
                             if (!s.ok()) return d(s);
                             comm_->Gather(ConstBuffer{in[r].data(), kS * 4, DType::kFloat32, kind},
                                           r == 0 ? o : MutableBuffer{}, 0, Opts(r, base + 4),
                                           std::move(d));
                           });
                     });
               });
         })) {
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  EXPECT_TRUE(copier_->copies().empty());
  EXPECT_EQ(copier_->allocations(), 0);
}

TEST_F(StagingTest, OnlyTheUnreachableBufferIsStaged) {
  std::vector<std::vector<float>> in(kWorld), out(kWorld, std::vector<float>(kS * kWorld, -1));
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->AllGather(ConstBuffer{in[r].data(), kS * 4, DType::kFloat32, MemoryKind::kHost},
                          DevOut(out[r]), Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int r = 0; r < kWorld; ++r) {
    for (int k = 0; k < kWorld; ++k) ASSERT_TRUE(BlockHolds(out[r].data() + k * kS, k, kS));
  }
  EXPECT_EQ(CopiesInto(MemoryKind::kHostPinned), 0);
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), kWorld);
}

TEST_F(StagingTest, StagingBuffersAreReusedAcrossOpsOnTheRanksDevices) {
  std::vector<std::vector<float>> in(kWorld), out(kWorld, std::vector<float>(kS * kWorld));
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  int after_first = 0;
  for (uint64_t seq = 1; seq <= 10; ++seq) {
    for (const absl::Status& s : Run([&](int r, DoneCallback d) {
           comm_->AllGather(Dev(in[r]), DevOut(out[r]), Opts(r, seq), std::move(d));
         })) {
      ASSERT_TRUE(s.ok()) << s;
    }
    if (seq == 1) after_first = copier_->allocations();
  }
  EXPECT_LE(after_first, 2 * kWorld);
  EXPECT_EQ(copier_->allocations(), after_first);
  for (MemoryKind k : copier_->kinds()) EXPECT_EQ(k, MemoryKind::kHostPinned);
  for (int d : copier_->devices())
    EXPECT_THAT(d, ::testing::AllOf(::testing::Ge(4), ::testing::Le(7)));
  for (const CopyRecord& c : copier_->copies()) {
    // Each copy runs on the device of the rank whose buffer it is.
    for (int r = 0; r < kWorld; ++r) {
      if (c.src == in[r].data() || c.dst == out[r].data()) {
        EXPECT_EQ(c.device, 4 + r);
      }
    }
  }
}

TEST_F(StagingTest, FailingCopyInFailsEveryRankAndLeavesOutputsUntouched) {
  std::vector<std::vector<float>> in(kWorld), out(kWorld, std::vector<float>(kS * kWorld, -1));
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  const void* bad = in[2].data();
  copier_->FailCopiesWhere([bad](const CopyRecord& c) { return c.src == bad; });
  std::vector<absl::Status> st = Run([&](int r, DoneCallback d) {
    comm_->AllGather(Dev(in[r]), DevOut(out[r]), Opts(r, 1), std::move(d));
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(absl::IsInternal(st[r])) << "rank " << r << ": " << st[r];
    EXPECT_THAT(std::string(st[r].message()), HasSubstr("copying in 4000 bytes of cuda memory "
                                                        "(device 6): fake: copy failed"));
    for (float f : out[r]) ASSERT_EQ(f, -1) << "rank " << r << " output was written";
  }
  EXPECT_EQ(CopiesInto(MemoryKind::kCuda), 0);
  EXPECT_EQ(comm_->status(), st[0]);  // sticky
  ::flatshard::testing::DoneRecorder later;
  comm_->AllGather(Dev(in[0]), DevOut(out[0]), Opts(0, 2), later.Callback());
  EXPECT_EQ(later.Wait(), st[0]);
}

TEST_F(StagingTest, FailingCopyOutFailsThatRankAndLaterOps) {
  std::vector<std::vector<float>> in(kWorld), out(kWorld, std::vector<float>(kS * kWorld, -1));
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  const void* bad = out[1].data();
  copier_->FailCopiesWhere([bad](const CopyRecord& c) { return c.dst == bad; });
  std::vector<absl::Status> st = Run([&](int r, DoneCallback d) {
    comm_->AllGather(Dev(in[r]), DevOut(out[r]), Opts(r, 1), std::move(d));
  });
  for (int r = 0; r < kWorld; ++r) {
    if (r == 1) {
      EXPECT_TRUE(absl::IsInternal(st[r])) << st[r];
      EXPECT_THAT(std::string(st[r].message()),
                  HasSubstr("copying out the 16000-byte output: fake"));
    } else {
      EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
    }
  }
  EXPECT_EQ(comm_->status(), st[1]);  // sticky from the next call on
  ::flatshard::testing::DoneRecorder later;
  comm_->AllGather(Dev(in[0]), DevOut(out[0]), Opts(0, 2), later.Callback());
  EXPECT_EQ(later.Wait(), st[1]);
}

TEST_F(StagingTest, FailingSharedCopyOutFailsEveryRankSharingIt) {
  std::vector<std::vector<float>> in(kWorld);
  for (int r = 0; r < kWorld; ++r) in[r] = Shard(r);
  std::vector<float> shared(kS * kWorld, -1);
  copier_->FailCopiesWhere([](const CopyRecord& c) { return c.dst_kind == MemoryKind::kCuda; });
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->AllGather(Dev(in[r]), DevOut(shared), Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(absl::IsInternal(s)) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("copying out the 16000-byte output (shared by 4 ranks): fake"));
  }
}

TEST_F(StagingTest, FailingStagingAllocationFailsEveryRank) {
  copier_->FailAllocations();
  std::vector<std::vector<float>> buf(kWorld, std::vector<float>(kS, -1));
  for (const absl::Status& s : Run([&](int r, DoneCallback d) {
         comm_->Broadcast(DevOut(buf[r]), 0, Opts(r, 1), std::move(d));
       })) {
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("fake: no pinned memory left"));
  }
}

TEST_F(StagingTest, DestroyingTheCommunicatorFailsStagedPendingOps) {
  std::vector<float> in = Shard(0), out(kS * kWorld, -1);
  ::flatshard::testing::DoneRecorder done;
  comm_->AllGather(Dev(in), DevOut(out), Opts(0, 1), done.Callback());
  comm_.reset();
  EXPECT_TRUE(absl::IsAborted(done.Wait())) << done.status();
  EXPECT_EQ(done.calls(), 1);
  for (float f : out) ASSERT_EQ(f, -1);
}

// NCCL ranks live on different GPUs and cannot share a device buffer: a host buffer the ranks
// share is staged once per GPU, and still copied out once.
TEST(StagingPerGpuTest, ASharedHostBufferGetsOneStagingBufferPerGpuAndOneCopyOut) {
  constexpr int kRanks = 3;
  GroupSpec spec = GroupSpec::AllLocal("per-gpu", kRanks);
  spec.local_devices = {0, 1, 2};
  auto run = [&](const std::function<void(Communicator&, int, DoneCallback)>& op,
                 FakeCopier& copier) {
    auto comm = Staged(spec, MemoryKind::kCuda, MemoryKind::kHost,
                       std::shared_ptr<DeviceCopier>(&copier, [](DeviceCopier*) {}));
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::vector<::flatshard::testing::DoneRecorder> done(kRanks);
    ::flatshard::testing::RunRanks(kRanks, [&](int r) { op(**comm, r, done[r].Callback()); });
    for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(done[r].Wait().ok()) << done[r].status();
  };
  auto per_device = [](const FakeCopier& copier, int device) {
    std::vector<int> d = copier.devices();
    return std::count(d.begin(), d.end(), device);
  };
  auto copies_into = [](const FakeCopier& copier, MemoryKind kind) {
    int n = 0;
    for (const CopyRecord& c : copier.copies()) n += c.dst_kind == kind;
    return n;
  };
  {
    std::vector<std::vector<float>> in(kRanks);
    for (int r = 0; r < kRanks; ++r) in[r] = Shard(r);
    std::vector<float> shared(kS * kRanks, -1);
    FakeCopier copier;
    run(
        [&](Communicator& comm, int r, DoneCallback d) {
          comm.AllGather(ConstBuffer{in[r].data(), kS * 4, DType::kFloat32},
                         MutableBuffer{shared.data(), shared.size() * 4, DType::kFloat32},
                         Opts(r, 1), std::move(d));
        },
        copier);
    for (int k = 0; k < kRanks; ++k) ASSERT_TRUE(BlockHolds(shared.data() + k * kS, k, kS));
    // Per GPU: the rank's input and its copy of the shared output.
    for (int d = 0; d < kRanks; ++d) EXPECT_EQ(per_device(copier, d), 2) << "device " << d;
    EXPECT_EQ(copies_into(copier, MemoryKind::kCuda), kRanks);  // the inputs
    EXPECT_EQ(copies_into(copier, MemoryKind::kHost), 1);       // the shared output, once
  }
  {
    std::vector<float> shared = Shard(1);
    FakeCopier copier;
    run(
        [&](Communicator& comm, int r, DoneCallback d) {
          comm.Broadcast(MutableBuffer{shared.data(), shared.size() * 4, DType::kFloat32}, 1,
                         Opts(r, 1), std::move(d));
        },
        copier);
    ASSERT_TRUE(BlockHolds(shared.data(), 1, kS));
    for (int d = 0; d < kRanks; ++d) EXPECT_EQ(per_device(copier, d), 1) << "device " << d;
    EXPECT_EQ(copies_into(copier, MemoryKind::kCuda), 1);  // root's, onto its GPU
    EXPECT_EQ(copies_into(copier, MemoryKind::kHost), 1);
  }
}

TEST(CudaDeviceCopierTest, FailsCleanlyWithoutAGpu) {
  std::shared_ptr<DeviceCopier> copier = MakeCudaDeviceCopier();
  absl::StatusOr<std::shared_ptr<void>> buf = copier->AllocateStaging(MemoryKind::kCuda, 0, 4096);
  if (buf.ok()) GTEST_SKIP() << "a GPU is present; gpu_device_test covers it";
  EXPECT_TRUE(absl::IsFailedPrecondition(buf.status())) << buf.status();
  int a = 1, b = 2;
  absl::Status s = copier->Copy(&a, MemoryKind::kHost, &b, MemoryKind::kCuda, sizeof(a), 0);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(a, 1);
}

}  // namespace
}  // namespace flatshard::collective::testing
