// The UCX backend. Several UcxBackend instances in one process stand in for daemons (each
// has its own UCX worker, so remote ranks really go through UCX: shared memory, CMA or TCP
// between the workers, and messages >= 256 KiB by same-host copy, which then reads this very
// process); one test runs a second process so cross-process transports are exercised too.
//
// The shared conformance suites see one Communicator for all ranks; SplitCommunicator
// provides it over one Communicator per daemon and, like the daemons' group manager, aborts
// every daemon's communicator with the first sticky error any of them reports.

#include "server/collective/ucx/ucx_backend.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/ring_algorithms.h"
#include "server/collective/ucx/ucx_address.h"
#include "server/collective/ucx/ucx_tag.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

extern char** environ;

namespace flatshard::collective::testing {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::flatshard::testing::RunRanks;
using ::testing::Combine;
using ::testing::HasSubstr;
using ::testing::Values;
using ::testing::ValuesIn;

std::unique_ptr<CollectiveBackend> NewBackend(UcxBackendOptions options = {}) {
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = CreateUcxBackend(options);
  FS_CHECK(b.ok()) << b.status();
  return *std::move(b);
}

UcxBackendStats StatsOf(CollectiveBackend& b) {
  absl::StatusOr<UcxBackendStats> s = dynamic_cast<UcxBackend&>(b).Stats();
  FS_CHECK(s.ok()) << s.status();
  return *s;
}

// Three daemons shared by the tests that do not destroy backends (like the daemons of a
// long-running job, they see many groups come and go).
std::vector<CollectiveBackend*>& Daemons() {
  static auto* daemons = new std::vector<CollectiveBackend*>{
      NewBackend().release(), NewBackend().release(), NewBackend().release()};
  return *daemons;
}

uint64_t NextEpoch() {
  static std::atomic<uint64_t> epoch{1};
  return epoch++;
}

// The spec daemon `d` gets when rank r lives on daemons[layout[r]].
GroupSpec SpecFor(const std::string& group, uint64_t epoch, const std::vector<int>& layout,
                  const std::vector<CollectiveBackend*>& daemons, int d) {
  GroupSpec spec;
  spec.group_id = group;
  spec.epoch = epoch;
  spec.world_size = static_cast<int>(layout.size());
  for (int r = 0; r < spec.world_size; ++r) {
    spec.rank_addresses.push_back(daemons[layout[r]]->LocalAddress());
    if (layout[r] == d) spec.local_ranks.push_back(r);
  }
  return spec;
}

// One Communicator per daemon that hosts a rank of the layout (index = daemon).
std::vector<std::unique_ptr<Communicator>> ConnectAll(
    const std::string& group, uint64_t epoch, const std::vector<int>& layout,
    const std::vector<CollectiveBackend*>& daemons) {
  std::vector<std::unique_ptr<Communicator>> comms(daemons.size());
  for (size_t d = 0; d < daemons.size(); ++d) {
    GroupSpec spec = SpecFor(group, epoch, layout, daemons, static_cast<int>(d));
    if (spec.local_ranks.empty()) continue;
    absl::StatusOr<std::unique_ptr<Communicator>> c = daemons[d]->Connect(spec);
    FS_CHECK(c.ok()) << c.status();
    comms[d] = *std::move(c);
  }
  return comms;
}

// One Communicator over the per-daemon ones: routes each op to the daemon hosting its rank
// and propagates the first sticky error to every daemon (the group manager's job).
class SplitCommunicator final : public Communicator {
 public:
  SplitCommunicator(std::vector<std::unique_ptr<Communicator>> comms, std::vector<int> layout)
      : shared_(std::make_shared<Shared>()), layout_(std::move(layout)) {
    for (auto& c : comms) shared_->comms.push_back(std::shared_ptr<Communicator>(std::move(c)));
  }
  ~SplitCommunicator() override {
    std::vector<std::shared_ptr<Communicator>> comms;
    {
      absl::MutexLock lock(&shared_->mu);
      shared_->dead = true;
      comms.swap(shared_->comms);
    }
  }

  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& o,
                 DoneCallback done) override {
    For(o.rank)->AllGather(in, out, o, Wrap(o.rank, std::move(done)));
  }
  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& o,
                     DoneCallback done) override {
    For(o.rank)->ReduceScatter(in, out, op, o, Wrap(o.rank, std::move(done)));
  }
  void Broadcast(MutableBuffer buf, int root, const OpOptions& o, DoneCallback done) override {
    For(o.rank)->Broadcast(buf, root, o, Wrap(o.rank, std::move(done)));
  }
  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& o,
              DoneCallback done) override {
    For(o.rank)->Gather(in, out, root, o, Wrap(o.rank, std::move(done)));
  }
  void Abort(absl::Status reason) override {
    for (auto& c : Comms()) {
      if (c != nullptr) c->Abort(reason);
    }
  }
  absl::Status status() const override {
    for (auto& c : Comms()) {
      if (c != nullptr && !c->status().ok()) return c->status();
    }
    return absl::OkStatus();
  }
  // Merged by op_seq: a rank arrived if any daemon saw it.
  std::vector<PendingOpInfo> PendingOps() const override {
    std::map<uint64_t, PendingOpInfo> merged;
    std::map<uint64_t, std::vector<bool>> arrived;
    const int world = static_cast<int>(layout_.size());
    for (auto& c : Comms()) {
      if (c == nullptr) continue;
      for (const PendingOpInfo& p : c->PendingOps()) {
        auto [it, fresh] = merged.emplace(p.op_seq, p);
        std::vector<bool>& a = arrived[p.op_seq];
        a.resize(world);
        if (!fresh) {
          it->second.running = it->second.running || p.running;
          it->second.age = std::max(it->second.age, p.age);
        }
        for (int r : p.arrived_ranks) a[r] = true;
      }
    }
    std::vector<PendingOpInfo> out;
    for (auto& [seq, p] : merged) {
      p.arrived_ranks.clear();
      p.missing_ranks.clear();
      for (int r = 0; r < world; ++r) {
        (p.running || arrived[seq][r] ? p.arrived_ranks : p.missing_ranks).push_back(r);
      }
      out.push_back(p);
    }
    return out;
  }

 private:
  struct Shared {
    absl::Mutex mu;
    bool dead ABSL_GUARDED_BY(mu) = false;
    std::vector<std::shared_ptr<Communicator>> comms ABSL_GUARDED_BY(mu);
  };

  std::vector<std::shared_ptr<Communicator>> Comms() const {
    absl::MutexLock lock(&shared_->mu);
    return shared_->comms;
  }
  // Ranks outside the world go to the first daemon, which refuses them.
  std::shared_ptr<Communicator> For(int rank) {
    std::vector<std::shared_ptr<Communicator>> comms = Comms();
    int d = rank >= 0 && rank < static_cast<int>(layout_.size()) ? layout_[rank] : 0;
    return comms.at(d);
  }
  DoneCallback Wrap(int rank, DoneCallback done) {
    const int d = rank >= 0 && rank < static_cast<int>(layout_.size()) ? layout_[rank] : 0;
    return [shared = shared_, d, done = std::move(done)](absl::Status s) mutable {
      if (!s.ok()) {
        std::vector<std::shared_ptr<Communicator>> comms;
        {
          absl::MutexLock lock(&shared->mu);
          if (!shared->dead) comms = shared->comms;
        }
        // Only sticky errors travel (a bad rank fails just its call).
        if (!comms.empty() && !comms[d]->status().ok()) {
          for (auto& c : comms) {
            if (c != nullptr) c->Abort(comms[d]->status());
          }
        }
      }
      std::move(done)(std::move(s));
    };
  }

  std::shared_ptr<Shared> shared_;
  const std::vector<int> layout_;
};

