#pragma once
// The restart tests' fixtures and helpers (restart_test.cc, restart_adopt_test.cc,
// end_vote_restart_test.cc): real flatshardd processes with a state directory, two ranks of
// the example GPT model, values distinct per generation, rank, unit and element, and
// snapshots of every shard bit for bit.

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "common/shm_segment.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durable/journal.h"
#include "server/durable/state_dir.h"
#include "tests/testing/client_ranks.h"
#include "tests/testing/cluster.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/rank_group.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client::restart_testing {

using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExampleModelFile;
using ::flatshard::testing::RunRanks;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;

constexpr char kToken[] = "restart-t0k";
constexpr int kWorld = 2;

// No retries. `simulated_gpus`: the trainer side of flatshardd --simulate_gpus
// (tests/testing/simulated_gpu.h).
inline ::flatshard::testing::ConnectOptions Connecting(bool simulated_gpus = false) {
  return {absl::Seconds(20), absl::Seconds(20), 1,
          simulated_gpus ? &::flatshard::testing::SimulatedGpuApis : nullptr};
}
inline std::unique_ptr<Client> Connect(const std::string& address, bool simulated_gpus = false) {
  return ::flatshard::testing::ConnectClient(address, Connecting(simulated_gpus));
}

// The value of shard element `i` of unit `u` of `rank` at generation `g`: distinct between
// generations, units and ranks (so a mix or a swap is seen), never zero.
inline float Value(uint64_t g, int rank, int32_t u, int64_t i) {
  return static_cast<float>(g * 100000 + rank * 10000 + u * 1000 + 1 + i % 997);
}

using ::flatshard::testing::Rank;

// A read-only summon of the whole module on every rank of `ranks` (2): element i of every
// parameter holds value(i).
inline void ExpectEveryElement(std::vector<Rank>& ranks,
                               const std::function<float(int64_t)>& value) {
  ::flatshard::testing::ExpectParams(ranks,
                                     [&](const std::string&, int64_t i) { return value(i); });
}

// Bytes of every shard and gradient shard of one rank, per unit.
struct Snapshot {
  std::vector<std::string> shards;
  std::vector<std::string> grads;
  uint64_t generation = 0;
};

inline Snapshot Take(Client& c) {
  Snapshot s;
  absl::StatusOr<ShardViews> views = c.GetShardViews("");
  EXPECT_TRUE(views.ok()) << views.status();
  if (!views.ok()) return s;
  s.generation = views->generation();
  for (const UnitShardView& u : *views) {
    const size_t bytes = static_cast<size_t>(u.shard_numel) * 4;
    s.shards.emplace_back(static_cast<const char*>(u.data), bytes);
    s.grads.emplace_back(u.grad == nullptr ? std::string()
                                           : std::string(static_cast<const char*>(u.grad), bytes));
  }
  return s;
}

// Writes generation `g`'s values into every shard of `rank` (the optimizer, in place).
inline void WriteShards(Client& c, int rank, uint64_t g) {
  absl::StatusOr<ShardViews> views = c.GetShardViews("");
  ASSERT_TRUE(views.ok()) << views.status();
  for (const UnitShardView& u : *views) {
    float* data = static_cast<float*>(u.data);
    for (int64_t i = 0; i < u.shard_numel; ++i) data[i] = Value(g, rank, u.unit, i);
  }
}

