// Client against an in-process fake ShardService (fake_shard_service.h): sessions and leases,
// retries, error pass-through, views over the fake's real segments, summon lifetimes.
// The real daemon is exercised by the integration tests.
#include "flatshard/client.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_gpu.h"
#include "tests/client/fake_shard_service.h"

namespace flatshard::client {
namespace {

using ::testing::ElementsAre;
using testing::FakeShardServer;
using testing::FakeShardService;
using ::testing::HasSubstr;

// wte.weight is tied to lm_head.weight; the policy wraps h0 (a Block), so the plan has the
// root unit (wte.weight, shared lm_head.weight) and the h0 unit (h0.fc.weight, h0.fc.bias).
constexpr char kManifest[] = R"({"format": "flatshard.manifest/1", "root": {
  "id": 0, "type": "GPT", "bases": ["Module"], "params": [], "children": [
    {"name": "wte", "module": {"id": 1, "type": "Embedding", "bases": ["Module"], "params": [
      {"name": "weight", "id": 10, "shape": [8, 4], "dtype": "float32", "requires_grad": true}],
      "children": []}},
    {"name": "h0", "module": {"id": 2, "type": "Block", "bases": ["Module"], "params": [],
      "children": [
        {"name": "fc", "module": {"id": 3, "type": "Linear", "bases": ["Module"], "params": [
          {"name": "weight", "id": 11, "shape": [4, 4], "dtype": "float32", "requires_grad": true},
          {"name": "bias", "id": 12, "shape": [4], "dtype": "float32", "requires_grad": true}],
          "children": []}}]}},
    {"name": "lm_head", "module": {"id": 4, "type": "Linear", "bases": ["Module"], "params": [
      {"name": "weight", "id": 10, "shape": [8, 4], "dtype": "float32", "requires_grad": true}],
      "children": []}}]}})";
constexpr char kPolicy[] =
    R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Block"]}})";

// Polls `done` for up to five seconds.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(server_.ok()); }

  FakeShardService& fake() { return server_.service(); }

  ClientOptions Options() {
    ClientOptions o;
    o.address = server_.address();
    o.call_timeout = absl::Seconds(5);
    o.join_timeout = absl::Seconds(5);
    o.initial_backoff = absl::Milliseconds(1);
    o.max_backoff = absl::Milliseconds(4);
    return o;
  }

  std::unique_ptr<Client> Connect() {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(Options());
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Connected, joined as `rank` of `world_size` and registered at "".
  std::unique_ptr<Client> Registered(int world_size = 1, int rank = 0,
                                     InitMode init = InitMode::kZeros,
                                     RegisteredModule* out = nullptr) {
    std::unique_ptr<Client> c = Connect();
    if (c == nullptr) return nullptr;
    absl::Status joined = c->Join("g", world_size, rank, "secret");
    EXPECT_TRUE(joined.ok()) << joined;
    absl::StatusOr<RegisteredModule> m = c->Register("", kManifest, kPolicy, init);
    EXPECT_TRUE(m.ok()) << m.status();
    if (out != nullptr && m.ok()) *out = *std::move(m);
    return c;
  }

  template <typename T>
  T Fake(T FakeShardService::*field) {
    absl::MutexLock lock(&fake().mu);
    return fake().*field;
  }

  FakeShardServer server_;
};

TEST_F(ClientTest, ConnectRefusesBadOptions) {
  ClientOptions o = Options();
  o.address = "";
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.call_timeout = absl::ZeroDuration();
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.max_attempts = 0;
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, ConnectFailsUnavailableWhenNothingListens) {
  ClientOptions o = Options();
  o.address = "unix:/tmp/fs_client_test.nobody-listens.sock";
  o.call_timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(c.status().message(), HasSubstr("nobody-listens"));
}

TEST_F(ClientTest, JoinOpensALeaseCarryingTheCaller) {
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->joined());
  ASSERT_TRUE(c->Join("g", 2, 1, "secret").ok());
  EXPECT_TRUE(c->joined());
  EXPECT_TRUE(c->lease_status().ok());
  // Join returns once the first lease message is sent; the daemon reads it a moment later.
  ASSERT_TRUE(Eventually([&] { return Fake(&FakeShardService::open_leases) == 1; }));
  const v1::Caller caller = Fake(&FakeShardService::lease_caller);
  EXPECT_EQ(caller.group(), "g");
  EXPECT_EQ(caller.rank(), 1);
  EXPECT_EQ(caller.token(), "secret");
  EXPECT_EQ(caller.session(), FakeShardService::kSession);

  absl::Status again = c->Join("g", 2, 1, "secret");
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
}