// Rank r lives on daemon layout(world)[r].
BackendUnderTest SplitBackend(std::string name, std::function<std::vector<int>(int)> layout) {
  return BackendUnderTest{
      std::move(name),
      [layout](const GroupSpec& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
        std::vector<int> l = layout(g.world_size);
        return std::make_unique<SplitCommunicator>(
            ConnectAll(g.group_id, NextEpoch(), l, Daemons()), l);
      }};
}

// Two daemons, lower half of the ranks on the first: 1+1, 2+1, 2+2.
const BackendUnderTest kTwoDaemons = SplitBackend("UcxTwoDaemons", [](int world) {
  std::vector<int> l(world);
  for (int r = 0; r < world; ++r) l[r] = r < (world + 1) / 2 ? 0 : 1;
  return l;
});
// Three daemons with 1, 1 and the remaining ranks: 1+1+2 for world 4.
const BackendUnderTest kThreeDaemons = SplitBackend("UcxThreeDaemons", [](int world) {
  std::vector<int> l(world);
  for (int r = 0; r < world; ++r) l[r] = std::min(r, 2);
  return l;
});

INSTANTIATE_TEST_SUITE_P(UcxTwoDaemons, BackendConformanceTest,
                         Combine(Values(&kTwoDaemons), Values(2, 3, 4), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(UcxThreeDaemons, BackendConformanceTest,
                         Combine(Values(&kThreeDaemons), Values(4), ValuesIn(AllShardSizes())),
                         ConformanceName);
// World 4 and 6 with rank r on daemon r % 2: hierarchical across interleaved placements (the
// world-4 case of kTwoDaemons, ranks 0,1 | 2,3, is hierarchical too).
const BackendUnderTest kInterleaved = SplitBackend("UcxInterleaved", [](int world) {
  std::vector<int> l(world);
  for (int r = 0; r < world; ++r) l[r] = r % 2;
  return l;
});
INSTANTIATE_TEST_SUITE_P(UcxInterleaved, BackendConformanceTest,
                         Combine(Values(&kInterleaved), Values(4, 6), ValuesIn(AllShardSizes())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(Ucx, BackendFailureTest,
                         Values(&kTwoDaemons, &kThreeDaemons, &kInterleaved), FailureName);

// --- What only the UCX backend promises ----------------------------------------------------

TEST(UcxBackendTest, CommunicatorsNameTheUcxBackendForTheMetrics) {
  std::vector<std::unique_ptr<Communicator>> comms =
      ConnectAll("label", NextEpoch(), {0, 1}, Daemons());
  int connected = 0;
  for (const std::unique_ptr<Communicator>& c : comms) {
    if (c == nullptr) continue;
    ++connected;
    EXPECT_EQ(c->backend_name(), "ucx");  // a ring over UCX, not the ring's default
  }
  EXPECT_EQ(connected, 2);
}

TEST(UcxTagTest, FieldsLandInTheirBits) {
  const uint16_t h = ucx::GroupTagHash("g", 7);
  const uint64_t tag = ucx::MakeTag(h, 1023, 5, MessageTag{0x12345, 3});
  EXPECT_EQ(tag >> 48, h);
  EXPECT_EQ((tag >> 38) & 0x3FF, 1023u);
  EXPECT_EQ((tag >> 28) & 0x3FF, 5u);
  EXPECT_EQ((tag >> 12) & 0x7FFF, 0x2345u);  // bit 27: the control bit, 0 for data
  EXPECT_EQ(tag & 0xFFF, 3u);
  EXPECT_EQ(ucx::MakeTag(h, 1023, 5, MessageTag{0x12345, 3}, true), tag | uint64_t{1} << 27);
  // The ring's fingerprint sub has its own value; data subs never reach it.
  EXPECT_EQ(ucx::MakeTag(h, 0, 1, MessageTag{1, 0x80000000u}) & 0xFFF, 0xFFFu);
  EXPECT_EQ(ucx::MakeTag(h, 0, 1, MessageTag{1, 0xFFFu}) & 0xFFF, 0u);
  EXPECT_EQ(ucx::MakeTag(h, 0, 1, MessageTag{1, 0xFFEu}) & 0xFFF, 0xFFEu);
  // Stable across processes (no per-process seed) and sensitive to the epoch.
  EXPECT_EQ(ucx::GroupTagHash("g", 7), h);
  EXPECT_NE(ucx::GroupTagHash("g", 8), h);
}

TEST(UcxBackendTest, DescribesItselfAndPublishesItsWorkerAddress) {
  CollectiveBackend& a = *Daemons()[0];
  EXPECT_EQ(a.Name(), "ucx");
  EXPECT_TRUE(a.IsViable());
  EXPECT_TRUE(a.Supports(MemoryKind::kHost));
  EXPECT_TRUE(a.Supports(MemoryKind::kHostPinned));
  EXPECT_FALSE(a.Supports(MemoryKind::kCuda));
  EXPECT_FALSE(a.LocalAddress().empty());
  EXPECT_NE(a.LocalAddress(), Daemons()[1]->LocalAddress());
}

TEST(UcxBackendTest, ConnectChecksTheSpec) {
  CollectiveBackend& a = *Daemons()[0];
  GroupSpec spec = SpecFor("spec", NextEpoch(), {0, 1}, Daemons(), 0);
  spec.rank_addresses.pop_back();
  absl::Status s = a.Connect(spec).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("one address per rank, got 1"));

  spec = SpecFor("spec", NextEpoch(), {0, 1}, Daemons(), 0);
  spec.local_ranks = {0, 1};  // rank 1's address is another daemon's
  s = a.Connect(spec).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("local_ranks [0, 1] disagree"));

  std::vector<int> big(1025, 1);
  big[0] = 0;
  spec = SpecFor("spec", NextEpoch(), big, Daemons(), 0);
  s = a.Connect(spec).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("world_size 1025 exceeds"));
}

TEST(UcxBackendTest, LiveGroupsWhoseTagsCouldMeetAreRefused) {
  const uint64_t epoch = NextEpoch();
  auto first = ConnectAll("collide", epoch, {0, 1}, Daemons());
  // The same group and epoch twice.
  absl::Status s = Daemons()[0]->Connect(SpecFor("collide", epoch, {0, 1}, Daemons(), 0)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("already connected"));
  // Another group whose 16-bit hash collides.
  const uint16_t h = ucx::GroupTagHash("collide", epoch);
  std::string other;
  for (int i = 0; other.empty(); ++i) {
    if (ucx::GroupTagHash(absl::StrCat("other", i), 1) == h) other = absl::StrCat("other", i);
  }
  s = Daemons()[0]->Connect(SpecFor(other, 1, {0, 1}, Daemons(), 0)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("collides with live group collide epoch ", epoch)));
  // Once the first group is gone, the other may connect.
  first.clear();
  auto second = ConnectAll(other, 1, {0, 1}, Daemons());
  EXPECT_NE(second[0], nullptr);
}