// How many times `text` is in the daemon's log (every run of it so far).
inline int LogCount(DaemonProcess& d, const std::string& text) {
  const std::string log = d.Log();
  int n = 0;
  for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
  return n;
}
// Waits (at most 60 s) until `text` is in the log at least `n` times; false if not.
inline bool WaitForLog(DaemonProcess& d, const std::string& text, int n = 1) {
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (LogCount(d, text) < n && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  return LogCount(d, text) >= n;
}
// GPU daemons (--gpu_host_copies): the log line of generation `g`'s host copy, recorded.
inline std::string HostCopyRecorded(uint64_t g) {
  return absl::StrCat("host copy of generation ", g, " recorded");
}

class RestartTest : public ::testing::Test {
 protected:
  // Waits (at most 20 s) until the daemon, started with --testing_commit_copy_pause, has torn
  // a committed copy and paused, then kills it with SIGKILL. False if it never paused.
  static bool KillOnceACommitCopyPaused(DaemonProcess& d) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    auto paused = [&] { return absl::StrContains(d.Log(), "testing: commit copy"); };
    while (!paused() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
    const bool was_paused = paused();
    d.Kill();
    return was_paused;
  }
  // Every rank commits on a thread of its own; the daemon (--testing_commit_copy_pause) is
  // killed once a committed copy is torn and paused, and restarted once the trainers are
  // gone: it must finish generation `g`'s commit from the shards.
  void KillDuringACommitCopyAndRestart(DaemonProcess& d, std::vector<Rank>& ranks, uint64_t g) {
    std::vector<std::thread> committing;
    for (int r = 0; r < kWorld; ++r) {
      committing.emplace_back([&, r] { (void)ranks[r].client->Commit(""); });
    }
    const bool was_paused = KillOnceACommitCopyPaused(d);
    for (std::thread& t : committing) t.join();
    ASSERT_TRUE(was_paused) << d.Log();
    ranks.clear();
    ASSERT_TRUE(Restart(d));
    EXPECT_THAT(d.Log(), HasSubstr(absl::StrCat("finished the commit of generation ", g,
                                                " from its shards")));
  }
  // A daemon with a state directory in the test's temp dir (kept across restarts).
  std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> extra = {}) {
    state_dir_ = std::filesystem::temp_directory_path() /
                 absl::StrCat("fsrestart-state.", getpid(), ".", counter_++);
    DaemonOptions o;
    o.tag_prefix = "fsrst";
    o.extra_flags = {"--state_dir=" + state_dir_.string()};
    for (std::string& f : extra) o.extra_flags.push_back(std::move(f));
    return std::make_unique<DaemonProcess>(o);
  }
  void TearDown() override {
    std::error_code ignored;
    if (!state_dir_.empty()) std::filesystem::remove_all(state_dir_, ignored);
  }

  // Every rank connects and joins; `expect_modules`: what Join reports to re-attach.
  void JoinAll(DaemonProcess& d, std::vector<Rank>& ranks, size_t expect_modules) {
    ranks.resize(kWorld);
    RunRanks(kWorld, [&](int r) {
      ranks[r].client = Connect(d.address(), simulated_gpus_);
      ASSERT_NE(ranks[r].client, nullptr);
      absl::Status joined = ranks[r].client->Join("g", kWorld, r, kToken);
      ASSERT_TRUE(joined.ok()) << "rank " << r << ": " << joined;
      EXPECT_THAT(ranks[r].client->registered_modules(), SizeIs(expect_modules)) << "rank " << r;
    });
  }
  void RegisterAll(std::vector<Rank>& ranks, uint64_t want_generation) {
    ::flatshard::testing::RegisterExample(ranks, "gpt_tied", want_generation);
  }
  // Steps 1..n: write generation g's values, a gradient for every unit, commit.
  void Train(std::vector<Rank>& ranks, uint64_t from, uint64_t to) {
    for (uint64_t g = from; g <= to; ++g) {
      RunRanks(kWorld, [&](int r) {
        WriteShards(*ranks[r].client, r, g);
        for (const PlanUnit& u : ranks[r].model.plan->units) {
          absl::Status s = ranks[r].client->ReduceScatterGrads(
              "", u.index, ReduceOp::kSum, false, [&](PendingReduceScatter& p) {
                float* data = static_cast<float*>(p.data());
                for (int64_t i = 0; i < p.numel(); ++i) data[i] = static_cast<float>(g + i % 7);
                return absl::OkStatus();
              });
          ASSERT_TRUE(s.ok()) << "rank " << r << " unit " << u.index << ": " << s;
        }
        absl::StatusOr<uint64_t> c = ranks[r].client->Commit("");
        ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
        EXPECT_EQ(*c, g);
      });
    }
  }
  // After a restart: joins, re-attaches at `generation` and finds `want` bit for bit; a
  // read-only summon and one more commit work.
  void ExpectReattached(DaemonProcess& d, std::vector<Rank>& ranks, uint64_t generation,
                        const std::vector<Snapshot>& want, bool commit_after = true,
                        bool grads_kept = true) {
    JoinAll(d, ranks, 1);
    RegisterAll(ranks, generation);
    for (int r = 0; r < kWorld; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      Snapshot now = Take(*ranks[r].client);
      EXPECT_EQ(now.generation, generation);
      ASSERT_EQ(now.shards.size(), want[r].shards.size());
      for (size_t u = 0; u < now.shards.size(); ++u) {
        EXPECT_TRUE(now.shards[u] == want[r].shards[u]) << "unit " << u << ": shard differs";
        if (grads_kept) {
          EXPECT_TRUE(now.grads[u] == want[r].grads[u]) << "unit " << u << ": gradient differs";
        } else {
          EXPECT_TRUE(now.grads[u].empty()) << "unit " << u << ": a gradient shard came back";
        }
      }
    }
    RunRanks(kWorld, [&](int r) {
      SummonOptions read;
      read.writeback = false;
      absl::StatusOr<std::unique_ptr<SummonedParams>> s = ranks[r].client->Summon("", "", read);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.status();
      ASSERT_TRUE((*s)->End().ok());
    });
    if (commit_after) Train(ranks, generation + 1, generation + 1);
  }
  // Restarts `d` (with `more_flags` added to its flags) and waits until it has adopted what
  // its state directory holds (it listens on its socket a little before).
  bool Restart(DaemonProcess& d, const std::vector<std::string>& more_flags = {}) {
    auto count = [&] {
      const std::string log = d.Log();
      int n = 0;
      for (size_t at = log.find("restart: adopted"); at != std::string::npos;
           at = log.find("restart: adopted", at + 1)) {
        ++n;
      }
      return n;
    };
    const int before = count();
    if (!d.Restart(more_flags)) return false;
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (count() <= before && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
    return count() > before;
  }

  std::filesystem::path state_dir_;
  bool simulated_gpus_ = false;
  static inline int counter_ = 0;
};

// Two daemons (peers), one rank each, a state directory each: daemon 1 is the one killed.
class TwoDaemonRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      dirs_.push_back(std::filesystem::temp_directory_path() /
                      absl::StrCat("fsrestart2-state.", getpid(), ".", counter_++));
      DaemonOptions o;
      o.tag_prefix = "fsrst2";
      o.peer = true;
      o.node_name = absl::StrCat("node", i);
      o.extra_flags = {"--state_dir=" + dirs_.back().string(), "--peer_timeout=2s"};
      const std::vector<std::string>& extra = i == 1 ? daemon1_flags_ : daemon0_flags_;
      o.extra_flags.insert(o.extra_flags.end(), extra.begin(), extra.end());
      daemons_.push_back(std::make_unique<DaemonProcess>(o));
    }
  }
  void TearDown() override {
    daemons_.clear();
    std::error_code ignored;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ignored);
  }
  // Every rank (re-)joins through its daemon; survivors leave first.
  void JoinAll(std::vector<Rank>& ranks) {
    ranks.resize(2);
    (void)::flatshard::testing::LeaveSurvivors(ranks);
    ::flatshard::testing::GroupOptions g;
    g.token = kToken;
    g.coordinator = daemons_[0]->peer_address();
    g.connect = [&](int r) {
      return Connect(daemons_[r]->address(), r == 1 ? simulated_gpu1_ : simulated_gpu0_);
    };
    ::flatshard::testing::JoinRanks(ranks, g);
  }
  void Register(std::vector<Rank>& ranks, uint64_t generation) {
    ::flatshard::testing::RegisterExample(ranks, "gpt_tied", generation);
  }
  void Commit(std::vector<Rank>& ranks, uint64_t g) {
    RunRanks(2, [&](int r) {
      WriteShards(*ranks[r].client, r, g);
      absl::StatusOr<uint64_t> c = ranks[r].client->Commit("");
      ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
      EXPECT_EQ(*c, g);
    });
  }
  // `more_flags`: added to daemon 1's flags from this run on (a later one wins).
  bool RestartDaemon1(const std::vector<std::string>& more_flags = {}) {
    DaemonProcess& d = *daemons_[1];
    const size_t before = d.Log().size();
    if (!d.Restart(more_flags)) return false;
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (d.Log().find("restart: adopted", before) == std::string::npos && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return d.Log().find("restart: adopted", before) != std::string::npos;
  }

  std::vector<std::filesystem::path> dirs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::string> daemon0_flags_, daemon1_flags_;  // set by a subclass before SetUp
  // Rank 0's / rank 1's daemon has --simulate_gpus (its client too).
  bool simulated_gpu0_ = false, simulated_gpu1_ = false;
  static inline int counter_ = 0;
};

