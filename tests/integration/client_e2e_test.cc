// End-to-end tests of the C++ client library against real flatshardd processes: real gRPC over
// a real Unix socket, real shared-memory segments. Ranks are threads, each with its own Client;
// a client that must die is a separate process (this binary again, running only
// ClientE2EChild.*: gRPC must not be used across fork).
// Every test runs in each Layout of tests/testing/cluster.h: one daemon (a local group), or
// several daemons on this host standing in for nodes, each rank's Client connected to its own
// rank's daemon and joining with daemon 0 as the coordinator.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_e2e_testing.h"
#include "tests/testing/cluster.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/shard_snapshot.h"
#include "tests/testing/shm_mappings.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::client {
namespace {

using e2e::Connect;
using e2e::JoinAndRegister;
using e2e::kToken;
using e2e::Rank;
using e2e::ReadOnly;
using ::flatshard::testing::SnapshotShards;

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using ::flatshard::testing::ReadFile;

using ::flatshard::testing::ExampleModelFile;

using ::flatshard::testing::SegmentExists;
using ::flatshard::testing::SegmentOf;

using ::flatshard::testing::Cluster;
using ::flatshard::testing::Layout;

// Every test runs once per layout; rank r's Client connects to the cluster's AddressFor(r).
class ClientE2ETest : public ::testing::TestWithParam<Layout> {
 protected:
  static ::flatshard::testing::ClusterOptions Options() {
    ::flatshard::testing::ClusterOptions o;
    o.tag_prefix = "fscl";
    return o;
  }
};

using Summons = std::vector<std::unique_ptr<SummonedParams>>;

// Every rank summons `path` with `options`; a failed rank's entry is null (and the test fails).
Summons SummonAll(std::vector<Rank>& ranks, const SummonOptions& options,
                  const std::string& path = "") {
  Summons out(ranks.size());
  ::flatshard::testing::RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", path, options);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    out[r] = *std::move(s);
  });
  return out;
}

// Every rank ends its summon (concurrently: a rank0_only writeback waits for rank 0).
void EndAll(Summons& summons) {
  ::flatshard::testing::RunRanks(static_cast<int>(summons.size()), [&](int r) {
    if (summons[r] == nullptr) return;
    absl::Status s = summons[r]->End();
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
  });
}

// Deterministic values: element i of parameter `fqn`, exact in float32.
float Value(const std::string& fqn, int64_t i) {
  uint32_t h = 2166136261u;
  for (unsigned char c : fqn) h = (h ^ c) * 16777619u;
  return static_cast<float>(1 + h % 61) + static_cast<float>(i % 64) * 0.25f;
}

// Writes Value() into every parameter of a writable summon.
void Fill(const Plan& plan, const SummonedParams& s) {
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      const ParamView* v = s.Find(p.fqn);
      ASSERT_NE(v, nullptr) << p.fqn;
      ASSERT_TRUE(v->writable) << p.fqn;
      float* data = static_cast<float*>(v->data);
      for (int64_t i = 0; i < p.numel; ++i) data[i] = Value(p.fqn, i);
    }
  }
}

// Checks unit `u`'s parameters in a summon against Value().
void ExpectUnitValues(const PlanUnit& u, const SummonedParams& s) {
  for (const PlanParam& p : u.params) {
    const ParamView* v = s.Find(p.fqn);
    ASSERT_NE(v, nullptr) << p.fqn;
    const float* data = static_cast<const float*>(v->data);
    for (int64_t i = 0; i < p.numel; ++i) {
      ASSERT_EQ(data[i], Value(p.fqn, i)) << p.fqn << "[" << i << "]";
    }
  }
}

// Checks every parameter of a summon against Value().
void ExpectValues(const Plan& plan, const SummonedParams& s) {
  for (const PlanUnit& u : plan.units) ExpectUnitValues(u, s);
}

// Every rank writes Value() into its full views and ends with writeback: each keeps its range.
void InitValues(std::vector<Rank>& ranks) {
  SummonOptions writeback;
  writeback.writeback = true;
  Summons s = SummonAll(ranks, writeback);
  ::flatshard::testing::RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    if (s[r] != nullptr) Fill(*ranks[r].model.plan, *s[r]);
  });
  EndAll(s);
}

// Every rank reduce-scatters a gradient for `unit`, writing value(rank) everywhere.
void ReduceScatterAll(std::vector<Rank>& ranks, int32_t unit, ReduceOp op, bool accumulate,
                      const std::function<float(int)>& value) {
  ::flatshard::testing::RunRanks(static_cast<int>(ranks.size()), [&](int r) {
    absl::Status s = ranks[r].client->ReduceScatterGrads(
        "", unit, op, accumulate, [&](PendingReduceScatter& pending) {
          float* data = static_cast<float*>(pending.data());
          for (int64_t i = 0; i < pending.numel(); ++i) data[i] = value(r);
          return absl::OkStatus();
        });
    EXPECT_TRUE(s.ok()) << "rank " << r << " unit " << unit << ": " << s;
  });
}

