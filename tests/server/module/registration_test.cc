// The registration exchange (server/registration.h) over a real inproc communicator, ranks on
// threads, no GroupManager: the verdicts every rank reaches (same model, a refused plan,
// different models naming the first differing unit on both sides, different init modes, a
// failed allocation, a missing rank) and what AllocateRegistration allocates.

#include "server/registration.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_backend.h"
#include "tests/testing/files.h"

namespace flatshard::server {
namespace {

using ::flatshard::testing::ExampleModelFile;
using ::testing::HasSubstr;

std::shared_ptr<const absl::StatusOr<Plan>> PlanOf(const std::string& model, int world_size) {
  absl::StatusOr<Manifest> manifest = ManifestFromJson(ExampleModelFile(model, "manifest"));
  absl::StatusOr<Policy> policy = PolicyFromJson(ExampleModelFile(model, "policy"));
  EXPECT_TRUE(manifest.ok() && policy.ok());
  PlanOptions options;
  options.world_size = world_size;
  return std::make_shared<const absl::StatusOr<Plan>>(BuildPlan(*manifest, *policy, options));
}

class RegistrationTest : public ::testing::Test {
 protected:
  void Form(int world_size) {
    auto backend = collective::CreateInprocBackend();
    ASSERT_TRUE(backend.ok());
    backend_ = *std::move(backend);
    const collective::GroupSpec spec = collective::GroupSpec::AllLocal("g", world_size);
    auto comm = backend_->Connect(spec);
    ASSERT_TRUE(comm.ok());
    auto coll = engine_.AddGroup(spec, *std::move(comm));
    ASSERT_TRUE(coll.ok());
    coll_ = *std::move(coll);
  }

  RegistrationProposal Proposal(int rank, int world_size,
                                std::shared_ptr<const absl::StatusOr<Plan>> plan,
                                InitMode init = InitMode::kZeros) {
    RegistrationProposal p;
    p.group = "g";
    p.rank = rank;
    p.world_size = world_size;
    p.module = "model";
    p.plan = std::move(plan);
    p.init = init;
    return p;
  }

  // Runs every proposal's agreement on its own thread; returns each rank's verdict.
  std::vector<absl::Status> Agree(std::vector<RegistrationProposal> proposals,
                                  absl::Duration within = absl::Seconds(10)) {
    const size_t n = proposals.size();
    std::vector<absl::Status> verdicts(n, absl::InternalError("no verdict"));
    std::vector<absl::Notification> done(n);
    std::vector<std::thread> threads;
    const absl::Time deadline = absl::Now() + within;
    for (size_t i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        AgreeOnRegistration(coll_, std::move(proposals[i]), deadline, Clock::Real(),
                            [&, i](absl::Status s) {
                              verdicts[i] = std::move(s);
                              done[i].Notify();
                            });
      });
    }
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < n; ++i) {
      EXPECT_TRUE(done[i].WaitForNotificationWithTimeout(absl::Seconds(20))) << "rank " << i;
    }
    return verdicts;
  }

  collective::CollectiveEngine engine_;
  std::unique_ptr<collective::CollectiveBackend> backend_;
  std::shared_ptr<collective::CollectiveGroup> coll_;
};

TEST_F(RegistrationTest, SameModelAgrees) {
  Form(3);
  auto plan = PlanOf("gpt_tied", 3);
  ASSERT_TRUE(plan->ok()) << plan->status();
  std::vector<RegistrationProposal> ps;
  for (int r = 0; r < 3; ++r) ps.push_back(Proposal(r, 3, plan, InitMode::kFromRank0));
  for (const absl::Status& s : Agree(std::move(ps))) EXPECT_TRUE(s.ok()) << s;
}

TEST_F(RegistrationTest, ARefusedPlanFailsEveryRankNamingIt) {
  Form(2);
  auto good = PlanOf("gpt_tied", 2);
  auto refused = std::make_shared<const absl::StatusOr<Plan>>(
      absl::InvalidArgumentError("manifest: unit \"blocks.0\" has no parameters"));
  std::vector<absl::Status> v = Agree({Proposal(0, 2, good), Proposal(1, 2, refused)});
  EXPECT_EQ(v[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v[0].message(),
            "group g: rank 1's registration of module \"model\" was refused: manifest: unit "
            "\"blocks.0\" has no parameters");
  // The refused rank gets its own planner status.
  EXPECT_EQ(v[1], refused->status());
}

// A plan refused for the group rather than the input (HYBRID_* over daemons whose ranks are
// not consecutive) fails every rank with the refusing rank's code.
TEST_F(RegistrationTest, ARefusalKeepsItsCodeOnEveryRank) {
  Form(2);
  auto good = PlanOf("gpt_tied", 2);
  auto refused = std::make_shared<const absl::StatusOr<Plan>>(
      absl::FailedPreconditionError("group g: HYBRID_SHARD shards within a node's ranks"));
  std::vector<absl::Status> v = Agree({Proposal(0, 2, good), Proposal(1, 2, refused)});
  EXPECT_EQ(v[0].code(), absl::StatusCode::kFailedPrecondition) << v[0];
  EXPECT_EQ(v[0].message(),
            "group g: rank 1's registration of module \"model\" was refused: group g: "
            "HYBRID_SHARD shards within a node's ranks");
  EXPECT_EQ(v[1], refused->status());
}

TEST_F(RegistrationTest, DifferentModelsNameTheFirstDifferingUnitOnEveryRank) {
  Form(2);
  auto a = PlanOf("gpt_tied", 2);
  auto b = PlanOf("convnet_bn", 2);
  ASSERT_TRUE(a->ok() && b->ok());
  std::vector<absl::Status> v = Agree({Proposal(0, 2, a), Proposal(1, 2, b)});
  EXPECT_EQ(v[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v[0].message(),
              HasSubstr("group g: ranks registered different models for module \"model\": "));
  EXPECT_THAT(v[0].message(), HasSubstr("first difference at unit"));
  EXPECT_THAT(v[0].message(), HasSubstr("rank 0 has"));
  EXPECT_THAT(v[0].message(), HasSubstr("rank 1 has"));
  EXPECT_EQ(v[0], v[1]) << "every rank names the same difference";
}

TEST_F(RegistrationTest, DifferentInitModesAreRefused) {
  Form(2);
  auto plan = PlanOf("gpt_tied", 2);
  std::vector<absl::Status> v = Agree(
      {Proposal(0, 2, plan, InitMode::kZeros), Proposal(1, 2, plan, InitMode::kFromEveryRank)});
  for (const absl::Status& s : v) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(),
              "group g: ranks registered different models for module \"model\": rank 0 and rank "
              "1 asked for different init modes");
  }
}