TEST_F(ClientTest, JoinRefusesBadArguments) {
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Join("", 1, 0, "secret").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Join("g", 2, 2, "secret").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Join("g", 0, 0, "secret").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fake(&FakeShardService::join_calls), 0);
}

// A call that reached the daemon may have taken effect (a collective the daemon failed on
// purpose): its UNAVAILABLE is the daemon's answer and comes back unchanged, with no retry.
TEST_F(ClientTest, UnavailableFromTheDaemonIsNotRetried) {
  {
    absl::MutexLock lock(&fake().mu);
    fake().fail_join_unavailable = 2;
  }
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  absl::Status s = c->Join("g", 1, 0, "secret");
  EXPECT_EQ(s, absl::UnavailableError("fake: not ready"));
  EXPECT_EQ(Fake(&FakeShardService::join_calls), 1);
  EXPECT_FALSE(c->joined());
}

// Calls that never reached a daemon (it is restarting: nothing listens) are retried until it
// is back, within the call's deadline; only the attempt that reached it counts there.
TEST(ClientRetryTest, CallsThatNeverReachedTheDaemonAreRetriedUntilItIsBack) {
  auto first = std::make_unique<FakeShardServer>();
  ASSERT_TRUE(first->ok());
  const std::string path = first->path();
  ClientOptions o;
  o.address = first->address();
  o.call_timeout = absl::Seconds(10);
  o.join_timeout = absl::Seconds(10);
  o.max_attempts = 1000;
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Milliseconds(40);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  first.reset();  // the daemon goes away
  std::unique_ptr<FakeShardServer> second;
  std::thread restart([&] {
    absl::SleepFor(absl::Milliseconds(300));
    second = std::make_unique<FakeShardServer>(path);
  });
  const absl::Time start = absl::Now();
  absl::Status s = (*c)->Join("g", 1, 0, "secret");
  restart.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  ASSERT_NE(second, nullptr);
  absl::MutexLock lock(&second->service().mu);
  EXPECT_EQ(second->service().join_calls, 1);
}

TEST(ClientRetryTest, RetriesStopAtMaxAttemptsWithTheLastError) {
  auto server = std::make_unique<FakeShardServer>();
  ASSERT_TRUE(server->ok());
  ClientOptions o;
  o.address = server->address();
  o.call_timeout = absl::Seconds(20);
  o.max_attempts = 3;
  o.initial_backoff = absl::Milliseconds(1);
  o.max_backoff = absl::Milliseconds(4);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  ASSERT_TRUE(c.ok());
  server.reset();  // nothing listens any more
  const absl::Time start = absl::Now();
  absl::Status s = (*c)->Join("g", 1, 0, "secret");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "three failed connects, not the deadline";
  EXPECT_FALSE((*c)->joined());
}

TEST_F(ClientTest, OverlongNamesAreRefusedBeforeAnyRpc) {
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  absl::Status s = c->Join(std::string(257, 'g'), 1, 0, "secret");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("group has 257 bytes, the limit is 256"));
  s = c->Join("g", 1, 0, std::string(2000, 't'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("token"));
  EXPECT_EQ(Fake(&FakeShardService::join_calls), 0);
  ASSERT_TRUE(c->Join("g", 1, 0, "secret").ok());
  absl::StatusOr<RegisteredModule> m =
      c->Register(std::string(5000, 'm'), kManifest, kPolicy, InitMode::kZeros);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("module has 5000 bytes, the limit is 4096"));
  absl::StatusOr<std::unique_ptr<SummonedParams>> summoned =
      c->Summon("", std::string(8000, 'p'), SummonOptions());
  EXPECT_EQ(summoned.status().code(), absl::StatusCode::kInvalidArgument) << summoned.status();
  EXPECT_THAT(summoned.status().message(), HasSubstr("path has 8000 bytes"));
}