// ---- Views ----

TEST_P(ClientE2ETest, TiedFqnsAliasOneView) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "tied", 2);
  SummonOptions writeback;
  writeback.writeback = true;
  Summons s = SummonAll(ranks, writeback);
  for (int r = 0; r < 2; ++r) {
    ASSERT_NE(s[r], nullptr);
    const ParamView* wte = s[r]->Find("wte.weight");
    const ParamView* head = s[r]->Find("lm_head.weight");
    ASSERT_NE(wte, nullptr);
    ASSERT_NE(head, nullptr);
    EXPECT_EQ(head->data, wte->data) << "rank " << r;
    EXPECT_EQ(head->unit, wte->unit);
    EXPECT_THAT(head->shape, ElementsAre(64, 16));
    EXPECT_EQ(head->numel, 1024);
    EXPECT_TRUE(head->writable);
    // An edit through one FQN is an edit of the other.
    static_cast<float*>(head->data)[5] = 42.0f + r;
    EXPECT_EQ(static_cast<const float*>(wte->data)[5], 42.0f + r);
  }
  EndAll(s);

  // The alias holds in read-only summons, in gradient views and in the full-gradient buffer.
  ReduceScatterAll(ranks, /*unit=*/0, ReduceOp::kSum, false, [](int) { return 1.0f; });
  s = SummonAll(ranks, ReadOnly(/*with_grads=*/true));
  ASSERT_NE(s[0], nullptr);
  ASSERT_NE(s[1], nullptr);
  EXPECT_EQ(s[0]->Find("lm_head.weight")->data, s[0]->Find("wte.weight")->data);
  EXPECT_FALSE(s[0]->Find("lm_head.weight")->writable);
  ASSERT_NE(s[0]->FindGrad("wte.weight"), nullptr);
  EXPECT_EQ(s[0]->FindGrad("lm_head.weight")->data, s[0]->FindGrad("wte.weight")->data);
  EXPECT_EQ(static_cast<const float*>(s[0]->FindGrad("lm_head.weight")->data)[5], 2.0f);
  // Only each rank's own range persisted: element 5 lies in rank 0's range of the root unit.
  EXPECT_EQ(static_cast<const float*>(s[1]->Find("wte.weight")->data)[5], 42.0f);
  EndAll(s);
  absl::StatusOr<std::unique_ptr<PendingReduceScatter>> pending =
      ranks[0].client->BeginReduceScatter("", 0, ReduceOp::kSum, false);
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_NE((*pending)->Find("lm_head.weight"), nullptr);
  EXPECT_EQ((*pending)->Find("lm_head.weight")->data, (*pending)->Find("wte.weight")->data);
  // Finish it on both ranks so that nothing is left staged.
  absl::StatusOr<std::unique_ptr<PendingReduceScatter>> other =
      ranks[1].client->BeginReduceScatter("", 0, ReduceOp::kSum, false);
  ASSERT_TRUE(other.ok()) << other.status();
  std::thread t([&] { EXPECT_TRUE((*other)->Finish().ok()); });
  EXPECT_TRUE((*pending)->Finish().ok());
  t.join();
}

TEST_P(ClientE2ETest, Rank0OnlyRanksGetNoViews) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "r0", 3);
  InitValues(ranks);
  for (bool writeback : {false, true}) {
    SummonOptions options;
    options.rank0_only = true;
    options.writeback = writeback;
    Summons s = SummonAll(ranks, options);
    ASSERT_NE(s[0], nullptr);
    EXPECT_TRUE(s[0]->has_views());
    ExpectValues(*ranks[0].model.plan, *s[0]);
    for (int r = 1; r < 3; ++r) {
      ASSERT_NE(s[r], nullptr);
      EXPECT_FALSE(s[r]->has_views()) << "rank " << r << " writeback=" << writeback;
      EXPECT_EQ(s[r]->Find("wte.weight"), nullptr);
      EXPECT_EQ(s[r]->params().size(), 0u);
      EXPECT_EQ(s[r]->units(), s[0]->units()) << "every rank learns which units were summoned";
    }
    EXPECT_EQ(s[0]->units().size(), ranks[0].model.plan->units.size());
    EndAll(s);
  }
}

