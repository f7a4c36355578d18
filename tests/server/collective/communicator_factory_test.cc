// CommunicatorFactory: which backend a group gets (inproc through the registry, UCX for
// several daemons, NCCL when each local rank has its own GPU or the rendezvous agreed on it),
// staging on GPU daemons (a fake DeviceCopier, device-kind buffers that are host memory), the
// connected communicators actually moving bytes, and clean refusals (no remote backend, no
// copier, a non-viable NCCL backend, NCCL ids without NCCL).

#include "server/collective/communicator_factory.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_backend.h"

namespace flatshard::collective {
namespace {

using ::testing::HasSubstr;

// Staging buffers are host memory; copies are memcpy, counted.
class FakeCopier : public DeviceCopier {
 public:
  absl::StatusOr<std::shared_ptr<void>> AllocateStaging(MemoryKind, int, size_t bytes) override {
    return std::shared_ptr<void>(::operator new(bytes), [](void* p) { ::operator delete(p); });
  }
  absl::Status Copy(void* dst, MemoryKind, const void* src, MemoryKind, size_t bytes,
                    int) override {
    absl::MutexLock lock(&mu_);
    ++copies_;
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  int copies() const {
    absl::MutexLock lock(&mu_);
    return copies_;
  }

 private:
  mutable absl::Mutex mu_;
  int copies_ ABSL_GUARDED_BY(mu_) = 0;
};

// Hands every buffer to `inner` as host memory: a fake "nccl" backend's buffers are "device"
// memory that is host memory here.
class AsHost final : public Communicator {
 public:
  explicit AsHost(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& o, DoneCallback d) override {
    in.kind = out.kind = MemoryKind::kHost;
    inner_->AllGather(in, out, o, std::move(d));
  }
  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& o,
                     DoneCallback d) override {
    in.kind = out.kind = MemoryKind::kHost;
    inner_->ReduceScatter(in, out, op, o, std::move(d));
  }
  void Broadcast(MutableBuffer buf, int root, const OpOptions& o, DoneCallback d) override {
    buf.kind = MemoryKind::kHost;
    inner_->Broadcast(buf, root, o, std::move(d));
  }
  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& o,
              DoneCallback d) override {
    in.kind = out.kind = MemoryKind::kHost;
    inner_->Gather(in, out, root, o, std::move(d));
  }
  void Abort(absl::Status reason) override { inner_->Abort(std::move(reason)); }
  absl::Status status() const override { return inner_->status(); }
  std::vector<PendingOpInfo> PendingOps() const override { return inner_->PendingOps(); }
  absl::string_view backend_name() const override { return inner_->backend_name(); }

 private:
  std::unique_ptr<Communicator> inner_;
};

// A backend named `name` that moves any memory with a real inproc backend underneath (every
// rank is local to the test) and records the specs it was asked to connect.
class FakeBackend : public CollectiveBackend {
 public:
  FakeBackend(std::string name, bool viable, std::vector<GroupSpec>* specs)
      : name_(std::move(name)),
        viable_(viable),
        specs_(specs),
        inner_(CreateInprocBackend().value()) {}
  absl::string_view Name() const override { return name_; }
  bool IsViable() const override { return viable_; }
  bool Supports(MemoryKind) const override { return true; }
  std::string LocalAddress() const override { return name_ + "-address"; }
  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& group) override {
    specs_->push_back(group);
    GroupSpec local = group;
    local.rank_addresses.clear();
    local.local_ranks.clear();
    for (int r = 0; r < group.world_size; ++r) local.local_ranks.push_back(r);
    local.local_devices.clear();
    absl::StatusOr<std::unique_ptr<Communicator>> comm = inner_->Connect(local);
    if (!comm.ok()) return comm.status();
    return std::unique_ptr<Communicator>(new AsHost(*std::move(comm)));
  }

 private:
  const std::string name_;
  const bool viable_;
  std::vector<GroupSpec>* specs_;
  std::unique_ptr<CollectiveBackend> inner_;
};

