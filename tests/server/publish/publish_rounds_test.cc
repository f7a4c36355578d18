// PublishRounds (server/publish/publish_rounds.h): another daemon's batches pair with the
// leader's publishes in order, and a batch that arrived with a refusal (a GPU its daemon does
// not use) fails the leader's read of it, also when the leader reads it again, while the
// batches before and after it pair as usual. No threads: every wait here is already met.

#include "server/publish/publish_rounds.h"

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

TEST(PublishRoundsTest, ARefusedBatchFailsTheLeadersReadOfItAndOnlyThatOne) {
  PublishRounds r;
  const absl::Time soon = absl::Now() + absl::Seconds(30);
  const absl::Time now = absl::Now();
  EXPECT_EQ(r.Arrived("g", "m", "t", /*leader=*/false), 1u);
  EXPECT_EQ(r.Arrived("g", "m", "t", false,
                      absl::FailedPreconditionError("this daemon does not use GPU 1")),
            2u);
  EXPECT_EQ(r.Arrived("g", "m", "t", false), 3u);
  // The leader's publishes 7, 8, 9 pair with batches 1, 2, 3.
  EXPECT_TRUE(r.TakeArrival("g", "m", 7, soon).ok());
  const absl::Status refused = r.TakeArrival("g", "m", 8, soon);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("GPU 1"));
  // Read again (a generation changed between the holds): still refused.
  EXPECT_EQ(r.TakeArrival("g", "m", 8, soon).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(r.TakeArrival("g", "m", 9, soon).ok());
  // Each batch learns the leader's publish it was paired with.
  EXPECT_EQ(*r.AwaitLeaderSeq("g", "m", 1, now), 7u);
  EXPECT_EQ(*r.AwaitLeaderSeq("g", "m", 2, now), 8u);
  EXPECT_EQ(*r.AwaitLeaderSeq("g", "m", 3, now), 9u);
  // Another module is not affected; nothing is left to read there (the deadline has passed).
  EXPECT_EQ(r.TakeArrival("g", "other", 1, now).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(PublishRoundsTest, TheLeadersOwnBatchesAreNeverRead) {
  PublishRounds r;
  EXPECT_EQ(r.Arrived("g", "m", "t", /*leader=*/true,
                      absl::FailedPreconditionError("rank 0's daemon (the publish leader)")),
            1u);
  EXPECT_EQ(r.TakeArrival("g", "m", 1, absl::Now()).code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace flatshard::server