// Optimizer state (RegisterState) across restarts: the specs, values and helpers.
namespace optstate {

// Adam's state: two element-wise moments and a scalar step of another dtype.
inline std::vector<StateSpec> Specs() {
  return {{"exp_avg", DType::kFloat32, StateShape::kShard},
          {"exp_avg_sq", DType::kFloat32, StateShape::kShard},
          {"step", DType::kInt64, StateShape::kScalar}};
}

// Writes step g's state values of `rank` into its state views (distinct per state, unit,
// rank and step; never zero).
inline void WriteState(Client& c, int rank, uint64_t g) {
  absl::StatusOr<ShardViews> views = c.GetShardViews("");
  ASSERT_TRUE(views.ok()) << views.status();
  for (const UnitShardView& u : *views) {
    ASSERT_EQ(u.states.size(), 3u) << "unit " << u.unit;
    float* m = static_cast<float*>(u.state("exp_avg")->data);
    float* v = static_cast<float*>(u.state("exp_avg_sq")->data);
    for (int64_t i = 0; i < u.shard_numel; ++i) {
      m[i] = Value(g, rank, u.unit, i) + 0.5f;
      v[i] = Value(g, rank, u.unit, i) * 3.0f;
    }
    *static_cast<int64_t*>(u.state("step")->data) = static_cast<int64_t>(g * 1000 + u.unit);
  }
}

// The bytes of every state buffer of one rank, per unit, in spec order.
inline std::vector<std::string> TakeState(const ShardViews& views) {
  std::vector<std::string> out;
  for (const UnitShardView& u : views) {
    for (const StateView& s : u.states) {
      out.emplace_back(static_cast<const char*>(s.data),
                       static_cast<size_t>(s.numel * ItemSize(s.dtype)));
    }
  }
  return out;
}

}  // namespace optstate

