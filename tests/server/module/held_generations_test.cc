// internal::ResolveHeld (server/module/generations.h): the generation the daemons of a group
// resolve a module to at a re-form from what each reported.

#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/module/generations.h"

namespace flatshard::server::internal {
namespace {

std::optional<uint64_t> Resolve(std::vector<std::string> reports) { return ResolveHeld(reports); }

TEST(ResolveHeldTest, PlainReportsMustAgree) {
  EXPECT_EQ(Resolve({"3", "3"}), 3u);
  EXPECT_EQ(Resolve({"2", "0"}), std::nullopt);
  EXPECT_EQ(Resolve({"mixed (rank 0: generation 2, rank 1: generation 1)", "2"}), std::nullopt);
}

// Voted ranks ("G|G+1") end at the lowest generation every daemon can end at.
TEST(ResolveHeldTest, VotesPreferTheLowerGeneration) {
  EXPECT_EQ(Resolve({"1|2", "1|2"}), 1u);
  EXPECT_EQ(Resolve({"1|2", "2"}), 2u);
  EXPECT_EQ(Resolve({"1|2", "1"}), 1u);
}

// A GPU daemon holding G with a host copy of G-1 ("G-1<G") stays at G unless another daemon
// can only end at G-1 (its host copy of G never completed).
TEST(ResolveHeldTest, HostCopyFallbacksPreferTheGenerationHeld) {
  EXPECT_EQ(Resolve({"1<2", "1<2"}), 2u);
  EXPECT_EQ(Resolve({"1<2", "2"}), 2u);
  EXPECT_EQ(Resolve({"1<2", "1"}), 1u);
  EXPECT_EQ(Resolve({"1<2", "1<2", "1"}), 1u);
  EXPECT_EQ(Resolve({"0<1", "0"}), 0u);
  EXPECT_EQ(Resolve({"1<2", "0"}), std::nullopt);
  EXPECT_EQ(Resolve({"2<3", "1"}), std::nullopt);
  // With a vote: a daemon that holds G (committed) keeps every daemon at G, as before.
  EXPECT_EQ(Resolve({"1<2", "1|2"}), 2u);
  EXPECT_EQ(Resolve({"1|2", "1<2", "1"}), 1u);
}

}  // namespace
}  // namespace flatshard::server::internal