TEST_F(ClientTest, OtherErrorsAreNotRetriedAndPassThroughUnchanged) {
  {
    absl::MutexLock lock(&fake().mu);
    fake().join_error = absl::DeadlineExceededError("join of group g: missing ranks 1, 3");
  }
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  absl::Status s = c->Join("g", 4, 0, "secret");
  EXPECT_EQ(s, absl::DeadlineExceededError("join of group g: missing ranks 1, 3"));
  EXPECT_EQ(Fake(&FakeShardService::join_calls), 1);
}

TEST_F(ClientTest, ARefusedLeaseEndsTheSession) {
  const absl::Status refusal = absl::UnauthenticatedError("fake: session 42 is not yours");
  {
    absl::MutexLock lock(&fake().mu);
    fake().refuse_lease = refusal;
  }
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  // The refusal races with Join's return: Join reports it, or the next call does.
  const absl::Status joined = c->Join("g", 1, 0, "secret");
  if (!joined.ok()) {
    EXPECT_EQ(joined, refusal);
    EXPECT_FALSE(c->joined());
    EXPECT_EQ(Fake(&FakeShardService::leave_calls), 1);  // said goodbye
    return;
  }
  ASSERT_TRUE(Eventually([&] { return !c->lease_status().ok(); }));
  EXPECT_EQ(c->lease_status(), refusal);
  const absl::Status s = c->Summon("", "", SummonOptions()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is not yours"));
}

TEST_F(ClientTest, LeaseAcknowledgementsAreTolerated) {
  {
    absl::MutexLock lock(&fake().mu);
    fake().ack_lease = true;
  }
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(c->lease_status().ok());
  EXPECT_TRUE(c->Summon("", "", SummonOptions()).ok());
}

TEST_F(ClientTest, RegisterParsesJsonLocallyWithTheReadersMessages) {
  std::unique_ptr<Client> c = Connect();  // not even joined: input is checked first
  ASSERT_NE(c, nullptr);
  const std::string bad_manifest = R"({"format": "flatshard.manifest/1", "root": {"id": 0}})";
  absl::StatusOr<RegisteredModule> r = c->Register("", bad_manifest, kPolicy, InitMode::kZeros);
  EXPECT_EQ(r.status(), ManifestFromJson(bad_manifest).status());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);

  const std::string bad_policy = R"({"auto_wrap": {"kind": "sometimes"}})";
  r = c->Register("", kManifest, bad_policy, InitMode::kZeros);
  EXPECT_EQ(r.status(), PolicyFromJson(bad_policy).status());

  r = c->Register("", kManifest, kPolicy, InitMode::kZeros);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientTest, RegisterReturnsThePlanAndShardViews) {
  RegisteredModule m;
  std::unique_ptr<Client> c = Registered(1, 0, InitMode::kZeros, &m);
  ASSERT_NE(c, nullptr);
  ASSERT_NE(m.plan, nullptr);
  ASSERT_EQ(m.plan->units.size(), 2u);
  EXPECT_EQ(m.plan->units[1].module, "h0");
  EXPECT_EQ(m.init_summon, nullptr);
  ASSERT_EQ(m.shards.units().size(), 2u);
  const UnitShardView* s1 = m.shards.Find(1);
  ASSERT_NE(s1, nullptr);
  EXPECT_EQ(s1->shard_numel, m.plan->units[1].shard_numel);
  EXPECT_NE(s1->data, nullptr);
  EXPECT_EQ(s1->grad, nullptr);  // no gradient yet
  EXPECT_EQ(m.shards.Find(9), nullptr);
}