TEST_F(RegistrationTest, AFailedAllocationFailsEveryRank) {
  Form(2);
  auto plan = PlanOf("gpt_tied", 2);
  RegistrationProposal p1 = Proposal(1, 2, plan);
  p1.allocation = absl::ResourceExhaustedError("memory limit of 0 bytes reached");
  std::vector<absl::Status> v = Agree({Proposal(0, 2, plan), std::move(p1)});
  for (const absl::Status& s : v) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(s.message(),
              "group g: rank 1 could not allocate the shards of module \"model\": memory limit "
              "of 0 bytes reached");
  }
}

TEST_F(RegistrationTest, AMissingRankEndsAtTheDeadline) {
  Form(2);
  auto plan = PlanOf("gpt_tied", 2);
  std::vector<absl::Status> v = Agree({Proposal(0, 2, plan)}, absl::Milliseconds(200));
  EXPECT_EQ(v[0].code(), absl::StatusCode::kDeadlineExceeded) << v[0];
}

TEST(AllocateRegistrationTest, ShardsCommittedCopiesAndInitBuffersWhereAsked) {
  ShardStore store(ShardStoreOptions{"fsregt"});
  auto plan = PlanOf("gpt_tied", 2);
  ASSERT_TRUE(plan->ok());
  const Plan& p = **plan;
  const Caller rank0{"g", 0, "tok", 1, -1};
  const Caller rank1{"g", 1, "tok", 2, -1};

  RegistrationBuffers zeros =
      AllocateRegistration(store, p, rank1, "", InitMode::kZeros, Placement::Host());
  ASSERT_TRUE(zeros.status.ok()) << zeros.status;
  ASSERT_EQ(zeros.shards.size(), p.units.size());
  ASSERT_EQ(zeros.committed.size(), p.units.size());
  for (size_t i = 0; i < p.units.size(); ++i) {
    const PlanUnit& u = p.units[i];
    EXPECT_EQ(zeros.shards[i].unit, u.index);
    EXPECT_EQ(zeros.shards[i].shard->bytes(), u.shard_numel * ItemSize(u.dtype));
    EXPECT_EQ(zeros.committed[i]->bytes(), u.shard_numel * ItemSize(u.dtype));
    EXPECT_NE(zeros.committed[i].get(), zeros.shards[i].shard.get());
    EXPECT_EQ(zeros.init_buffers[i], nullptr);
  }

  // FROM_RANK0: only rank 0 fills full buffers.
  RegistrationBuffers r0 =
      AllocateRegistration(store, p, rank0, "", InitMode::kFromRank0, Placement::Host());
  RegistrationBuffers r1 =
      AllocateRegistration(store, p, rank1, "", InitMode::kFromRank0, Placement::Host());
  ASSERT_TRUE(r0.status.ok() && r1.status.ok());
  for (size_t i = 0; i < p.units.size(); ++i) {
    ASSERT_NE(r0.init_buffers[i], nullptr);
    EXPECT_EQ(r0.init_buffers[i]->bytes(), p.units[i].padded_numel * ItemSize(p.units[i].dtype));
    EXPECT_EQ(r1.init_buffers[i], nullptr);
  }
}

TEST(AllocateRegistrationTest, AFailureReleasesEverything) {
  ShardStoreOptions options{"fsregt"};
  options.memory_limit_bytes = 1;  // the first non-trivial shard does not fit
  ShardStore store(options);
  auto plan = PlanOf("gpt_tied", 2);
  ASSERT_TRUE(plan->ok());
  RegistrationBuffers b = AllocateRegistration(store, **plan, Caller{"g", 0, "tok", 1, -1}, "",
                                               InitMode::kFromEveryRank, Placement::Host());
  EXPECT_EQ(b.status.code(), absl::StatusCode::kResourceExhausted) << b.status;
  EXPECT_TRUE(b.shards.empty());
  EXPECT_TRUE(b.committed.empty());
  EXPECT_TRUE(b.init_buffers.empty());
}

}  // namespace
}  // namespace flatshard::server
