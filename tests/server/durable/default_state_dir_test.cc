// ChooseStateDir (server/durable/default_state_dir.h): persistence on by default, where the
// records go, and --ephemeral.

#include "server/durable/default_state_dir.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server::state {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<StateDirChoice> Choose(const std::string& flag, bool ephemeral,
                                      std::map<std::string, std::string> env, uint32_t uid) {
  return ChooseStateDir(
      flag, ephemeral,
      [&env](const char* name) {
        auto it = env.find(name);
        return it == env.end() ? std::string() : it->second;
      },
      uid);
}

TEST(DefaultStateDirTest, TheFlagWinsThenSystemdThenRootThenXdgThenHome) {
  const std::map<std::string, std::string> all = {{"STATE_DIRECTORY", "/var/lib/fs:/var/lib/x"},
                                                  {"XDG_STATE_HOME", "/x/state"},
                                                  {"HOME", "/home/u"}};
  EXPECT_EQ(Choose("/d", false, all, 1000)->path, "/d");
  EXPECT_EQ(Choose("", false, all, 1000)->path, "/var/lib/fs");  // the first of several
  EXPECT_EQ(Choose("", false, all, 1000)->why, "$STATE_DIRECTORY");
  EXPECT_EQ(Choose("", false, {{"HOME", "/root"}}, 0)->path, "/var/lib/flatshard/state");
  EXPECT_EQ(Choose("", false, {{"XDG_STATE_HOME", "/x/state"}, {"HOME", "/home/u"}}, 1000)->path,
            "/x/state/flatshard/state");
  EXPECT_EQ(Choose("", false, {{"HOME", "/home/u"}}, 1000)->path,
            "/home/u/.local/state/flatshard/state");
  // A relative $XDG_STATE_HOME is invalid (XDG) and ignored.
  EXPECT_EQ(Choose("", false, {{"XDG_STATE_HOME", "rel"}, {"HOME", "/home/u"}}, 1000)->path,
            "/home/u/.local/state/flatshard/state");
}

TEST(DefaultStateDirTest, EphemeralKeepsNothingAndContradictsAStateDir) {
  absl::StatusOr<StateDirChoice> e = Choose("", true, {{"HOME", "/home/u"}}, 1000);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->path, "");
  absl::StatusOr<StateDirChoice> both = Choose("/d", true, {}, 1000);
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(both.status().message()), HasSubstr("--ephemeral and --state_dir /d"));
}

TEST(DefaultStateDirTest, NoHomeNamesWhatToPass) {
  absl::StatusOr<StateDirChoice> none = Choose("", false, {}, 1000);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("--state_dir DIR, or --ephemeral"));
}

}  // namespace
}  // namespace flatshard::server::state