TEST_F(ClientTest, SummonViewsPointAtTheDaemonsBytes) {
  RegisteredModule m;
  std::unique_ptr<Client> c = Registered(1, 0, InitMode::kZeros, &m);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", SummonOptions());
  ASSERT_TRUE(s.ok()) << s.status();
  const SummonedParams& p = **s;
  EXPECT_TRUE(p.has_views());
  EXPECT_THAT(p.units(), ElementsAre(0, 1));
  // The fake fills element k of unit i with (i + 1) * 1000 + k.
  for (const PlanUnit& unit : m.plan->units) {
    for (const PlanParam& param : unit.params) {
      const ParamView* v = p.Find(param.fqn);
      ASSERT_NE(v, nullptr) << param.fqn;
      EXPECT_EQ(v->shape, param.shape);
      EXPECT_EQ(v->numel, param.numel);
      EXPECT_EQ(v->dtype, DType::kFloat32);
      EXPECT_TRUE(v->writable);
      EXPECT_EQ(static_cast<const float*>(v->data)[0], (unit.index + 1) * 1000 + param.offset)
          << param.fqn;
    }
  }
  const ParamView* wte = p.Find("wte.weight");
  const ParamView* lm_head = p.Find("lm_head.weight");
  ASSERT_NE(wte, nullptr);
  ASSERT_NE(lm_head, nullptr);
  EXPECT_EQ(lm_head->data, wte->data);
  EXPECT_EQ(p.FindGrad("wte.weight"), nullptr);  // without with_grads
  int views = 0;
  for (const ParamView& v : p) views += v.numel > 0;
  EXPECT_EQ(views, 4);  // three params and the tied alias
  ASSERT_TRUE((*s)->End().ok());
  EXPECT_FALSE((*s)->has_views());
  EXPECT_EQ((*s)->Find("wte.weight"), nullptr);
}

TEST_F(ClientTest, SteadyStateSummonsMakeNoNewMappings) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", SummonOptions());
    ASSERT_TRUE(s.ok()) << s.status();
  }
  const int64_t maps = c->segment_map_calls();
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", SummonOptions());
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE((*s)->End().ok());
  }
  EXPECT_EQ(c->segment_map_calls(), maps);
}

TEST_F(ClientTest, SummonWithoutWritebackIsReadOnly) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  SummonOptions o;
  o.writeback = false;
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "h0", o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT((*s)->units(), ElementsAre(1));
  const ParamView* v = (*s)->Find("h0.fc.bias");
  ASSERT_NE(v, nullptr);
  EXPECT_FALSE(v->writable);
  EXPECT_EQ((*s)->Find("wte.weight"), nullptr);  // not summoned
}

TEST_F(ClientTest, Rank0OnlyLeavesOtherRanksWithoutViews) {
  std::unique_ptr<Client> c = Registered(/*world_size=*/2, /*rank=*/1);
  ASSERT_NE(c, nullptr);
  SummonOptions o;
  o.rank0_only = true;
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE((*s)->has_views());
  EXPECT_THAT((*s)->units(), ElementsAre(0, 1));
  EXPECT_EQ((*s)->Find("wte.weight"), nullptr);
  const uint64_t id = (*s)->id();
  ASSERT_TRUE((*s)->End().ok());  // still collective: the rank ends it
  EXPECT_THAT(Fake(&FakeShardService::ended_summons), ElementsAre(id));
}

TEST_F(ClientTest, EndCallsTheDaemonOnceAndTheDestructorEndsTheRest) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::unique_ptr<SummonedParams>> a = c->Summon("", "", SummonOptions());
  absl::StatusOr<std::unique_ptr<SummonedParams>> b = c->Summon("", "", SummonOptions());
  ASSERT_TRUE(a.ok() && b.ok());
  const uint64_t id_a = (*a)->id();
  const uint64_t id_b = (*b)->id();
  EXPECT_TRUE((*a)->End().ok());
  EXPECT_TRUE((*a)->End().ok());
  b->reset();
  EXPECT_THAT(Fake(&FakeShardService::ended_summons), ElementsAre(id_a, id_b));
}

TEST_F(ClientTest, SummonErrorsPassThroughUnchanged) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  const absl::Status busy = absl::FailedPreconditionError(
      "Cannot manually unshard parameters when already unsharding parameters");
  {
    absl::MutexLock lock(&fake().mu);
    fake().summon_error = busy;
  }
  EXPECT_EQ(c->Summon("", "", SummonOptions()).status(), busy);
}

TEST_F(ClientTest, SummonOfAModuleThisClientDidNotRegisterIsNotFound) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("other", "", SummonOptions());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Fake(&FakeShardService::summons).empty());
}