CommunicatorRequest Local(int world_size, std::vector<int> devices = {}) {
  CommunicatorRequest r;
  r.spec = GroupSpec::AllLocal("g", world_size);
  r.spec.local_devices = std::move(devices);
  return r;
}

CommunicatorRequest Multi(int world_size, bool nccl_agreed, std::vector<int> devices = {}) {
  CommunicatorRequest r = Local(world_size, std::move(devices));
  for (int k = 0; k < world_size; ++k) r.spec.rank_addresses.push_back("addr" + std::to_string(k));
  r.spec.epoch = 7;
  r.spec.nccl_unique_id = std::string(128, 'x');
  r.nccl_agreed = nccl_agreed;
  return r;
}

// Runs an all-gather of one int32 per rank over `comm` with buffers of `kind`; every rank's
// output must hold 100 + r at slot r.
void ExpectAllGatherWorks(Communicator& comm, int world_size, MemoryKind kind) {
  std::vector<int32_t> in(world_size);
  std::vector<std::vector<int32_t>> out(world_size, std::vector<int32_t>(world_size, -1));
  absl::Mutex mu;
  int done = 0;
  std::vector<absl::Status> statuses(world_size);
  for (int r = 0; r < world_size; ++r) {
    in[r] = 100 + r;
    OpOptions o;
    o.rank = r;
    o.op_seq = 1;
    o.deadline = absl::Now() + absl::Seconds(10);
    comm.AllGather(
        ConstBuffer{&in[r], sizeof(int32_t), DType::kInt32, kind},
        MutableBuffer{out[r].data(), out[r].size() * sizeof(int32_t), DType::kInt32, kind}, o,
        [&, r](absl::Status s) {
          absl::MutexLock lock(&mu);
          statuses[r] = s;
          ++done;
        });
  }
  struct AllDone {
    int* done;
    int want;
    static bool Check(AllDone* a) { return *a->done == a->want; }
  } all{&done, world_size};
  absl::MutexLock lock(&mu);
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&AllDone::Check, &all), absl::Seconds(10)))
      << "only " << done << " ranks completed";
  for (int r = 0; r < world_size; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
    for (int k = 0; k < world_size; ++k) EXPECT_EQ(out[r][k], 100 + k) << "rank " << r;
  }
}

TEST(CommunicatorFactoryTest, HostLocalGroupRunsInprocFromTheRegistry) {
  auto f = CommunicatorFactory::Create({});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE((*f)->has_remote());
  EXPECT_FALSE((*f)->has_nccl());
  EXPECT_EQ((*f)->RemoteAddress(), "");
  absl::StatusOr<ConnectedCommunicator> c = (*f)->Connect(Local(4));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend_name(), "inproc");
  EXPECT_FALSE(c->choice.staged);
  EXPECT_EQ(c->choice.backend_kind, MemoryKind::kHost);
  EXPECT_EQ(c->spec.world_size, 4);
  EXPECT_EQ(c->comm->backend_name(), "inproc") << "the metrics' label";
  ExpectAllGatherWorks(*c->comm, 4, MemoryKind::kHost);
}

TEST(CommunicatorFactoryTest, InprocComesFromTheGivenRegistry) {
  std::vector<GroupSpec> specs;
  BackendRegistry registry;
  ASSERT_TRUE(
      registry
          .Register(
              "inproc",
              [&](const BackendParams&) -> absl::StatusOr<std::unique_ptr<CollectiveBackend>> {
                return std::make_unique<FakeBackend>("inproc", true, &specs);
              })
          .ok());
  CommunicatorFactoryOptions options;
  options.registry = &registry;
  auto f = CommunicatorFactory::Create(std::move(options));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->Connect(Local(2)).ok());
  ASSERT_EQ(specs.size(), 1u);
  EXPECT_EQ(specs[0].group_id, "g");

  BackendRegistry empty;
  CommunicatorFactoryOptions none;
  none.registry = &empty;
  auto refused = CommunicatorFactory::Create(std::move(none));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("\"inproc\""));
}