class StateRestartTest : public RestartTest {
 protected:
  void RegisterStateAll(std::vector<Rank>& ranks) {
    RunRanks(kWorld, [&](int r) {
      absl::StatusOr<ShardViews> v = ranks[r].client->RegisterState("", optstate::Specs());
      ASSERT_TRUE(v.ok()) << "rank " << r << ": " << v.status();
    });
  }
  // Steps from..to: shards, gradients and optimizer state of step g, committed.
  void TrainWithState(std::vector<Rank>& ranks, uint64_t from, uint64_t to) {
    for (uint64_t g = from; g <= to; ++g) {
      RunRanks(kWorld, [&](int r) { optstate::WriteState(*ranks[r].client, r, g); });
      Train(ranks, g, g);
    }
  }
  std::vector<std::vector<std::string>> StateOf(std::vector<Rank>& ranks) {
    std::vector<std::vector<std::string>> out;
    for (Rank& r : ranks) {
      absl::StatusOr<ShardViews> v = r.client->GetShardViews("");
      EXPECT_TRUE(v.ok()) << v.status();
      out.push_back(v.ok() ? optstate::TakeState(*v) : std::vector<std::string>());
    }
    return out;
  }
  // After a restart: every rank re-registers the module and its state and finds `want`.
  void ExpectStateReattached(std::vector<Rank>& ranks, uint64_t generation,
                             const std::vector<std::vector<std::string>>& want) {
    RunRanks(kWorld, [&](int r) {
      absl::StatusOr<ShardViews> v = ranks[r].client->RegisterState("", optstate::Specs());
      ASSERT_TRUE(v.ok()) << "rank " << r << ": " << v.status();
      EXPECT_EQ(v->generation(), generation) << "rank " << r;
      const std::vector<std::string> now = optstate::TakeState(*v);
      ASSERT_EQ(now.size(), want[r].size()) << "rank " << r;
      for (size_t i = 0; i < now.size(); ++i) {
        EXPECT_TRUE(now[i] == want[r][i])
            << "rank " << r << " state buffer " << i << " (unit " << i / 3 << ", "
            << optstate::Specs()[i % 3].name << ") differs from its committed value";
      }
    });
  }
};

using ::flatshard::testing::ExpectEveryRankLostItsModule;

// After a re-join: every rank of a two-daemon group holds its one module, none lost.
inline void ExpectEveryRankKeptItsModule(std::vector<Rank>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_THAT(ranks[r].client->lost_modules(), ::testing::IsEmpty());
    EXPECT_THAT(ranks[r].client->registered_modules(), ::testing::SizeIs(1));
  }
}

// The expected state of every rank: generation g's values and the gradients of step g.
inline std::vector<Snapshot> Expected(std::vector<Rank>& ranks) {
  std::vector<Snapshot> out;
  for (Rank& r : ranks) out.push_back(Take(*r.client));
  return out;
}

}  // namespace flatshard::client::restart_testing