// Runs one float32 AllGather on every rank of `layout`; rank r contributes value base + r.
void AllGatherEverywhere(std::vector<std::unique_ptr<Communicator>>& comms,
                         const std::vector<int>& layout, uint64_t op_seq, float base, size_t shard,
                         std::vector<std::vector<float>>* out) {
  const int world = static_cast<int>(layout.size());
  std::vector<std::vector<float>> in(world);
  out->assign(world, std::vector<float>(shard * world, -1));
  std::vector<DoneRecorder> done(world);
  RunRanks(world, [&](int r) {
    in[r].assign(shard, base + r);
    comms[layout[r]]->AllGather(ConstBuffer{in[r].data(), shard * 4, DType::kFloat32},
                                MutableBuffer{(*out)[r].data(), shard * world * 4, DType::kFloat32},
                                Opts(r, op_seq), done[r].Callback());
    EXPECT_TRUE(done[r].Wait().ok()) << "rank " << r << ": " << done[r].status();
  });
}

TEST(UcxBackendTest, ConcurrentGroupsAndEpochsNeverSeeEachOthersMessages) {
  const std::vector<int> layout = {0, 1, 1};
  const uint64_t e = NextEpoch();
  // Group a in two live epochs, and group b: same op_seq, same ranks, different data.
  std::vector<std::vector<std::unique_ptr<Communicator>>> groups;
  groups.push_back(ConnectAll("a", e, layout, Daemons()));
  groups.push_back(ConnectAll("a", e + 1000000, layout, Daemons()));
  groups.push_back(ConnectAll("b", e, layout, Daemons()));
  std::vector<std::vector<std::vector<float>>> outs(groups.size());
  for (uint64_t op_seq = 1; op_seq <= 3; ++op_seq) {
    RunRanks(static_cast<int>(groups.size()), [&](int g) {
      AllGatherEverywhere(groups[g], layout, op_seq, 100.0f * (g + 1) + op_seq, 4097, &outs[g]);
    });
    for (size_t g = 0; g < groups.size(); ++g) {
      for (int r = 0; r < 3; ++r) {
        for (int k = 0; k < 3; ++k) {
          ASSERT_EQ(outs[g][r][k * 4097], 100.0f * (g + 1) + op_seq + k)
              << "group " << g << " rank " << r << " block " << k;
          ASSERT_EQ(outs[g][r][k * 4097 + 4096], 100.0f * (g + 1) + op_seq + k);
        }
      }
    }
  }
}