TEST_P(ClientE2ETest, WithGradsAfterReduceScatter) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "grads", 3);  // unit sizes are not multiples of 3
  const Plan& plan = *ranks[0].model.plan;
  // Before any gradient: with_grads gives parameter views and no gradient views.
  Summons s = SummonAll(ranks, ReadOnly(/*with_grads=*/true));
  ASSERT_NE(s[0], nullptr);
  EXPECT_TRUE(s[0]->has_views());
  EXPECT_EQ(s[0]->FindGrad("wte.weight"), nullptr);
  EXPECT_TRUE(s[0]->grads().empty());
  EndAll(s);

  for (const PlanUnit& u : plan.units) {
    ReduceScatterAll(ranks, u.index, ReduceOp::kSum, false, [](int r) { return 1.0f + r; });
  }
  auto expect_grads = [&](float want) {
    Summons g = SummonAll(ranks, ReadOnly(/*with_grads=*/true));
    for (int r = 0; r < 3; ++r) {
      ASSERT_NE(g[r], nullptr);
      for (const PlanUnit& u : plan.units) {
        for (const PlanParam& p : u.params) {
          const ParamView* v = g[r]->FindGrad(p.fqn);
          ASSERT_NE(v, nullptr) << p.fqn;
          EXPECT_EQ(v->numel, p.numel);
          const float* data = static_cast<const float*>(v->data);
          for (int64_t i = 0; i < p.numel; ++i) {
            ASSERT_EQ(data[i], want) << "rank " << r << " " << p.fqn << "[" << i << "]";
          }
        }
      }
    }
    EndAll(g);
  };
  expect_grads(6.0f);  // 1 + 2 + 3
  ReduceScatterAll(ranks, 0, ReduceOp::kAvg, /*accumulate=*/true, [](int r) { return 1.0f + r; });
  for (const PlanUnit& u : plan.units) {
    if (u.index == 0) continue;
    ReduceScatterAll(ranks, u.index, ReduceOp::kSum, /*accumulate=*/true,
                     [](int) { return 2.0f / 3.0f; });
  }
  // Unit 0: 6 + avg(1, 2, 3); the others: 6 + 3 * (2/3), both 8 up to rounding.
  Summons g = SummonAll(ranks, ReadOnly(/*with_grads=*/true));
  ASSERT_NE(g[2], nullptr);
  EXPECT_FLOAT_EQ(static_cast<const float*>(g[2]->FindGrad("wte.weight")->data)[1000], 8.0f);
  EXPECT_FLOAT_EQ(static_cast<const float*>(g[2]->FindGrad("h.1.mlp.c_fc.bias")->data)[63], 8.0f);
  EndAll(g);
  // The optimizer's view: every rank's gradient shard holds its slice.
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<ShardViews> views = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    for (const UnitShardView& u : *views) {
      ASSERT_NE(u.grad, nullptr) << "unit " << u.unit;
      EXPECT_FLOAT_EQ(static_cast<const float*>(u.grad)[0], 8.0f);
    }
  }
}

TEST_P(ClientE2ETest, SteadyStateSummonsMakeNoMmapCalls) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "steady", 2);
  InitValues(ranks);
  ReduceScatterAll(ranks, 0, ReduceOp::kSum, false, [](int) { return 1.0f; });
  SummonOptions writeback;
  writeback.writeback = true;
  const std::vector<SummonOptions> kinds = {ReadOnly(), writeback, ReadOnly(/*with_grads=*/true)};
  // The first summon of each kind maps its segments (read-only and writable mappings differ).
  for (const SummonOptions& o : kinds) {
    Summons s = SummonAll(ranks, o);
    EndAll(s);
  }
  const int64_t warm0 = ranks[0].client->segment_map_calls();
  const int64_t warm1 = ranks[1].client->segment_map_calls();
  for (int round = 0; round < 3; ++round) {
    for (const SummonOptions& o : kinds) {
      Summons s = SummonAll(ranks, o);
      ASSERT_NE(s[0], nullptr);
      ExpectValues(*ranks[0].model.plan, *s[0]);
      EndAll(s);
      EXPECT_EQ(ranks[0].client->segment_map_calls(), warm0)
          << "round " << round << " writeback=" << o.writeback << " with_grads=" << o.with_grads;
      EXPECT_EQ(ranks[1].client->segment_map_calls(), warm1);
    }
  }
}

// ---- Started summons (Client::StartSummon) ----

TEST_P(ClientE2ETest, StartedSummonsReachTheDaemonBeforeLaterCallsOnEveryRank) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "started", 2);
  InitValues(ranks);
  const Plan& plan = *ranks[0].model.plan;
  ASSERT_GE(plan.units.size(), 3u);
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // Every unit but the root started, last first, nothing waited for; then a synchronous
    // summon of the root. Rank 1 makes its synchronous call late: had it overtaken the
    // started ones on rank 0, the ranks' collectives would pair different units.
    std::vector<std::pair<int32_t, std::unique_ptr<PendingSummon>>> started;
    for (size_t k = plan.units.size() - 1; k >= 1; --k) {
      absl::StatusOr<std::unique_ptr<PendingSummon>> p =
          c.StartSummon("", plan.units[k].module, ReadOnly());
      ASSERT_TRUE(p.ok()) << "rank " << r << ": " << p.status();
      started.emplace_back(plan.units[k].index, *std::move(p));
    }
    if (r == 1) absl::SleepFor(absl::Milliseconds(200));
    SummonOptions root = ReadOnly();
    root.recurse = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = c.Summon("", "", root);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    ASSERT_THAT(s->get()->units(), ElementsAre(plan.units[0].index));
    ExpectUnitValues(plan.units[0], **s);
    for (auto& [unit, pending] : started) {
      EXPECT_TRUE(pending->ready()) << "the synchronous summon waited for the started ones";
      absl::StatusOr<std::unique_ptr<SummonedParams>> got = pending->Wait();
      ASSERT_TRUE(got.ok()) << "rank " << r << " unit " << unit << ": " << got.status();
      ASSERT_THAT(got->get()->units(), ElementsAre(unit));
      ExpectUnitValues(plan.units[unit], **got);
      EXPECT_TRUE(got->get()->End().ok());
      const absl::StatusOr<std::unique_ptr<SummonedParams>> again = pending->Wait();
      EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
    }
    EXPECT_TRUE(s->get()->End().ok());
  });
}