TEST_F(ClientTest, WithGradsGivesGradientViews) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  SummonOptions o;
  o.with_grads = true;
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", o);
  ASSERT_TRUE(s.ok()) << s.status();
  const ParamView* g = (*s)->FindGrad("h0.fc.bias");
  const ParamView* p = (*s)->Find("h0.fc.bias");
  ASSERT_NE(g, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_NE(g->data, p->data);
  EXPECT_EQ(g->shape, p->shape);
  EXPECT_EQ((*s)->FindGrad("lm_head.weight")->data, (*s)->FindGrad("wte.weight")->data);
  EXPECT_TRUE(Fake(&FakeShardService::summons).back().options().with_grads());
}

TEST_F(ClientTest, InitSummonIsWritableAndEndsLikeAnyOther) {
  RegisteredModule m;
  std::unique_ptr<Client> c = Registered(1, 0, InitMode::kFromEveryRank, &m);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(Fake(&FakeShardService::last_init), v1::INIT_MODE_FROM_EVERY_RANK);
  ASSERT_NE(m.init_summon, nullptr);
  ASSERT_TRUE(m.init_summon->has_views());
  const ParamView* v = m.init_summon->Find("h0.fc.weight");
  ASSERT_NE(v, nullptr);
  EXPECT_TRUE(v->writable);
  static_cast<float*>(v->data)[0] = 1.5f;
  const uint64_t id = m.init_summon->id();
  ASSERT_TRUE(m.init_summon->End().ok());
  EXPECT_THAT(Fake(&FakeShardService::ended_summons), ElementsAre(id));
}

TEST_F(ClientTest, ReduceScatterWritesTheFullGradientThenFinishes) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  absl::Status s = c->ReduceScatterGrads(
      "", 1, ReduceOp::kAvg, /*accumulate=*/true, [](PendingReduceScatter& g) {
        if (g.dtype() != DType::kFloat32 || g.numel() < 20) {
          return absl::InternalError("unexpected buffer");
        }
        const ParamView* w = g.Find("h0.fc.weight");
        if (w == nullptr || w->data != g.data() || !w->writable) {
          return absl::InternalError("bad view");
        }
        static_cast<float*>(w->data)[0] = 3.5f;
        return absl::OkStatus();
      });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Fake(&FakeShardService::first_full_grad_at_finish), 3.5f);
  const std::vector<v1::ReduceScatterGradsRequest> calls = Fake(&FakeShardService::reduce_scatters);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_TRUE(calls[0].begin());
  EXPECT_FALSE(calls[1].begin());
  for (const auto& r : calls) {
    EXPECT_EQ(r.unit(), 1);
    EXPECT_EQ(r.op(), v1::REDUCE_OP_AVG);
    EXPECT_TRUE(r.accumulate());
  }
  // Steady state: no new mapping for the next step.
  const int64_t maps = c->segment_map_calls();
  ASSERT_TRUE(c->ReduceScatterGrads("", 1, ReduceOp::kSum, false, [](PendingReduceScatter&) {
                 return absl::OkStatus();
               }).ok());
  EXPECT_EQ(c->segment_map_calls(), maps);
  EXPECT_EQ(c->BeginReduceScatter("", 7, ReduceOp::kSum, false).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ClientTest, AFailingFillReducesNothing) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  absl::Status s = c->ReduceScatterGrads("", 0, ReduceOp::kSum, false, [](PendingReduceScatter&) {
    return absl::InvalidArgumentError("no gradient");
  });
  EXPECT_EQ(s, absl::InvalidArgumentError("no gradient"));
  EXPECT_EQ(Fake(&FakeShardService::reduce_scatters).size(), 1u);  // begin only
}

TEST_F(ClientTest, ShardViewsCarryOffsetsAndGradients) {
  RegisteredModule m;
  std::unique_ptr<Client> c = Registered(/*world_size=*/2, /*rank=*/1, InitMode::kZeros, &m);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<ShardViews> shards = c->GetShardViews("");
  ASSERT_TRUE(shards.ok()) << shards.status();
  std::vector<int32_t> units;
  for (const UnitShardView& s : *shards) {
    units.push_back(s.unit);
    EXPECT_EQ(s.shard_numel, m.plan->units[s.unit].shard_numel);
    EXPECT_EQ(s.shard_offset, s.shard_numel);  // rank 1 of 2
    EXPECT_NE(s.data, nullptr);
    EXPECT_NE(s.grad, nullptr);
    EXPECT_NE(s.grad, s.data);
  }
  EXPECT_THAT(units, ElementsAre(0, 1));
  // The registration's views and these map the same segments: no new maps, same pointers.
  EXPECT_EQ(shards->Find(1)->data, m.shards.Find(1)->data);
}