TEST(UcxBackendTest, MismatchAcrossDaemonsFailsEveryRankNamingBothOps) {
  // No propagation between daemons: each one reaches the same verdict from the fingerprints.
  const std::vector<int> layout = {0, 0, 1, 1};
  auto comms = ConnectAll("mismatch", NextEpoch(), layout, Daemons());
  std::vector<float> in(1024, 1), out(4096), rs_out(256);
  DoneRecorder done[4];
  for (int r = 0; r < 4; ++r) {
    Communicator& c = *comms[layout[r]];
    if (r == 3) {
      c.ReduceScatter(ConstBuffer{in.data(), 4096, DType::kFloat32},
                      MutableBuffer{rs_out.data(), 1024, DType::kFloat32}, ReduceOp::kAvg,
                      Opts(r, 1), done[r].Callback());
    } else {
      std::vector<float>* o = new std::vector<float>(4096);  // per rank; freed below
      c.AllGather(ConstBuffer{in.data(), 4096, DType::kFloat32},
                  MutableBuffer{o->data(), 16384, DType::kFloat32}, Opts(r, 1),
                  [o, cb = done[r].Callback()](absl::Status s) mutable {
                    delete o;
                    std::move(cb)(std::move(s));
                  });
    }
  }
  for (int r = 0; r < 4; ++r) {
    absl::Status s = done[r].Wait();
    EXPECT_TRUE(absl::IsAborted(s)) << "rank " << r << ": " << s;
    EXPECT_EQ(s.message(),
              "collective mismatch at op_seq 1: rank 0 called AllGather(unit 3, 4096 bytes, "
              "float32) but rank 3 called ReduceScatter(unit 3, 1024 bytes, float32, avg)")
        << "rank " << r;
  }
}

TEST(UcxBackendTest, DeadlineOnOneDaemonNamesRanksMissingOnOthers) {
  const std::vector<int> layout = {0, 1, 2, 2};
  auto comms = ConnectAll("deadline", NextEpoch(), layout, Daemons());
  std::vector<std::vector<float>> in(4, std::vector<float>(16)), out(4, std::vector<float>(64));
  DoneRecorder done[4];
  for (int r : {0, 2}) {
    comms[layout[r]]->AllGather(ConstBuffer{in[r].data(), 64, DType::kFloat32},
                                MutableBuffer{out[r].data(), 256, DType::kFloat32},
                                Opts(r, 1, 3, absl::Milliseconds(300)), done[r].Callback());
  }
  for (int r : {0, 2}) {
    absl::Status s = done[r].Wait();
    EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("op_seq 1 AllGather(unit 3, 64 bytes, float32): ranks 1, 3 did not "
                          "arrive within "));
  }
}

TEST(UcxBackendTest, LargeAllGatherBetweenTwoDaemons) {
  // 64 MiB assembled per rank (2 x 32 MiB shards), read once straight into `out`.
  constexpr size_t kShard = (size_t{32} << 20) / 4;
  const std::vector<int> layout = {0, 1};
  auto comms = ConnectAll("large", NextEpoch(), layout, Daemons());
  std::vector<std::vector<float>> in(2, std::vector<float>(kShard));
  std::vector<std::vector<float>> out(2, std::vector<float>(2 * kShard));
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < kShard; ++i) in[r][i] = ShardValue(r, i);
  }
  absl::Duration best = absl::InfiniteDuration();
  for (uint64_t op_seq = 1; op_seq <= 4; ++op_seq) {
    std::vector<DoneRecorder> done(2);
    const absl::Time start = absl::Now();
    RunRanks(2, [&](int r) {
      comms[r]->AllGather(ConstBuffer{in[r].data(), kShard * 4, DType::kFloat32},
                          MutableBuffer{out[r].data(), 2 * kShard * 4, DType::kFloat32},
                          Opts(r, op_seq), done[r].Callback());
      EXPECT_TRUE(done[r].Wait().ok()) << done[r].status();
    });
    best = std::min(best, absl::Now() - start);
  }
  // One host identity: the 32 MiB blocks went by same-host copy (same_host_copy.h).
  EXPECT_GT(StatsOf(*Daemons()[1]).same_host_copies, 0u);
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(BlockHolds(out[r].data() + k * kShard, k, kShard));
  }
  const double seconds = absl::ToDoubleSeconds(best);
  std::printf(
      "64 MiB AllGather, 2 UCX backends in one process: %.2f ms, algbw %.2f GB/s, "
      "busbw %.2f GB/s\n",
      seconds * 1e3, (64 << 20) / seconds / 1e9, (64 << 20) / seconds / 1e9 / 2);
}

// 2 daemons x 2 ranks: the hierarchical collectives give the flat ring's results to the element
// (values whose sums are exact in float32), for 1 MiB shards, in the same run.
TEST(UcxBackendTest, HierarchicalEqualsTheFlatRingOnTwoDaemonsOfTwoRanks) {
  constexpr size_t kShard = (size_t{1} << 20) / 4;
  const std::vector<int> layout = {0, 0, 1, 1};
  UcxBackendOptions flat_options;
  flat_options.hierarchical = false;
  auto fa = NewBackend(flat_options);
  auto fb = NewBackend(flat_options);
  std::vector<std::vector<float>> in(4, std::vector<float>(4 * kShard));
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < in[r].size(); ++i)
      in[r][i] = static_cast<float>((i * 7 + r) % 97) * 0.25f;
  }
  // AllGather of each rank's first shard, then ReduceScatter (avg) of its whole input.
  auto run = [&](const std::vector<std::unique_ptr<Communicator>>& comms) {
    std::vector<std::vector<float>> out(4, std::vector<float>(5 * kShard));
    RunRanks(4, [&](int r) {
      DoneRecorder gathered, reduced;
      comms[layout[r]]->AllGather(ConstBuffer{in[r].data(), kShard * 4, DType::kFloat32},
                                  MutableBuffer{out[r].data(), 4 * kShard * 4, DType::kFloat32},
                                  Opts(r, 1), gathered.Callback());
      EXPECT_TRUE(gathered.Wait().ok()) << gathered.status();
      comms[layout[r]]->ReduceScatter(
          ConstBuffer{in[r].data(), 4 * kShard * 4, DType::kFloat32},
          MutableBuffer{out[r].data() + 4 * kShard, kShard * 4, DType::kFloat32}, ReduceOp::kAvg,
          Opts(r, 2), reduced.Callback());
      EXPECT_TRUE(reduced.Wait().ok()) << reduced.status();
    });
    return out;
  };
  const auto hierarchical = run(ConnectAll("hier", NextEpoch(), layout, Daemons()));
  const auto flat = run(ConnectAll("flat", NextEpoch(), layout, {fa.get(), fb.get()}));
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < 5 * kShard; ++i) {
      ASSERT_EQ(hierarchical[r][i], flat[r][i]) << "rank " << r << " element " << i;
    }
    EXPECT_EQ(hierarchical[r][kShard], in[1][0]);  // rank 1's shard landed in block 1
  }
}

