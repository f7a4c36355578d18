// internal::ResolveHeld (server/module/generations.h): the generation the daemons of a group
// resolve a module to at a re-form from what each reported; and internal::InitUndoneEverywhere:
// when a daemon killed during the initialisation makes every daemon undo it instead.

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

// Each daemon's report of module "m" (HeldModules): "" when it holds none.
bool Undone(const std::vector<std::string>& generations, const std::string& fingerprint = "fp") {
  std::vector<std::vector<std::string>> held;
  for (const std::string& g : generations) {
    held.push_back(
        {"other\x1f"
         "fp\x1f"
         "4"});
    if (!g.empty()) held.back().push_back("m\x1f" + fingerprint + "\x1f" + g);
  }
  std::vector<const std::vector<std::string>*> reports;
  for (const auto& h : held) reports.push_back(&h);
  return InitUndoneEverywhere("m", reports);
}

// A daemon killed during the initialisation comes back without the module, or one holds it
// initialised (generation 0) while another's init never completed: undone everywhere.
TEST(InitUndoneEverywhereTest, UndoesAnInitNotHeldByEveryDaemon) {
  EXPECT_TRUE(Undone({"0", ""}));
  EXPECT_TRUE(Undone({"", "0", "0"}));
  EXPECT_TRUE(Undone({"uninit", ""}));
  EXPECT_TRUE(Undone({"0", "uninit"}));
  EXPECT_TRUE(Undone({"uninit", "0", ""}));
}

// Reports that agree need nothing; a trained generation, a vote, another plan or a loss is
// never undone (those are resolved or dropped as before).
TEST(InitUndoneEverywhereTest, NeverUndoesATrainedOrAgreedModule) {
  EXPECT_FALSE(Undone({"0", "0"}));
  EXPECT_FALSE(Undone({"uninit", "uninit"}));
  EXPECT_FALSE(Undone({"", ""}));
  EXPECT_FALSE(Undone({"1", ""}));
  EXPECT_FALSE(Undone({"0|1", ""}));
  EXPECT_FALSE(Undone({"0", "1"}));
  std::vector<std::string> a =
                               {"m\x1f"
                                "fp\x1f"
                                "0"},
                           b =
                               {"m\x1f"
                                "fp2\x1f"
                                "0"},
                           lost =
                               {"m\x1f"
                                "lost"},
                           none;
  EXPECT_FALSE(InitUndoneEverywhere("m", {&a, &b}));
  EXPECT_FALSE(InitUndoneEverywhere("m", {&a, &lost}));
  EXPECT_TRUE(InitUndoneEverywhere("m", {&a, &none}));
}

}  // namespace
}  // namespace flatshard::server::internal