TEST_F(ClientTest, ABrokenLeaseEndsTheSessionAndJoinStartsANewOne) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  {
    absl::MutexLock lock(&fake().mu);
    fake().break_lease = absl::UnavailableError("fake: daemon draining");
  }
  ASSERT_TRUE(Eventually([&] { return !c->lease_status().ok(); }));
  EXPECT_EQ(c->lease_status(), absl::UnavailableError("fake: daemon draining"));
  absl::Status s = c->Summon("", "", SummonOptions()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("fake: daemon draining"));
  {
    absl::MutexLock lock(&fake().mu);
    fake().break_lease = absl::OkStatus();
  }
  ASSERT_TRUE(c->Join("g", 1, 0, "secret").ok());
  EXPECT_TRUE(c->lease_status().ok());
  EXPECT_THAT(c->registered_modules(), ElementsAre(""));  // re-attach: register again
  EXPECT_EQ(c->Summon("", "", SummonOptions()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientTest, LeaveEndsTheSessionAndClosesTheLease) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(Eventually([&] { return Fake(&FakeShardService::open_leases) == 1; }));
  ASSERT_TRUE(c->Leave().ok());
  EXPECT_FALSE(c->joined());
  EXPECT_EQ(Fake(&FakeShardService::leave_calls), 1);
  EXPECT_TRUE(Eventually([&] { return Fake(&FakeShardService::closed_leases) == 1; }));
  EXPECT_EQ(c->Summon("", "", SummonOptions()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->Leave().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->Join("g", 1, 0, "secret").ok());  // the rank can join again
}

TEST_F(ClientTest, DestroyingTheClientClosesTheLease) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(Eventually([&] { return Fake(&FakeShardService::open_leases) == 1; }));
  c.reset();
  EXPECT_TRUE(Eventually([&] { return Fake(&FakeShardService::closed_leases) == 1; }));
  EXPECT_EQ(Fake(&FakeShardService::leave_calls), 0);
}

TEST_F(ClientTest, ASummonOutlivingItsClientStaysReadableAndEndFails) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", SummonOptions());
  ASSERT_TRUE(s.ok()) << s.status();
  c.reset();
  const ParamView* v = (*s)->Find("h0.fc.weight");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(static_cast<const float*>(v->data)[0], 2000.0f);  // the mapping is still alive
  absl::Status ended = (*s)->End();
  EXPECT_EQ(ended.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ended.message(), HasSubstr("Client is gone"));
  EXPECT_TRUE(Fake(&FakeShardService::ended_summons).empty());
}

TEST_F(ClientTest, ConcurrentSummonsFromManyThreads) {
  std::unique_ptr<Client> c = Registered();
  ASSERT_NE(c, nullptr);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&c] {
      for (int i = 0; i < 10; ++i) {
        absl::StatusOr<std::unique_ptr<SummonedParams>> s = c->Summon("", "", SummonOptions());
        ASSERT_TRUE(s.ok()) << s.status();
        ASSERT_NE((*s)->Find("wte.weight"), nullptr);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(Fake(&FakeShardService::ended_summons).size(), 40u);
}

}  // namespace
}  // namespace flatshard::client

// --- GPU memory: wiring checked with FakeDeviceMemoryOpener and FakeCudaEventApi -------------

namespace flatshard::client {
namespace {

class ClientGpuTest : public ClientTest {
 protected:
  static constexpr uintptr_t kStream = 0x77;  // logged as "stream 119"

  // Connected with the fakes, joined as rank 0 of 1 and registered at "".
  std::unique_ptr<Client> RegisteredWithFakes(RegisteredModule* out = nullptr,
                                              InitMode init = InitMode::kZeros) {
    ClientOptions o = Options();
    o.cuda_stream = reinterpret_cast<void*>(kStream);
    internal::GpuApis apis;
    apis.opener = std::make_unique<testing::FakeDeviceMemoryOpener>(log_);
    apis.events = std::make_unique<testing::FakeCudaEventApi>(log_);
    absl::StatusOr<std::unique_ptr<Client>> c =
        internal::ConnectWithGpuApis(std::move(o), std::move(apis));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return nullptr;
    EXPECT_TRUE((*c)->Join("g", 1, 0, "secret").ok());
    absl::StatusOr<RegisteredModule> m = (*c)->Register("", kManifest, kPolicy, init);
    EXPECT_TRUE(m.ok()) << m.status();
    if (out != nullptr && m.ok()) *out = *std::move(m);
    return *std::move(c);
  }