// 4 daemons x 1 rank, the flat ring's reduce-scatter pipelined in 256 KiB chunks over UCX
// (full chunks by same-host copy, the short last one through UCX): every rank's result has the
// bits of the unchunked ring over InprocTransport, for float32 values whose sums depend on
// their order, sum and avg.
TEST(UcxBackendTest, PipelinedFlatReduceScatterHasTheUnchunkedRingsBits) {
  constexpr int kWorld = 4;
  constexpr size_t kShard = (size_t{1} << 20) / 4 + 3;  // floats: 4 full chunks and a short one
  UcxBackendOptions chunked;
  chunked.pipeline_chunk_bytes = size_t{256} << 10;
  std::vector<std::unique_ptr<CollectiveBackend>> daemons;
  std::vector<CollectiveBackend*> raw;
  for (int d = 0; d < kWorld; ++d) {
    daemons.push_back(NewBackend(chunked));
    raw.push_back(daemons.back().get());
  }
  std::vector<std::vector<float>> in(kWorld, std::vector<float>(kWorld * kShard));
  const float values[] = {3e7f, -2.9e7f, 0.7f, 0.013f, 1.1e7f, -3.7f};
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < in[r].size(); ++i) in[r][i] = values[(r * 7 + i * 3) % 6] * (i % 5 + 1);
  }
  auto run = [&](const std::vector<std::unique_ptr<Communicator>>& comms, ReduceOp op) {
    std::vector<std::vector<float>> out(kWorld, std::vector<float>(kShard, -1.0f));
    RunRanks(kWorld, [&](int r) {
      DoneRecorder done;
      Communicator& c = comms.size() == 1 ? *comms[0] : *comms[r];
      c.ReduceScatter(ConstBuffer{in[r].data(), kWorld * kShard * 4, DType::kFloat32},
                      MutableBuffer{out[r].data(), kShard * 4, DType::kFloat32}, op, Opts(r, 1),
                      done.Callback());
      EXPECT_TRUE(done.Wait().ok()) << "rank " << r << ": " << done.status();
    });
    return out;
  };
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    SCOPED_TRACE(ReduceOpName(op));
    std::vector<std::unique_ptr<Communicator>> unchunked;
    unchunked.push_back(NewRingCommunicator(GroupSpec::AllLocal("ref", kWorld),
                                            std::make_shared<InprocTransport>(kWorld))
                            .value());
    const auto want = run(unchunked, op);
    const auto got = run(ConnectAll("pipelined", NextEpoch(), {0, 1, 2, 3}, raw), op);
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(std::memcmp(got[r].data(), want[r].data(), kShard * 4), 0) << "rank " << r;
    }
  }
  EXPECT_GT(StatsOf(*raw[1]).same_host_copies, 0u);
}

// A daemon of a 2 x 2 group destroyed while the other daemon's ranks wait in a hierarchical
// all-gather: they fail with UNAVAILABLE naming the dead daemon's ranks, and stay failed.
TEST(UcxBackendTest, DaemonDestroyedMidHierarchicalOpFailsItsPeers) {
  UcxBackendOptions peer_mode;
  peer_mode.error_handling = UcxBackendOptions::ErrorHandling::kPeer;
  auto a = NewBackend(peer_mode);
  auto b = NewBackend(peer_mode);
  const std::vector<int> layout = {0, 0, 1, 1};
  auto comms = ConnectAll("dies2x2", NextEpoch(), layout, {a.get(), b.get()});
  std::vector<std::vector<float>> in(4, std::vector<float>(1024, 1));
  std::vector<std::vector<float>> out(4, std::vector<float>(4096));
  auto issue = [&](int r, uint64_t op_seq, DoneCallback done) {
    comms[layout[r]]->AllGather(ConstBuffer{in[r].data(), 4096, DType::kFloat32},
                                MutableBuffer{out[r].data(), 16384, DType::kFloat32},
                                Opts(r, op_seq), std::move(done));
  };
  std::vector<DoneRecorder> done(4);
  for (int r : {0, 1}) issue(r, 1, done[r].Callback());
  // Both local ranks are in the op (their fingerprints posted) before daemon b goes.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (absl::Now() < give_up) {
    std::vector<PendingOpInfo> p = comms[0]->PendingOps();
    if (!p.empty() && p[0].arrived_ranks.size() >= 2) break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  b.reset();
  for (int r : {0, 1}) {
    absl::Status s = done[r].Wait(absl::Seconds(30));
    EXPECT_TRUE(absl::IsUnavailable(s)) << "rank " << r << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("UCX peer of ranks 2, 3 failed: "));
  }
  DoneRecorder later;
  issue(0, 2, later.Callback());
  EXPECT_EQ(later.Wait(absl::Seconds(30)), done[0].status());
}

