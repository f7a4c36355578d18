// No module lost to a daemon killed during a module's initialisation (issue 24; README
// "Restarts", server/module/init_undo.cc): real flatshardd processes, rank r on daemon r, each
// with a state directory. Either daemon (the coordinator included) is killed with SIGKILL at
// each window of the initialisation: a kZeros Register agreed on every rank but not recorded by
// the victim (--testing_pause_init=register_before_record), the survivor's rank answered; an
// init summon (kFromRank0) open, not ended; its End agreed on every rank but not recorded by
// the victim (end_before_intent), the survivor's rank answered "initialised"; and, as a daemon
// that keeps nothing, after the init completed everywhere with the victim's state directory
// removed before its restart (state_dir_wiped). After the restart
// and the re-join no module is lost: the initialisation was undone on every daemon, every
// rank's Register runs it again, and every rank then holds its values, to the element, and
// trains on.

#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/restart_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::client {
namespace {

using namespace restart_testing;  // NOLINT: the fixture and its helpers

// Every parameter element of the initial values rank 0 gives (never zero).
float InitValue(int64_t i) { return static_cast<float>(7 + i % 991); }

// (victim daemon, kill window: "register_before_record", "init_summon_open",
// "end_before_intent", "state_dir_wiped")
class InitRestartTest : public TwoDaemonRestartTest,
                        public ::testing::WithParamInterface<std::tuple<int, const char*>> {
 protected:
  int victim() const { return std::get<0>(GetParam()); }
  int survivor() const { return 1 - victim(); }
  std::string window() const { return std::get<1>(GetParam()); }
  bool zeros() const { return window() == "register_before_record"; }
  // Held by --testing_pause_init at the window.
  bool paused() const {
    return window() == "register_before_record" || window() == "end_before_intent";
  }

  void SetUp() override {
    if (paused()) {
      std::vector<std::string>& flags = victim() == 1 ? daemon1_flags_ : daemon0_flags_;
      flags.push_back("--testing_pause_init=" + window() + ":60s");
    }
    TwoDaemonRestartTest::SetUp();
  }
  // Restarts the victim without the pause (the coordinator on its peer address, which the
  // survivor's group names); true once it adopted its records.
  bool RestartVictim() {
    DaemonProcess& d = *daemons_[victim()];
    const size_t before = d.Log().size();
    std::vector<std::string> flags;
    if (paused()) flags.push_back("--testing_pause_init=");
    if (victim() == 0) flags.push_back("--peer_address=" + d.peer_address());
    if (!d.Restart(flags)) return false;
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (d.Log().find("restart: adopted", before) == std::string::npos && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return d.Log().find("restart: adopted", before) != std::string::npos;
  }
  absl::StatusOr<RegisteredModule> RegisterOne(Rank& rank) {
    return rank.client->Register("", ExampleModelFile("gpt_tied", "manifest"),
                                 ExampleModelFile("gpt_tied", "policy"),
                                 zeros() ? InitMode::kZeros : InitMode::kFromRank0);
  }
  // Rank 0 fills its init summon's views with the initial values.
  static void FillInit(RegisteredModule& m) {
    ASSERT_NE(m.init_summon, nullptr);
    for (const PlanUnit& u : m.plan->units) {
      for (const PlanParam& p : u.params) {
        float* data = static_cast<float*>(m.init_summon->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) data[i] = InitValue(i);
      }
    }
  }
  // Every rank registers (and initialises) the model, at generation 0.
  void RegisterAndInit(std::vector<Rank>& ranks) {
    RunRanks(2, [&](int r) {
      absl::StatusOr<RegisteredModule> m = RegisterOne(ranks[r]);
      ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
      EXPECT_EQ(m->generation, 0u) << "rank " << r;
      ranks[r].model = *std::move(m);
      if (zeros()) return;
      if (r == 0) FillInit(ranks[r].model);
      absl::Status ended = ranks[r].model.init_summon->End();
      ASSERT_TRUE(ended.ok()) << "rank " << r << ": " << ended;
      ranks[r].model.init_summon.reset();
    });
  }
  // Every rank finds the initial values in every element (a read-only summon).
  void ExpectInitialValues(std::vector<Rank>& ranks) {
    ExpectEveryElement(ranks, [&](int64_t i) { return zeros() ? 0.0f : InitValue(i); });
  }
};

TEST_P(InitRestartTest, ADaemonKilledDuringTheInitialisationLosesNothing) {
  std::vector<Rank> ranks;
  JoinAll(ranks);
  absl::StatusOr<RegisteredModule> registered[2] = {absl::UnknownError("unset"),
                                                    absl::UnknownError("unset")};
  absl::Status ended[2];
  std::vector<std::thread> threads;
  if (window() == "register_before_record") {
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] { registered[r] = RegisterOne(ranks[r]); });
    }
  } else {
    RunRanks(2, [&](int r) {
      absl::StatusOr<RegisteredModule> m = RegisterOne(ranks[r]);
      ASSERT_TRUE(m.ok()) << "rank " << r << ": " << m.status();
      ranks[r].model = *std::move(m);
      if (r == 0) FillInit(ranks[r].model);
    });
    if (window() == "end_before_intent") {
      for (int r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] { ended[r] = ranks[r].model.init_summon->End(); });
      }
    } else if (window() == "state_dir_wiped") {
      RunRanks(2, [&](int r) {
        absl::Status e = ranks[r].model.init_summon->End();
        ASSERT_TRUE(e.ok()) << "rank " << r << ": " << e;
      });
    }
  }
  if (paused()) {
    // The victim's rank agreed with the survivor's, which is answered; the victim recorded
    // nothing.
    ASSERT_TRUE(WaitForLog(*daemons_[victim()], "initialisation paused at " + window()));
    threads[survivor()].join();
    if (zeros()) {
      EXPECT_TRUE(registered[survivor()].ok()) << registered[survivor()].status();
    } else {
      EXPECT_TRUE(ended[survivor()].ok()) << ended[survivor()];
    }
  }
  daemons_[victim()]->Kill();
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
  if (zeros()) {
    EXPECT_FALSE(registered[victim()].ok());
  } else if (window() == "end_before_intent") {
    EXPECT_FALSE(ended[victim()].ok());
  } else if (window() == "init_summon_open") {
    // The open init summon cannot end any more (its agreement fails on the survivor).
    EXPECT_FALSE(ranks[survivor()].model.init_summon->End().ok());
  } else {
    std::filesystem::remove_all(dirs_[victim()]);  // it comes back knowing nothing
  }
  for (Rank& rank : ranks) rank.model = RegisteredModule();
  ranks[victim()] = Rank();
  ASSERT_TRUE(RestartVictim());
  JoinAll(ranks);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(ranks[r].client->lost_modules(), IsEmpty()) << "rank " << r;
  }
  // Not initialised on any daemon: every rank's Register runs the initialisation again.
  RegisterAndInit(ranks);
  EXPECT_THAT(daemons_[survivor()]->Log(), HasSubstr("its initialisation was undone"));
  ExpectInitialValues(ranks);
  // And the group trains on, to the element.
  Commit(ranks, 1);
  RunRanks(2, [&](int r) {
    absl::StatusOr<ShardViews> views = ranks[r].client->GetShardViews("");
    ASSERT_TRUE(views.ok()) << views.status();
    EXPECT_EQ(views->generation(), 1u);
    for (const UnitShardView& u : *views) {
      const float* data = static_cast<const float*>(u.data);
      for (int64_t i = 0; i < u.shard_numel; ++i) {
        ASSERT_EQ(data[i], Value(1, r, u.unit, i)) << "rank " << r << " unit " << u.unit;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    KillWindows, InitRestartTest,
    ::testing::Combine(::testing::Values(0, 1),
                       ::testing::Values("register_before_record", "init_summon_open",
                                         "end_before_intent", "state_dir_wiped")),
    [](const ::testing::TestParamInfo<std::tuple<int, const char*>>& info) {
      const std::string w = std::get<1>(info.param);
      return absl::StrCat(std::get<0>(info.param) == 0 ? "Coordinator" : "OtherDaemon",
                          w == "register_before_record" ? "AfterTheZerosRegistrationAgreed"
                          : w == "init_summon_open"     ? "WhileTheInitSummonIsOpen"
                          : w == "end_before_intent"    ? "AfterTheInitEndAgreed"
                                                        : "AfterTheInitWithoutItsStateDir");
    });

}  // namespace
}  // namespace flatshard::client