  void DeviceMode() {
    absl::MutexLock lock(&fake().mu);
    fake().device_memory = true;
  }

  // Log entries starting with `prefix`.
  std::vector<std::string> Logged(const std::string& prefix) {
    std::vector<std::string> out;
    for (const std::string& c : log_->Calls()) {
      if (c.rfind(prefix, 0) == 0) out.push_back(c);
    }
    return out;
  }

  std::shared_ptr<testing::FakeGpuLog> log_ = std::make_shared<testing::FakeGpuLog>();
};

TEST_F(ClientGpuTest, HostSessionsNeverTouchTheGpuApis) {
  RegisteredModule m;
  std::unique_ptr<Client> c = RegisteredWithFakes(&m, InitMode::kFromEveryRank);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(m.init_summon->End().ok());
  for (const UnitShardView& s : m.shards) EXPECT_EQ(s.device, -1);
  {
    absl::StatusOr<std::unique_ptr<SummonedParams>> p = c->Summon("", "", {});
    ASSERT_TRUE(p.ok()) << p.status();
    for (const ParamView& v : (*p)->params()) EXPECT_EQ(v.device, -1);
    ASSERT_TRUE((*p)->End().ok());
  }
  ASSERT_TRUE(c->ReduceScatterGrads("", 1, ReduceOp::kSum, false, [](PendingReduceScatter& g) {
                 return g.device() == -1 ? absl::OkStatus() : absl::InternalError("device");
               }).ok());
  ASSERT_TRUE(c->GetShardViews("").ok());
  ASSERT_TRUE(c->Leave().ok());
  EXPECT_EQ(log_->total_calls(), 0) << log_->Calls().front();
  EXPECT_EQ(c->ipc_open_calls(), 0);
  for (const auto& r : Fake(&FakeShardService::summons)) EXPECT_FALSE(r.has_written());
  for (const auto& r : Fake(&FakeShardService::end_summons)) EXPECT_FALSE(r.has_written());
  for (const auto& r : Fake(&FakeShardService::reduce_scatters)) EXPECT_FALSE(r.has_written());
}

TEST_F(ClientGpuTest, DeviceViewsOpenEachSlabOnceAndOrderThroughEvents) {
  DeviceMode();
  RegisteredModule m;
  std::unique_ptr<Client> c = RegisteredWithFakes(&m);
  ASSERT_NE(c, nullptr);
  for (const UnitShardView& s : m.shards) EXPECT_EQ(s.device, 0);
  const int64_t after_register = c->ipc_open_calls();
  EXPECT_EQ(after_register, 2);  // one shard slab per unit
  EXPECT_EQ(c->segment_map_calls(), 0);
  EXPECT_TRUE(Logged("Create").empty());  // nothing to order yet

  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> p = c->Summon("", "h0", {});
    ASSERT_TRUE(p.ok()) << p.status();
    const ParamView* w = (*p)->Find("h0.fc.weight");
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->device, 0);
    EXPECT_TRUE(w->writable);
    EXPECT_EQ(static_cast<const float*>(w->data)[1], 2001.0f);  // the fake's bytes
    ASSERT_TRUE((*p)->End().ok());
  }
  // The unsharded buffers share one slab: opened at the first summon only.
  EXPECT_EQ(c->ipc_open_calls(), after_register + 1);