TEST(UcxBackendTest, AbortReleasesRequestsAndStraysAreDrained) {
  auto a = NewBackend();
  auto b = NewBackend();
  const std::vector<CollectiveBackend*> daemons = {a.get(), b.get()};
  const std::vector<int> layout = {0, 1};
  auto comms = ConnectAll("abort", NextEpoch(), layout, daemons);
  constexpr size_t kShard = (size_t{8} << 20) / 4;  // rendezvous-sized
  std::vector<std::vector<float>> in(2, std::vector<float>(kShard, 1));
  std::vector<std::vector<float>> out(2, std::vector<float>(2 * kShard));
  DoneRecorder done0;
  comms[0]->AllGather(ConstBuffer{in[0].data(), kShard * 4, DType::kFloat32},
                      MutableBuffer{out[0].data(), 2 * kShard * 4, DType::kFloat32}, Opts(0, 1),
                      done0.Callback());
  // Rank 0 waits for rank 1's fingerprint: a UCX receive is posted.
  absl::Time until = absl::Now() + absl::Seconds(5);
  while (StatsOf(*a).inflight_requests == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GT(StatsOf(*a).inflight_requests, 0u);
  const absl::Status reason = absl::AbortedError("operator abort");
  comms[0]->Abort(reason);
  EXPECT_EQ(done0.Wait(absl::Seconds(5)), reason);
  EXPECT_EQ(StatsOf(*a).inflight_requests, 0u);

  // Rank 1 arrives late: it gets rank 0's fingerprint and sends its 8 MiB block, which only
  // the drain on daemon a receives. Its own receive from rank 0 times out.
  DoneRecorder done1;
  comms[1]->AllGather(ConstBuffer{in[1].data(), kShard * 4, DType::kFloat32},
                      MutableBuffer{out[1].data(), 2 * kShard * 4, DType::kFloat32},
                      Opts(1, 1, 3, absl::Milliseconds(500)), done1.Callback());
  absl::Status s = done1.Wait(absl::Seconds(5));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 did not finish moving data"));
  EXPECT_EQ(StatsOf(*b).inflight_requests, 0u) << "the rendezvous send to the aborted group hung";
  EXPECT_GE(StatsOf(*a).dropped_messages, 1u);

  comms.clear();
  until = absl::Now() + absl::Seconds(5);
  while ((StatsOf(*a).live_groups != 0 || StatsOf(*b).live_groups != 0) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(StatsOf(*a).live_groups, 0u);
  EXPECT_EQ(StatsOf(*b).live_groups, 0u);
  EXPECT_EQ(StatsOf(*a).endpoints, 1u);  // endpoints outlive groups, for the next one
}

TEST(UcxBackendTest, DaemonDestroyedMidOpFailsItsPeersWithUnavailable) {
  // Endpoints with peer error handling: UCX itself reports the dead peer (same-host endpoints
  // have none by default; the next test covers them).
  UcxBackendOptions peer_mode;
  peer_mode.error_handling = UcxBackendOptions::ErrorHandling::kPeer;
  auto a = NewBackend(peer_mode);
  auto b = NewBackend(peer_mode);
  auto c = NewBackend(peer_mode);
  const std::vector<CollectiveBackend*> daemons = {a.get(), b.get(), c.get()};
  const std::vector<int> layout = {0, 1, 2, 2};
  auto comms = ConnectAll("dies", NextEpoch(), layout, daemons);
  std::vector<std::vector<float>> in(4, std::vector<float>(1024, 1));
  std::vector<std::vector<float>> out(4, std::vector<float>(4096));
  auto issue = [&](int r, uint64_t op_seq, DoneCallback done) {
    comms[layout[r]]->AllGather(ConstBuffer{in[r].data(), 4096, DType::kFloat32},
                                MutableBuffer{out[r].data(), 16384, DType::kFloat32},
                                Opts(r, op_seq), std::move(done));
  };
  {
    std::vector<DoneRecorder> done(4);
    for (int r = 0; r < 4; ++r) issue(r, 1, done[r].Callback());
    for (int r = 0; r < 4; ++r) ASSERT_TRUE(done[r].Wait().ok()) << done[r].status();
  }
  // Op 2: every rank but daemon b's arrives; then daemon b goes away.
  std::vector<DoneRecorder> done(4);
  for (int r : {0, 2, 3}) issue(r, 2, done[r].Callback());
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  b.reset();
  for (int r : {0, 2, 3}) {
    absl::Status s = done[r].Wait(absl::Seconds(5));
    EXPECT_TRUE(absl::IsUnavailable(s)) << "rank " << r << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("UCX peer of rank 1 failed: "));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Daemon b's own communicator outlives its backend and refuses work.
  DoneRecorder late;
  issue(1, 2, late.Callback());
  EXPECT_FALSE(late.Wait(absl::Seconds(5)).ok());
}

TEST(UcxAddressTest, CarriesTheHostIdentityAndTheWorkerAddress) {
  const std::string worker("\x00\x01\n\xff", 4);
  absl::StatusOr<ucx::UcxPeerAddress> d =
      ucx::DecodeUcxAddress(ucx::EncodeUcxAddress("boot net=1", worker));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->host, "boot net=1");
  EXPECT_EQ(d->worker, worker);
  // A bare worker address (an older daemon) is a peer on an unknown host.
  d = ucx::DecodeUcxAddress(worker);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->host, "");
  EXPECT_EQ(d->worker, worker);
  EXPECT_TRUE(absl::IsInvalidArgument(ucx::DecodeUcxAddress("fsucx1 boot").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ucx::DecodeUcxAddress("fsucx1 boot\n").status()));
  EXPECT_EQ(ucx::LocalHostIdentity(), ucx::LocalHostIdentity());
}