TEST_P(ClientE2ETest, StartedSummonsFailAtWaitOrAtOnceAndOneNeverTakenIsEnded) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "started-errors", 2);
  // Known before any RPC: at once.
  absl::StatusOr<std::unique_ptr<PendingSummon>> unknown =
      ranks[0].client->StartSummon("not-registered", "", ReadOnly());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  SummonOptions writeback;
  writeback.writeback = true;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // The daemon's refusal (the model is already summoned with writeback) arrives at Wait.
    absl::StatusOr<std::unique_ptr<SummonedParams>> held = c.Summon("", "", writeback);
    ASSERT_TRUE(held.ok()) << held.status();
    absl::StatusOr<std::unique_ptr<PendingSummon>> second = c.StartSummon("", "", writeback);
    ASSERT_TRUE(second.ok()) << second.status();
    absl::StatusOr<std::unique_ptr<SummonedParams>> refused = (*second)->Wait();
    EXPECT_FALSE(refused.ok());
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("already unsharding"));
    EXPECT_EQ(held->get()->generation(), std::nullopt);  // not ended yet
    EXPECT_TRUE(held->get()->End().ok());
    EXPECT_EQ(held->get()->generation(), std::optional<uint64_t>(1));  // End committed
    // A started summon dropped without Wait is ended: the model can be summoned again.
    {
      absl::StatusOr<std::unique_ptr<PendingSummon>> dropped = c.StartSummon("", "", writeback);
      ASSERT_TRUE(dropped.ok()) << dropped.status();
    }
    absl::StatusOr<std::unique_ptr<SummonedParams>> again = c.Summon("", "", writeback);
    ASSERT_TRUE(again.ok()) << "rank " << r << ": " << again.status();
    EXPECT_TRUE(again->get()->End().ok());
    // The dropped one ended with writeback (it held no new values: the same bytes, committed).
    EXPECT_EQ(again->get()->generation(), std::optional<uint64_t>(3));
  });
}

// ---- One round trip per unit transition (Summon with end_first) ----

TEST_P(ClientE2ETest, TransitionsEndThePreviousSummonInTheSameRoundTrip) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "transition", 2);
  InitValues(ranks);
  const Plan& plan = *ranks[0].model.plan;
  ASSERT_GE(plan.units.size(), 3u);
  SummonOptions unit_only = ReadOnly();
  unit_only.recurse = false;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // Forward order, each unit's summon ending the one before (synchronous and started
    // alternately), then the backward order the same way, twice (steady state).
    std::vector<int32_t> order;
    for (const PlanUnit& u : plan.units) order.push_back(u.index);
    for (auto it = plan.units.rbegin(); it != plan.units.rend(); ++it) order.push_back(it->index);
    std::unique_ptr<SummonedParams> held;
    int64_t maps_after_warmup = -1;
    for (int pass = 0; pass < 3; ++pass) {
      for (size_t i = 0; i < order.size(); ++i) {
        const PlanUnit& u = plan.units[order[i]];
        absl::StatusOr<std::unique_ptr<SummonedParams>> next;
        if (i % 2 == 0) {
          next = c.Summon("", u.module, unit_only, std::move(held));
        } else {
          absl::StatusOr<std::unique_ptr<PendingSummon>> p =
              c.StartSummon("", u.module, unit_only, std::move(held));
          ASSERT_TRUE(p.ok()) << "rank " << r << ": " << p.status();
          next = (*p)->Wait();
        }
        ASSERT_TRUE(next.ok()) << "rank " << r << " unit " << u.index << ": " << next.status();
        ASSERT_THAT(next->get()->units(), ElementsAre(u.index));
        ExpectUnitValues(u, **next);
        held = *std::move(next);
      }
      if (pass == 1) maps_after_warmup = c.segment_map_calls();
    }
    // The buffers the ended summons freed were reused: no new mapping in the steady state.
    EXPECT_EQ(c.segment_map_calls(), maps_after_warmup) << "rank " << r;
    // The last one ends with the next summon too; then nothing is left summoned: a writeback
    // summon of the whole model (refused while any unit is summoned) goes through.
    SummonOptions writeback;
    writeback.writeback = true;
    absl::StatusOr<std::unique_ptr<SummonedParams>> all =
        c.Summon("", "", writeback, std::move(held));
    ASSERT_TRUE(all.ok()) << "rank " << r << ": " << all.status();
    ExpectValues(plan, **all);
    // A writeback summon is ended by its own (collective) End before the next summon.
    absl::StatusOr<std::unique_ptr<SummonedParams>> after =
        c.Summon("", plan.units[1].module, unit_only, *std::move(all));
    ASSERT_TRUE(after.ok()) << "rank " << r << ": " << after.status();
    EXPECT_TRUE(after->get()->End().ok());
    EXPECT_EQ(c.GetShardViews("")->generation(), 2u) << "the writeback End committed";
  });
}