  // One event of this process (created once, recorded per Summon and End); the daemon's
  // ready event opened once and waited on after every Summon, all on the trainer's stream.
  EXPECT_THAT(Logged("Create"), ElementsAre("Create(0)=1"));
  EXPECT_EQ(Logged("Record(1, stream 119, 0)").size(), 6u);
  EXPECT_THAT(Logged("OpenEvent"), ElementsAre("OpenEvent(daemon-ready, 0)=2"));
  EXPECT_EQ(Logged("Wait(stream 119, 2, 0)").size(), 3u);
  const std::vector<v1::SummonRequest> summons = Fake(&FakeShardService::summons);
  ASSERT_EQ(summons.size(), 3u);
  const v1::CudaEvent written = summons[0].written();
  EXPECT_NE(written.id(), 0u);
  EXPECT_EQ(written.ipc_handle(), testing::FakeCudaEventApi::Handle("ev1"));
  EXPECT_EQ(written.device_uuid(), "GPU-fake-0");
  for (const auto& r : Fake(&FakeShardService::end_summons)) {
    EXPECT_EQ(r.written().id(), written.id());
  }
}

TEST_F(ClientGpuTest, ReduceScatterFinishSendsWrittenAndWaitsForReady) {
  DeviceMode();
  std::unique_ptr<Client> c = RegisteredWithFakes();
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::unique_ptr<PendingReduceScatter>> g =
      c->BeginReduceScatter("", 1, ReduceOp::kSum, false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->device(), 0);
  EXPECT_EQ((*g)->Find("h0.fc.bias")->device, 0);
  EXPECT_TRUE(Logged("Record").empty());  // phase 1 orders nothing
  ASSERT_TRUE((*g)->Finish().ok());
  const std::vector<v1::ReduceScatterGradsRequest> calls = Fake(&FakeShardService::reduce_scatters);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_FALSE(calls[0].has_written());
  EXPECT_NE(calls[1].written().id(), 0u);
  // Recorded before the RPC, waited on after it.
  const std::vector<std::string> log = log_->Calls();
  const auto record = std::find(log.begin(), log.end(), "Record(1, stream 119, 0)");
  const auto wait = std::find(log.begin(), log.end(), "Wait(stream 119, 2, 0)");
  ASSERT_NE(record, log.end());
  ASSERT_NE(wait, log.end());
  EXPECT_LT(record - log.begin(), wait - log.begin());

  ASSERT_TRUE(c->ReduceScatterGrads("", 1, ReduceOp::kSum, false, [](PendingReduceScatter&) {
                 return absl::OkStatus();
               }).ok());
  EXPECT_THAT(Logged("OpenEvent"), ::testing::SizeIs(1));  // cached by id
  absl::StatusOr<ShardViews> shards = c->GetShardViews("");
  ASSERT_TRUE(shards.ok());
  for (const UnitShardView& s : *shards) EXPECT_EQ(s.device, 0);
}

TEST_F(ClientGpuTest, AViewSetupFailureEndsTheSummonWithoutWritten) {
  DeviceMode();
  std::unique_ptr<Client> c = RegisteredWithFakes();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Summon("", "", {}).ok());  // opens the params slab; ended at once
  {
    absl::MutexLock lock(&log_->mu);
    log_->gpus.erase("GPU-fake-0");  // the gradient slab's GPU is not visible now
  }
  SummonOptions with_grads;
  with_grads.with_grads = true;
  absl::StatusOr<std::unique_ptr<SummonedParams>> p = c->Summon("", "", with_grads);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(p.status().message(), HasSubstr("device segment slab:/"));
  EXPECT_THAT(p.status().message(), HasSubstr(" on GPU GPU-fake-0: "));
  const std::vector<v1::EndSummonRequest> ends = Fake(&FakeShardService::end_summons);
  ASSERT_EQ(ends.size(), 2u);
  EXPECT_TRUE(ends[0].has_written());
  EXPECT_FALSE(ends[1].has_written());  // the trainer never saw its views
}

// The real CUDA runtime, no GPU here: device memory fails Register cleanly.
TEST_F(ClientGpuTest, DeviceMemoryWithoutAUsableGpuFailsCleanly) {
  DeviceMode();
  std::unique_ptr<Client> c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Join("g", 1, 0, "secret").ok());
  absl::StatusOr<RegisteredModule> m = c->Register("", kManifest, kPolicy, InitMode::kZeros);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("on GPU GPU-fake-0"));
  if (m.status().code() == absl::StatusCode::kFailedPrecondition) {
    EXPECT_THAT(m.status().message(),
                HasSubstr("the daemon placed this rank's memory on GPU GPU-fake-0 but this "
                          "process has no usable GPU"));
  } else {
    EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();  // a GPU host
  }
}

}  // namespace
}  // namespace flatshard::client