// kNone: endpoints between backends of one host have no peer error handling (so UCX may use
// shared memory); kAuto (the default) and kPeer give every endpoint peer error handling (one
// host then talks over TCP loopback: no shared-memory queue that a killed peer wedges).
TEST(UcxBackendTest, SameHostEndpointsSkipPeerErrorHandlingOnlyWhenAskedTo) {
  using Mode = UcxBackendOptions::ErrorHandling;
  for (Mode mode : {Mode::kAuto, Mode::kPeer, Mode::kNone}) {
    SCOPED_TRACE(absl::StrCat("mode ", static_cast<int>(mode)));
    UcxBackendOptions options;
    options.error_handling = mode;
    auto a = NewBackend(options);
    auto b = NewBackend(options);
    const std::vector<CollectiveBackend*> daemons = {a.get(), b.get()};
    const std::vector<int> layout = {0, 1};
    auto comms = ConnectAll("mode", NextEpoch(), layout, daemons);
    std::vector<std::vector<float>> in(2, std::vector<float>(1 << 20));
    std::vector<std::vector<float>> out(2, std::vector<float>(2 << 20));
    for (int r = 0; r < 2; ++r) {
      for (size_t i = 0; i < in[r].size(); ++i) in[r][i] = ShardValue(r, i);
    }
    RunRanks(2, [&](int r) {
      DoneRecorder done;
      comms[r]->AllGather(ConstBuffer{in[r].data(), in[r].size() * 4, DType::kFloat32},
                          MutableBuffer{out[r].data(), out[r].size() * 4, DType::kFloat32},
                          Opts(r, 1), done.Callback());
      EXPECT_TRUE(done.Wait().ok()) << done.status();
      for (int k = 0; k < 2; ++k) {
        EXPECT_TRUE(BlockHolds(out[r].data() + k * in[r].size(), k, in[r].size()));
      }
    });
    const UcxBackendStats stats = StatsOf(*a);
    EXPECT_EQ(stats.endpoints, 1u);
    EXPECT_EQ(stats.same_host_endpoints, mode == Mode::kNone ? 1u : 0u);
  }
}

// A same-host peer that dies mid-transfer: no UCX error comes (no peer error handling), the
// heartbeats find it (here: the test aborts the survivors' communicators, as the coordinator
// does), and the transfers UCX cannot cancel are abandoned after abort_grace, so every
// survivor's op ends with the abort's status instead of hanging.
TEST(UcxBackendTest, SameHostPeerDestroyedMidTransferEndsAtTheAbort) {
  UcxBackendOptions options;
  options.abort_grace = absl::Milliseconds(300);
  // Shared memory only: UCX 1.13 asserts ("got REP message") when a worker is destroyed while
  // a wireup reply is queued on a TCP lane, which destroying `b` mid-transfer can hit (in
  // about 1 of 10 runs). A dead daemon's process never runs ucp_worker_destroy; what is under
  // test is the survivors' side.
  options.ucx_config["TLS"] = "sm,self";
  options.error_handling = UcxBackendOptions::ErrorHandling::kNone;  // sm has no peer failure
  auto a = NewBackend(options);
  auto b = NewBackend(options);
  auto c = NewBackend(options);
  const std::vector<CollectiveBackend*> daemons = {a.get(), b.get(), c.get()};
  const std::vector<int> layout = {0, 1, 2};
  auto comms = ConnectAll("dies-shm", NextEpoch(), layout, daemons);
  constexpr size_t kShard = (size_t{16} << 20) / 4;  // 16 MiB blocks: rendezvous
  std::vector<std::vector<float>> in(3, std::vector<float>(kShard, 1));
  std::vector<std::vector<float>> out(3, std::vector<float>(3 * kShard));
  std::vector<DoneRecorder> done(3);
  for (int r = 0; r < 3; ++r) {
    comms[r]->AllGather(ConstBuffer{in[r].data(), kShard * 4, DType::kFloat32},
                        MutableBuffer{out[r].data(), 3 * kShard * 4, DType::kFloat32},
                        Opts(r, 1, 3, absl::Seconds(60)), done[r].Callback());
  }
  // Data is moving once a survivor has UCX transfers in flight.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (StatsOf(*a).inflight_requests == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Microseconds(200));
  }
  b.reset();
  const absl::Time start = absl::Now();
  const absl::Status reason = absl::UnavailableError("daemon node1 died (heartbeats)");
  for (int r : {0, 2}) comms[r]->Abort(reason);
  for (int r : {0, 2}) {
    absl::Status s = done[r].Wait(absl::Seconds(10));
    // A survivor whose transfers all finished before the abort succeeds, one whose send to the
    // dead peer failed first says so (UNAVAILABLE, "UCX send ... failed"), and one whose
    // same-host copy from it found that its destruction aborted the send names it (ABORTED,
    // "same-host copy from rank 1 ... the sender gave up"); none may hang.
    const bool named_abort =
        absl::IsAborted(s) && absl::StrContains(s.message(), "same-host copy from rank 1");
    EXPECT_TRUE(s.ok() || absl::IsUnavailable(s) || named_abort) << "rank " << r << ": " << s;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(StatsOf(*a).inflight_requests, 0u);
  EXPECT_EQ(StatsOf(*c).inflight_requests, 0u);
}

// --- A second process ----------------------------------------------------------------------

constexpr size_t kChildShard = (size_t{4} << 20) / 4;  // 4 MiB: rendezvous across processes