TEST(CommunicatorFactoryTest, BadInprocParamsAreRefused) {
  CommunicatorFactoryOptions options;
  options.inproc_params = {{"no_such_key", "1"}};
  auto f = CommunicatorFactory::Create(std::move(options));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), HasSubstr("no_such_key"));
}

TEST(CommunicatorFactoryTest, GpuRanksWithoutNcclAreStagedOverInproc) {
  auto copier = std::make_shared<FakeCopier>();
  CommunicatorFactoryOptions options;
  options.copier = copier;
  auto f = CommunicatorFactory::Create(std::move(options));
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<ConnectedCommunicator> c = (*f)->Connect(Local(3, {0, 1, 2}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend_name(), "inproc");
  EXPECT_TRUE(c->choice.staged);
  EXPECT_EQ(c->choice.backend_kind, MemoryKind::kHost);
  EXPECT_EQ(c->comm->backend_name(), "inproc+staging") << "the metrics' label";
  ExpectAllGatherWorks(*c->comm, 3, MemoryKind::kCuda);
  EXPECT_GT(copier->copies(), 0) << "device-kind buffers must be staged through the copier";
}

TEST(CommunicatorFactoryTest, NcclOnlyWhenEveryLocalRankHasItsOwnGpu) {
  std::vector<GroupSpec> nccl_specs;
  auto copier = std::make_shared<FakeCopier>();
  CommunicatorFactoryOptions options;
  options.copier = copier;
  options.nccl = std::make_unique<FakeBackend>("nccl", true, &nccl_specs);
  auto f = CommunicatorFactory::Create(std::move(options));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->has_nccl());

  absl::StatusOr<ConnectedCommunicator> own = (*f)->Connect(Local(2, {0, 1}));
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->backend_name(), "nccl");
  EXPECT_EQ(own->choice.backend_kind, MemoryKind::kCuda);
  EXPECT_TRUE(own->choice.staged);
  ASSERT_EQ(nccl_specs.size(), 1u);
  EXPECT_EQ(nccl_specs[0].local_devices, (std::vector<int>{0, 1}));
  // Host-kind buffers on an NCCL group are staged into "device" buffers.
  const int before = copier->copies();
  ExpectAllGatherWorks(*own->comm, 2, MemoryKind::kHost);
  EXPECT_GT(copier->copies(), before);

  // Two ranks on one GPU: NCCL refuses that, so the host path runs them, staged.
  absl::StatusOr<BackendChoice> shared = (*f)->Choose(Local(3, {0, 1, 0}));
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->backend_name, "inproc");
  EXPECT_EQ(shared->backend_kind, MemoryKind::kHost);
  EXPECT_TRUE(shared->staged);
  EXPECT_EQ(nccl_specs.size(), 1u) << "Choose must not connect";

  // A host-memory group never runs on NCCL.
  absl::StatusOr<BackendChoice> host = (*f)->Choose(Local(2));
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->backend_name, "inproc");
  EXPECT_FALSE(host->staged);
}