TEST_P(ClientE2ETest, TransitionsThatFailStillEndThePreviousSummonAndChangeNothing) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "transition-errors", 2);
  InitValues(ranks);
  const auto before0 = SnapshotShards(*ranks[0].client);
  const Plan& plan = *ranks[0].model.plan;
  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // The daemon refuses the summon (unknown path) after it ended end_first; the client
    // returns the summon's error, and the previous summon is ended all the same.
    absl::StatusOr<std::unique_ptr<SummonedParams>> first =
        c.Summon("", plan.units[1].module, ReadOnly());
    ASSERT_TRUE(first.ok()) << first.status();
    absl::StatusOr<std::unique_ptr<SummonedParams>> bad =
        c.Summon("", "h.7", ReadOnly(), *std::move(first));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();
    EXPECT_THAT(bad.status().message(), HasSubstr("h.7"));
    // Refused by the client before any RPC (unknown registered module): still ended.
    first = c.Summon("", plan.units[1].module, ReadOnly());
    ASSERT_TRUE(first.ok()) << first.status();
    absl::StatusOr<std::unique_ptr<PendingSummon>> refused =
        c.StartSummon("enc", "", ReadOnly(), *std::move(first));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
    // A null or ended end_first is the plain Summon.
    absl::StatusOr<std::unique_ptr<SummonedParams>> plain = c.Summon("", "", ReadOnly(), nullptr);
    ASSERT_TRUE(plain.ok()) << plain.status();
    EXPECT_TRUE(plain->get()->End().ok());
    absl::StatusOr<std::unique_ptr<SummonedParams>> again =
        c.Summon("", "", ReadOnly(), *std::move(plain));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->get()->End().ok());
  });
  // Nothing is left summoned (a writeback summon of everything goes through) and the shards
  // are unchanged.
  SummonOptions writeback;
  writeback.writeback = true;
  Summons all = SummonAll(ranks, writeback);
  ASSERT_NE(all[0], nullptr);
  ExpectValues(plan, *all[0]);
  EndAll(all);
  EXPECT_EQ(SnapshotShards(*ranks[0].client), before0);
}

// ---- Refused requests ----

TEST_P(ClientE2ETest, UnknownUnitPathOrModuleIsRefusedAndChangesNothing) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "bad", 2);
  InitValues(ranks);
  ReduceScatterAll(ranks, 1, ReduceOp::kSum, false, [](int r) { return 1.0f + r; });
  const auto before0 = SnapshotShards(*ranks[0].client);
  const auto before1 = SnapshotShards(*ranks[1].client);

  ::flatshard::testing::RunRanks(2, [&](int r) {
    Client& c = *ranks[r].client;
    // Unknown unit: NOT_FOUND; the fill callback never runs.
    bool filled = false;
    absl::Status s =
        c.ReduceScatterGrads("", 99, ReduceOp::kSum, false, [&](PendingReduceScatter&) {
          filled = true;
          return absl::OkStatus();
        });
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr("no unit 99"));
    EXPECT_FALSE(filled);
    EXPECT_EQ(c.BeginReduceScatter("", -1, ReduceOp::kSum, false).status().code(),
              absl::StatusCode::kNotFound);
    // Unknown module path inside the model: NOT_FOUND from the daemon.
    absl::StatusOr<std::unique_ptr<SummonedParams>> p = c.Summon("", "h.7", ReadOnly());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("h.7"));
    // Unknown registered module: NOT_FOUND.
    p = c.Summon("enc", "", ReadOnly());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound) << p.status();
    EXPECT_EQ(c.GetShardViews("enc").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(c.BeginReduceScatter("enc", 0, ReduceOp::kSum, false).status().code(),
              absl::StatusCode::kNotFound);
  });

  // Nothing changed: the shards and gradient shards are as before, no unit is left summoned
  // and no collective was consumed (the next collective summon and reduce-scatter line up).
  EXPECT_EQ(SnapshotShards(*ranks[0].client), before0);
  EXPECT_EQ(SnapshotShards(*ranks[1].client), before1);
  Summons s = SummonAll(ranks, ReadOnly(/*with_grads=*/true));
  ASSERT_NE(s[1], nullptr);
  ExpectValues(*ranks[1].model.plan, *s[1]);
  EXPECT_EQ(static_cast<const float*>(s[1]->FindGrad("h.0.ln_1.weight")->data)[0], 3.0f);
  EndAll(s);
  ReduceScatterAll(ranks, 1, ReduceOp::kSum, true, [](int) { return 1.0f; });
  s = SummonAll(ranks, ReadOnly(/*with_grads=*/true));
  ASSERT_NE(s[0], nullptr);
  EXPECT_EQ(static_cast<const float*>(s[0]->FindGrad("h.0.ln_1.weight")->data)[0], 5.0f);
  EndAll(s);
}

