// No module stuck after a daemon killed between two local ranks' installs of a registration of
// zeros (README "Restarts"): a real flatshardd with a state directory, two local ranks. Every
// rank agreed to the registration; one local rank's install is held
// (--testing_pause_register_install), the other installed, recorded and answered, and the
// daemon is killed with SIGKILL then. The record holds the module for one local rank only:
// adopting it would leave the other rank unable to register (ALREADY_EXISTS) or re-attach. The
// restarted daemon does not adopt it, every rank registers it again (zeros, generation 0,
// every element), and the group trains and commits on.

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/restart_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixture and its helpers

// The parameter: the local rank whose install is held when the daemon dies.
class ZerosRegisterRestartTest : public RestartTest, public ::testing::WithParamInterface<int> {};

TEST_P(ZerosRegisterRestartTest, AKillBetweenLocalRanksInstallsLeavesNoModuleStuck) {
  const int held = GetParam();
  const int answered = 1 - held;
  std::unique_ptr<DaemonProcess> d =
      StartDaemon({absl::StrCat("--testing_pause_register_install=", held, ":60s")});
  std::vector<Rank> ranks;
  JoinAll(*d, ranks, 0);
  absl::StatusOr<RegisteredModule> registered[kWorld] = {absl::UnknownError("unset"),
                                                         absl::UnknownError("unset")};
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      registered[r] =
          ranks[r].client->Register("", ExampleModelFile("gpt_tied", "manifest"),
                                    ExampleModelFile("gpt_tied", "policy"), InitMode::kZeros);
    });
  }
  // The answered rank's Register returns while the held one's install waits.
  threads[answered].join();
  ASSERT_TRUE(registered[answered].ok()) << registered[answered].status();
  ASSERT_TRUE(
      WaitForLog(*d, absl::StrCat("testing: rank ", held, "'s registration install paused")))
      << d->Log();
  d->Kill();
  threads[held].join();
  EXPECT_FALSE(registered[held].ok()) << "rank " << held << " answered from a killed daemon";
  ranks.clear();

  ASSERT_TRUE(Restart(*d, {"--testing_pause_register_install="}));
  EXPECT_THAT(d->Log(), HasSubstr(absl::StrCat("not adopted: its registration was recorded for "
                                               "rank ",
                                               answered, " but not for rank ", held)));
  // Nothing to re-attach: every rank registers the model of zeros again, at generation 0.
  JoinAll(*d, ranks, 0);
  RegisterAll(ranks, 0);
  ExpectEveryElement(ranks, [](int64_t) { return 0.0f; });
  Train(ranks, 1, 2);
  const std::vector<Snapshot> trained = Expected(ranks);
  ranks.clear();
  d->Kill();
  ASSERT_TRUE(Restart(*d));
  ExpectReattached(*d, ranks, 2, trained);
}

INSTANTIATE_TEST_SUITE_P(HeldRank, ZerosRegisterRestartTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return absl::StrCat("rank", p.param, "Held");
                         });

}  // namespace
}  // namespace flatshard::client