TEST(CommunicatorFactoryTest, MultiDaemonGroupsRunOnTheRemoteBackendOrAgreedNccl) {
  std::vector<GroupSpec> ucx_specs;
  std::vector<GroupSpec> nccl_specs;
  CommunicatorFactoryOptions options;
  options.copier = std::make_shared<FakeCopier>();
  options.remote = std::make_unique<FakeBackend>("ucx", true, &ucx_specs);
  options.nccl = std::make_unique<FakeBackend>("nccl", true, &nccl_specs);
  auto f = CommunicatorFactory::Create(std::move(options));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->RemoteAddress(), "ucx-address");

  absl::StatusOr<ConnectedCommunicator> ucx = (*f)->Connect(Multi(2, /*nccl_agreed=*/false));
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  EXPECT_EQ(ucx->backend_name(), "ucx");
  EXPECT_FALSE(ucx->choice.staged);
  ASSERT_EQ(ucx_specs.size(), 1u);
  EXPECT_EQ(ucx_specs[0].epoch, 7u);
  EXPECT_EQ(ucx_specs[0].rank_addresses.size(), 2u);
  EXPECT_EQ(ucx_specs[0].nccl_unique_id, "") << "only an NCCL group gets the rendezvous' id";
  ExpectAllGatherWorks(*ucx->comm, 2, MemoryKind::kHost);

  // GPU ranks whose daemons did not all agree on NCCL: UCX, staged.
  absl::StatusOr<BackendChoice> staged = (*f)->Choose(Multi(2, false, {0, 1}));
  ASSERT_TRUE(staged.ok());
  EXPECT_EQ(staged->backend_name, "ucx");
  EXPECT_TRUE(staged->staged);

  absl::StatusOr<ConnectedCommunicator> nccl = (*f)->Connect(Multi(2, true, {0, 1}));
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->backend_name(), "nccl");
  ASSERT_EQ(nccl_specs.size(), 1u);
  EXPECT_EQ(nccl_specs[0].nccl_unique_id, std::string(128, 'x'));
}

TEST(CommunicatorFactoryTest, RefusesWhatItCannotRun) {
  auto f = CommunicatorFactory::Create({});
  ASSERT_TRUE(f.ok());
  // Several daemons without a remote backend.
  absl::StatusOr<ConnectedCommunicator> multi = (*f)->Connect(Multi(2, false));
  EXPECT_EQ(multi.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(multi.status().message(), HasSubstr("group g"));
  EXPECT_THAT(multi.status().message(), HasSubstr("UCX"));
  // Device memory without a copier.
  absl::StatusOr<BackendChoice> gpu = (*f)->Choose(Local(2, {0, 1}));
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(gpu.status().message(), HasSubstr("DeviceCopier"));
  // Not one device per local rank.
  absl::StatusOr<BackendChoice> bad = (*f)->Choose(Local(3, {0, 1}));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("2 local devices for 3 local ranks"));
}

TEST(CommunicatorFactoryTest, NcclIsRefusedCleanlyWithoutAGpu) {
  // An NCCL backend that cannot run here (no GPU) is refused when the factory is made.
  std::vector<GroupSpec> specs;
  CommunicatorFactoryOptions options;
  options.copier = std::make_shared<FakeCopier>();
  options.nccl = std::make_unique<FakeBackend>("nccl", /*viable=*/false, &specs);
  auto refused = CommunicatorFactory::Create(std::move(options));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("nccl backend cannot run here"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--gpu_collectives=host"));

  // No NCCL backend: no unique id, and GPU groups are staged over the host path.
  CommunicatorFactoryOptions host;
  host.copier = std::make_shared<FakeCopier>();
  auto f = CommunicatorFactory::Create(std::move(host));
  ASSERT_TRUE(f.ok());
  absl::StatusOr<std::string> id = (*f)->NcclUniqueId();
  EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(id.status().message(), HasSubstr("no NCCL backend"));
  absl::StatusOr<BackendChoice> choice = (*f)->Choose(Local(2, {0, 1}));
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->backend_name, "inproc");

  if (!FS_HAVE_NCCL) {
    // A build without NCCL cannot make ids even when handed an NCCL-named backend.
    CommunicatorFactoryOptions fake;
    fake.copier = std::make_shared<FakeCopier>();
    fake.nccl = std::make_unique<FakeBackend>("nccl", true, &specs);
    auto g = CommunicatorFactory::Create(std::move(fake));
    ASSERT_TRUE(g.ok());
    absl::StatusOr<std::string> none = (*g)->NcclUniqueId();
    EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(none.status().message(), HasSubstr("built without NCCL"));
  }
}

}  // namespace
}  // namespace flatshard::collective