// The gradient buffer's size is the daemon's (two-phase protocol), so a gradient of the wrong
// size can only come from ranks that disagree: here rank 0 reduce-scatters unit 0 while rank 1
// reduce-scatters unit 1 (of another size). Both fail with the collective mismatch, and no
// shard or gradient shard changes.
TEST_P(ClientE2ETest, GradientOfTheWrongSizeFailsEveryRankAndChangesNothing) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "size", 2);
  InitValues(ranks);
  const Plan& plan = *ranks[0].model.plan;
  ASSERT_NE(plan.units[0].padded_numel, plan.units[1].padded_numel);
  for (const PlanUnit& u : plan.units) {
    ReduceScatterAll(ranks, u.index, ReduceOp::kSum, false, [](int r) { return 1.0f + r; });
  }
  const auto before0 = SnapshotShards(*ranks[0].client);
  const auto before1 = SnapshotShards(*ranks[1].client);
  absl::Status status[2];
  ::flatshard::testing::RunRanks(2, [&](int r) {
    status[r] = ranks[r].client->ReduceScatterGrads(
        "", /*unit=*/r, ReduceOp::kSum, false, [&](PendingReduceScatter& pending) {
          float* data = static_cast<float*>(pending.data());
          for (int64_t i = 0; i < pending.numel(); ++i) data[i] = 100.0f;
          return absl::OkStatus();
        });
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kAborted) << status[r];
    EXPECT_THAT(status[r].message(), HasSubstr("mismatch")) << status[r];
  }
  EXPECT_EQ(SnapshotShards(*ranks[0].client), before0);
  EXPECT_EQ(SnapshotShards(*ranks[1].client), before1);
}

// ---- A client killed mid-summon ----

// Environment of the child process (ClientE2EChild.HoldSummonUntilKilled).
constexpr char kChildSocketEnv[] = "FS_CLIENT_E2E_SOCKET";
constexpr char kChildFdEnv[] = "FS_CLIENT_E2E_FD";
constexpr char kChildCoordinatorEnv[] = "FS_CLIENT_E2E_COORDINATOR";

// Reads one line from `fd` within `timeout`; "" on timeout or EOF.
std::string ReadLine(int fd, absl::Duration timeout) {
  std::string line;
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const int left_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (poll(&p, 1, std::max(left_ms, 1)) <= 0) continue;
    char c = 0;
    if (read(fd, &c, 1) != 1) return "";
    if (c == '\n') return line;
    line.push_back(c);
  }
  return "";
}

// The values of segment "/name" as a file (a read: no mapping kept).
std::vector<char> SegmentBytes(const std::string& name) {
  const std::string bytes = ReadFile("/dev/shm" + name);
  return std::vector<char>(bytes.begin(), bytes.end());
}