// Rank `rank` of a 2-rank group between two processes: all-gather, reduce-scatter, broadcast.
absl::Status RunCrossProcessRank(CollectiveBackend& backend, int rank,
                                 const std::string& peer_address) {
  GroupSpec spec;
  spec.group_id = "xproc";
  spec.epoch = 1;
  spec.world_size = 2;
  spec.local_ranks = {rank};
  spec.rank_addresses = {rank == 0 ? backend.LocalAddress() : peer_address,
                         rank == 1 ? backend.LocalAddress() : peer_address};
  absl::StatusOr<std::unique_ptr<Communicator>> comm = backend.Connect(spec);
  if (!comm.ok()) return comm.status();
  auto run = [&](auto&& op) {
    DoneRecorder done;
    op(done.Callback());
    return done.Wait(absl::Seconds(20));
  };
  std::vector<float> in(kChildShard), out(2 * kChildShard);
  for (size_t i = 0; i < kChildShard; ++i) in[i] = ShardValue(rank, i);
  absl::Status s = run([&](DoneCallback d) {
    (*comm)->AllGather(ConstBuffer{in.data(), in.size() * 4, DType::kFloat32},
                       MutableBuffer{out.data(), out.size() * 4, DType::kFloat32}, Opts(rank, 1),
                       std::move(d));
  });
  if (!s.ok()) return s;
  for (int k = 0; k < 2; ++k) {
    if (!BlockHolds(out.data() + k * kChildShard, k, kChildShard)) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": all-gather block ", k, " wrong"));
    }
  }
  std::vector<float> rs_in(2 * 1000), rs_out(1000);
  for (size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = static_cast<float>(i + rank);
  s = run([&](DoneCallback d) {
    (*comm)->ReduceScatter(ConstBuffer{rs_in.data(), rs_in.size() * 4, DType::kFloat32},
                           MutableBuffer{rs_out.data(), rs_out.size() * 4, DType::kFloat32},
                           ReduceOp::kSum, Opts(rank, 2), std::move(d));
  });
  if (!s.ok()) return s;
  for (size_t i = 0; i < rs_out.size(); ++i) {
    if (rs_out[i] != 2.0f * (rank * 1000 + i) + 1) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": reduce-scatter element ", i));
    }
  }
  std::vector<float> bc(3 << 20, rank == 1 ? 7.0f : 0.0f);  // 12 MiB: several chunks
  s = run([&](DoneCallback d) {
    (*comm)->Broadcast(MutableBuffer{bc.data(), bc.size() * 4, DType::kFloat32}, 1, Opts(rank, 3),
                       std::move(d));
  });
  if (!s.ok()) return s;
  if (bc.front() != 7.0f || bc.back() != 7.0f) {
    return absl::InternalError(absl::StrCat("rank ", rank, ": broadcast wrong"));
  }
  return absl::OkStatus();
}

// The child: started by the test below with FS_UCX_TEST_CHILD=1, before gtest (and before any
// UCX use in this process). Prints its address, reads the parent's, runs rank 1.
[[maybe_unused]] const bool kRanAsChild = [] {
  if (std::getenv("FS_UCX_TEST_CHILD") == nullptr) return false;
  auto backend = NewBackend();
  std::printf("%s\n", absl::BytesToHexString(backend->LocalAddress()).c_str());
  std::fflush(stdout);
  char line[65536];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) std::_Exit(3);
  std::string hex(line);
  while (!hex.empty() && hex.back() == '\n') hex.pop_back();
  absl::Status s = RunCrossProcessRank(*backend, 1, absl::HexStringToBytes(hex));
  if (!s.ok()) std::fprintf(stderr, "child: %s\n", s.ToString().c_str());
  backend.reset();
  std::_Exit(s.ok() ? 0 : 1);
}();

class UcxCrossProcessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxCrossProcessTest, CollectivesBetweenTwoProcesses) {
  // The parent picks its transports through options, the child through UCX_TLS (the
  // environment UCX reads itself); "" leaves both to UCX (shared memory, CMA, TCP).
  UcxBackendOptions options;
  std::vector<std::string> env_storage = {"FS_UCX_TEST_CHILD=1"};
  if (!GetParam().empty()) {
    options.ucx_config["TLS"] = GetParam();
    env_storage.push_back(absl::StrCat("UCX_TLS=", GetParam()));
  }
  auto backend = NewBackend(options);
  std::vector<char*> envp;
  for (std::string& e : env_storage) envp.push_back(e.data());
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "UCX_TLS=", 8) != 0 || GetParam().empty()) envp.push_back(*e);
  }
  envp.push_back(nullptr);
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  char exe[] = "/proc/self/exe";
  char* argv[] = {exe, nullptr};
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[1]);
    close(from_child[0]);
    execve(exe, argv, envp.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  // The child's address, with a timeout so a broken child cannot hang the test.
  std::string hex;
  char buf[4096];
  pollfd pfd{from_child[0], POLLIN, 0};
  while (hex.find('\n') == std::string::npos && poll(&pfd, 1, 20000) == 1) {
    ssize_t n = read(from_child[0], buf, sizeof(buf));
    if (n <= 0) break;
    hex.append(buf, n);
  }
  ASSERT_NE(hex.find('\n'), std::string::npos) << "child sent no address";
  hex.resize(hex.find('\n'));
  const std::string mine = absl::BytesToHexString(backend->LocalAddress()) + "\n";
  ASSERT_EQ(write(to_child[1], mine.data(), mine.size()), static_cast<ssize_t>(mine.size()));
  absl::Status s = RunCrossProcessRank(*backend, 0, absl::HexStringToBytes(hex));
  EXPECT_TRUE(s.ok()) << s;
  int wstatus = 0;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (waitpid(pid, &wstatus, WNOHANG) == 0) {
    if (absl::Now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &wstatus, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  close(to_child[1]);
  close(from_child[0]);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "child status " << wstatus;
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxCrossProcessTest, Values("", "tcp"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param.empty() ? std::string("Default") : info.param;
                         });

}  // namespace
}  // namespace flatshard::collective::testing
