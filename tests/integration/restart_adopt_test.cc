// Adoption copies no shard (README "Restarts"): a restarted daemon takes over the recorded
// segments as they lie, and the group's first formation restores every adopted rank's shards
// from its committed copy, once. So the shards on disk between the adoption and that formation
// may still hold a trainer's uncommitted writes: a daemon killed again there must adopt the
// committed state exactly, and a trainer that missed the kill and writes into the shards it
// still maps after the adoption is rolled back at the formation. Real flatshardd processes, a
// state directory, two ranks of the example GPT model.

#include <memory>
#include <string>
#include <vector>

#include "tests/integration/restart_testing.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixture and its helpers

// Writes generation `g`'s values through views taken before a kill (a trainer that has not
// noticed it: its mappings outlive the daemon).
void WriteThrough(const ShardViews& views, int rank, uint64_t g) {
  for (const UnitShardView& u : views) {
    float* data = static_cast<float*>(u.data);
    for (int64_t i = 0; i < u.shard_numel; ++i) data[i] = Value(g, rank, u.unit, i);
  }
}

TEST_F(RestartTest, KilledAgainBeforeAnyRankRejoinedAdoptsTheCommittedStateExactly) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 2);
  const std::vector<Snapshot> committed = Expected(ranks);
  // An optimizer step that never committed: it stays in the shards across the adoption.
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 99); });
  ranks.clear();
  for (int kill = 0; kill < 2; ++kill) {
    SCOPED_TRACE(absl::StrCat("kill ", kill));
    d->Kill();
    ASSERT_TRUE(Restart(*d));  // adopted; no rank has joined
    EXPECT_THAT(d->Log(), HasSubstr("group=g adopted from"));
  }
  ExpectReattached(*d, ranks, 2, committed);
}

TEST_F(RestartTest, ATrainerWritingAfterTheAdoptionIsRolledBackAtTheFirstFormation) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 3);
  const std::vector<Snapshot> committed = Expected(ranks);
  std::vector<ShardViews> held(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    absl::StatusOr<ShardViews> v = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(v.ok()) << v.status();
    held[r] = *std::move(v);
  }
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  // The old trainers' optimizer steps land after the adoption, before they re-join.
  for (int r = 0; r < kWorld; ++r) WriteThrough(held[r], r, 98);
  ExpectReattached(*d, ranks, 3, committed);
}

// Every rank's full parameters as one read-only Summon hands them out, bytes per FQN.
std::vector<std::vector<std::string>> SummonedBytes(std::vector<Rank>& ranks) {
  std::vector<std::vector<std::string>> out(kWorld);
  RunRanks(kWorld, [&](int r) {
    SummonOptions read;
    read.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", read);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    for (const ParamView& p : **s) {
      out[r].emplace_back(static_cast<const char*>(p.data),
                          static_cast<size_t>(p.numel * ItemSize(p.dtype)));
    }
    ASSERT_TRUE((*s)->End().ok());
  });
  return out;
}

// Kept summon buffers outlive kill -9 (README "Restarts"): the record a commit writes lists
// the module's kept summon buffers (here a read-only summon held open over the commit, so they
// hold the step before), the restarted daemon adopts their segments, and the first summon
// after the restart is served from them with the committed step's values.
TEST_F(RestartTest, KeptSummonBuffersAreAdoptedAtARestart) {
  std::unique_ptr<DaemonProcess> d = StartDaemon();
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  Train(ranks, 1, 1);
  std::vector<std::unique_ptr<SummonedParams>> open(kWorld);
  RunRanks(kWorld, [&](int r) {
    SummonOptions read;
    read.writeback = false;
    absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", read);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
    open[r] = *std::move(s);
  });
  Train(ranks, 2, 2);
  open.clear();
  const std::vector<Snapshot> committed = Expected(ranks);
  const std::vector<std::vector<std::string>> want = SummonedBytes(ranks);
  // An uncommitted step in the shards: rolled back at the first formation, never summoned.
  RunRanks(kWorld, [&](int r) { WriteShards(*ranks[r].client, r, 99); });
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  EXPECT_THAT(d->Log(), HasSubstr("kept summon buffer(s)"));
  EXPECT_EQ(LogCount(*d, "kept buffer not adopted"), 0);
  JoinAll(*d, ranks, 1);
  RegisterAll(ranks, 2);
  EXPECT_TRUE(SummonedBytes(ranks) == want) << "the first summon after the restart differs";
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(Take(*ranks[r].client).shards == committed[r].shards) << "rank " << r;
  }
}

}  // namespace
}  // namespace flatshard::client