TEST_P(ClientE2ETest, ClientKilledMidSummonEndsItWithoutWriteback) {
  Cluster d(GetParam(), Options());
  // Rank 1 is a child process: it joins, registers, initializes its range, opens a summon with
  // writeback, scribbles over its full buffers, reports its segments and waits to be killed.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child =
      ::flatshard::testing::SpawnSelf("ClientE2EChild.HoldSummonUntilKilled",
                                      {absl::StrCat(kChildSocketEnv, "=", d.SocketFor(1)),
                                       absl::StrCat(kChildFdEnv, "=", pipe_fds[1]),
                                       absl::StrCat(kChildCoordinatorEnv, "=", d.coordinator())});
  ASSERT_GT(child, 0);
  close(pipe_fds[1]);
  struct Reaper {  // the child never outlives the test
    pid_t pid;
    ~Reaper() {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } reaper{child};

  // Rank 0, here: the same steps up to the open summon.
  std::unique_ptr<Client> c0 = Connect(d.AddressFor(0));
  ASSERT_NE(c0, nullptr);
  const absl::Status joined0 = c0->Join("kill", 2, 0, kToken, d.coordinator());
  ASSERT_TRUE(joined0.ok()) << joined0;
  absl::StatusOr<RegisteredModule> m0 =
      c0->Register("", ExampleModelFile("gpt_tied", "manifest"),
                   ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
  ASSERT_TRUE(m0.ok()) << m0.status();
  const Plan& plan = *m0->plan;
  SummonOptions writeback;
  writeback.writeback = true;
  {
    absl::StatusOr<std::unique_ptr<SummonedParams>> init = c0->Summon("", "", writeback);
    ASSERT_TRUE(init.ok()) << init.status();
    Fill(plan, **init);
    ASSERT_TRUE((*init)->End().ok());
  }
  absl::StatusOr<std::unique_ptr<SummonedParams>> open = c0->Summon("", "", writeback);
  ASSERT_TRUE(open.ok()) << open.status();

  // "unsharded=/a,/b shards=/x,/y": the child's full buffers and shards.
  const std::string report = ReadLine(pipe_fds[0], absl::Seconds(30));
  close(pipe_fds[0]);
  ASSERT_THAT(report, HasSubstr("shards=")) << "the child did not report: \"" << report << "\"";
  std::vector<std::string> unsharded, shards;
  for (absl::string_view field : absl::StrSplit(report, ' ')) {
    std::pair<std::string, std::string> kv = absl::StrSplit(field, '=');
    std::vector<std::string> names = absl::StrSplit(kv.second, ',', absl::SkipEmpty());
    (kv.first == "unsharded" ? unsharded : shards) = names;
  }
  ASSERT_EQ(unsharded.size(), plan.units.size());
  ASSERT_EQ(shards.size(), plan.units.size());
  std::vector<std::vector<char>> shard_bytes;
  for (const std::string& s : shards) shard_bytes.push_back(SegmentBytes(s));
  for (const std::string& s : unsharded) ASSERT_TRUE(SegmentExists(s)) << s;

  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  reaper.pid = -1;
  const absl::Time killed = absl::Now();

  // Within 2 s the daemon ends the summon without writeback: the full buffers are freed
  // (unlinked, or decommitted and kept for the rank's next summon: their pages read zero)...
  auto any_left = [&] {
    for (const std::string& s : unsharded) {
      if (!SegmentExists(s)) continue;
      for (char c : SegmentBytes(s)) {
        if (c != 0) return true;
      }
    }
    return false;
  };
  while (any_left() && absl::Now() - killed < absl::Seconds(2))
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(any_left()) << "the killed client's unsharded buffers still hold its bytes 2 s "
                              "later: "
                           << absl::StrJoin(unsharded, ", ");
  // ... and the rank is free again: a restarted client joins it.
  std::unique_ptr<Client> c1 = Connect(d.AddressFor(1));
  ASSERT_NE(c1, nullptr);
  absl::Status joined;
  do {
    joined = c1->Join("kill", 2, 1, kToken, d.coordinator());
    if (!joined.ok()) absl::SleepFor(absl::Milliseconds(20));
  } while (!joined.ok() && absl::Now() - killed < absl::Seconds(2));
  ASSERT_TRUE(joined.ok()) << "rank 1 could not join again within 2 s: " << joined;
  EXPECT_LT(absl::Now() - killed, absl::Seconds(2));
  EXPECT_THAT(c1->registered_modules(), ElementsAre(""));
  // The shards kept their bytes: the scribbles in the full buffer were not written back.
  for (size_t i = 0; i < shards.size(); ++i) {
    EXPECT_EQ(SegmentBytes(shards[i]), shard_bytes[i]) << "shard " << shards[i] << " changed";
  }
  // Rank 0's End fails at once, naming the dead rank: a writeback End commits on every rank
  // or none (semantics.md §3a), and rank 1 never ended its part.
  const absl::Time end_start = absl::Now();
  const absl::Status ended = (*open)->End();
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
  EXPECT_THAT(ended.message(), HasSubstr("rank 1's session ended")) << ended;
  EXPECT_LT(absl::Now() - end_start, absl::Seconds(3)) << "the End waited for its deadline";
}

// A restarted trainer (here: a new Client after the old one went away with a summon open)
// joins its rank again and re-attaches by registering the same model: same plan, same shards,
// their values intact, and it takes part in collectives again.
TEST_P(ClientE2ETest, RestartedClientReattachesByRegisteringAgain) {
  Cluster d(GetParam(), Options());
  std::vector<Rank> ranks = JoinAndRegister(d, "again", 2);
  InitValues(ranks);
  const Plan plan = *ranks[0].model.plan;  // a copy: rank 0 re-attaches below
  std::vector<std::string> shards;
  for (const UnitShardView& u : ranks[1].model.shards) shards.push_back(SegmentOf(u.data));
  {
    SummonOptions writeback;
    writeback.writeback = true;
    Summons open = SummonAll(ranks, writeback);
    ASSERT_NE(open[1], nullptr);
    for (const ParamView& v : *open[1]) std::fill_n(static_cast<float*>(v.data), v.numel, -7.0f);
    ranks[1] = Rank();  // rank 1's client goes away; its summon's End then fails, as documented
    EXPECT_EQ(open[1]->End().code(), absl::StatusCode::kFailedPrecondition);
    // The writeback is atomic across the group: rank 1 never ended, so rank 0's range is not
    // written back either, and rank 0 learns why at once (semantics.md §3a).
    const absl::Status ended = open[0]->End();
    EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
    EXPECT_THAT(ended.message(), HasSubstr("rank 1's session ended")) << ended;
  }
  // The survivor leaves and joins again (README "Crash consistency": join is what waits until
  // the replacement is back and the group re-formed); it leaves before the replacement joins.
  ASSERT_TRUE(ranks[0].client->Leave().ok());
  ranks[1].client = Connect(d.AddressFor(1));
  ASSERT_NE(ranks[1].client, nullptr);
  std::vector<std::thread> joins;
  for (int r = 0; r < 2; ++r) {
    joins.emplace_back([&, r] {
      absl::Status joined;
      const absl::Time start = absl::Now();
      do {
        joined = ranks[r].client->Join("again", 2, r, kToken, d.coordinator());
        if (!joined.ok()) absl::SleepFor(absl::Milliseconds(20));
      } while (!joined.ok() && absl::Now() - start < absl::Seconds(5));
      EXPECT_TRUE(joined.ok()) << "rank " << r << ": " << joined;
    });
  }
  for (std::thread& t : joins) t.join();
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_THAT(ranks[1].client->registered_modules(), ElementsAre(""));
  absl::StatusOr<RegisteredModule> survivor =
      ranks[0].client->Register("", ExampleModelFile("gpt_tied", "manifest"),
                                ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
  ASSERT_TRUE(survivor.ok()) << "the survivor re-attaches: " << survivor.status();
  ranks[0].model = *std::move(survivor);

  absl::StatusOr<RegisteredModule> again =
      ranks[1].client->Register("", ExampleModelFile("gpt_tied", "manifest"),
                                ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
  ASSERT_TRUE(again.ok()) << "re-attach by registering again: " << again.status();
  EXPECT_EQ(again->plan->fingerprint, plan.fingerprint);
  EXPECT_EQ(again->init_summon, nullptr);
  ASSERT_EQ(again->shards.units().size(), shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    EXPECT_EQ(SegmentOf(again->shards.units()[i].data), shards[i]) << "unit " << i;
  }
  ranks[1].model = *std::move(again);
  Summons s = SummonAll(ranks, ReadOnly());
  for (int r = 0; r < 2; ++r) {
    ASSERT_NE(s[r], nullptr);
    ExpectValues(plan, *s[r]);
  }
  EndAll(s);
}

// Runs only as the child of ClientKilledMidSummonEndsItWithoutWriteback: rank 1 of "kill".
TEST(ClientE2EChild, HoldSummonUntilKilled) {
  const char* socket = getenv(kChildSocketEnv);
  const char* fd = getenv(kChildFdEnv);
  if (socket == nullptr || fd == nullptr) GTEST_SKIP() << "runs only as a child process";
  const char* coordinator = getenv(kChildCoordinatorEnv);
  std::unique_ptr<Client> c = Connect(std::string("unix:") + socket);
  if (c == nullptr ||
      !c->Join("kill", 2, 1, kToken, coordinator == nullptr ? "" : coordinator).ok()) {
    _exit(2);
  }
  absl::StatusOr<RegisteredModule> m =
      c->Register("", ExampleModelFile("gpt_tied", "manifest"),
                  ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
  if (!m.ok()) _exit(3);
  SummonOptions writeback;
  writeback.writeback = true;
  {
    absl::StatusOr<std::unique_ptr<SummonedParams>> init = c->Summon("", "", writeback);
    if (!init.ok()) _exit(4);
    Fill(*m->plan, **init);
    if (!(*init)->End().ok()) _exit(5);
  }
  absl::StatusOr<std::unique_ptr<SummonedParams>> open = c->Summon("", "", writeback);
  if (!open.ok()) _exit(6);
  std::vector<std::string> unsharded, shards;
  std::set<int32_t> seen;
  for (const ParamView& v : **open) {
    std::fill_n(static_cast<float*>(v.data), v.numel, -7.0f);  // never to be written back
    if (seen.insert(v.unit).second) unsharded.push_back(SegmentOf(v.data));
  }
  for (const UnitShardView& u : m->shards) shards.push_back(SegmentOf(u.data));
  const std::string line = absl::StrCat("unsharded=", absl::StrJoin(unsharded, ","),
                                        " shards=", absl::StrJoin(shards, ","), "\n");
  if (write(atoi(fd), line.data(), line.size()) != static_cast<ssize_t>(line.size())) _exit(7);
  pause();
  _exit(0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClientE2ETest,
                         ::testing::ValuesIn(::flatshard::testing::AllLayouts()),
                         ::flatshard::testing::LayoutParamName());

}  // namespace
}  // namespace flatshard::client
