// Chaos tests of issue 14 ("nothing is lost"): the DAEMON is killed with SIGKILL at a random
// point of a training loop and restarted with the same --state_dir; the trainers survive it,
// see their calls fail, re-join and re-register (re-attach) as after a trainer crash, check
// what they find and train on to the end. Real flatshardd processes, real trainer processes
// (this binary re-executed: DaemonChaosChild.Run), 3 ranks, one daemon or two (rank r on
// daemon r % 2, either daemon killed, the coordinator included).
//
// What a trial requires (spec/semantics.md §3a, issue 14):
//  - every rank re-attaches to the same generation G, with G >= the last generation any rank
//    saw committed and G <= that + 1 (one more may have committed on every rank just before
//    the kill without its reply getting out), and every parameter element of its shards and
//    of a read-only summon equals, bit for bit, the value after generation G (a pure function
//    of G: a mix of two steps, or zeros, is seen);
//  - never a loss (issue 24: no module lost to a single daemon kill): a module reported lost
//    to the ranks at Join fails the trial, named or not (KillPlan::no_loss);
//  - no wait without a deadline: every trainer ends (done, or a named error) within its
//    deadline; training then runs to the target generation and the result equals the
//    reference (the value of the final generation), and fresh processes re-attaching after
//    the trial find exactly that.
//
// DaemonChaosTest.* (default suite) run a few fixed kill points, one daemon and two;
// DaemonChaosSoak.RandomKills (label soak) runs FS_CHAOS_TRIALS (default 50) randomized
// trials per layout (FS_CHAOS_SEED) and prints a summary: kill points hit, generations
// re-attached (relative to the last committed one), errors seen, re-attach times.
// FS_CHAOS_ROWS scales the model (default 256 rows of 1024 floats per unit, 4 units).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/chaos/chaos_testing.h"
#include "tests/chaos/chaos_trainers.h"
#include "tests/testing/admin_calls.h"
#include "tests/testing/rank_group.h"

namespace flatshard::chaos {
namespace {

using ::flatshard::client::Client;
using ::flatshard::client::ClientOptions;
using ::flatshard::client::InitMode;
using ::flatshard::client::ReduceOp;
using ::flatshard::client::RegisteredModule;
using ::flatshard::client::ShardViews;
using ::flatshard::client::SummonedParams;
using ::flatshard::client::SummonOptions;

constexpr char kToken[] = "chaos-t0k";
constexpr int kBlocks = 3;
constexpr int kCols = 1024;

int Rows() { return std::max(1, EnvInt("FS_CHAOS_ROWS", 256)); }

// The loop steps a trainer reports before it does them (the kill points).
[[maybe_unused]] const std::vector<std::string>& LoopSteps() {
  static const std::vector<std::string> kSteps = {"summon",         "summon_open", "inside_end",
                                                  "reduce_scatter", "optimizer",   "commit"};
  return kSteps;
}

std::string Describe(const absl::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(s.code()), " ", s.message());
}

// ---- The trainer (a child process) ----

// Lines to the parent through a pipe. Final() is the last word: it waits until the parent lets
// every trainer go, so that one trainer's exit (its session ending) does not fail a collective
// another is still in. Up to 200 s, longer than the parent pumps a trial (170 s): a trainer
// that gave up waiting sooner (it was 30 s) left while another, re-attaching slowly under
// load, still needed it to re-join (AskDoneRanksToRejoin), and that one then gave up too.
class Reporter {
 public:
  Reporter(int fd, int go_fd) : fd_(fd), go_fd_(go_fd) {}
  // Each line carries " @<unix micros>", when it was said (the parent compares it with the
  // time of the kill: the clock is the host's).
  void Say(const std::string& line) {
    std::string l = absl::StrReplaceAll(line, {{"\n", " "}});
    absl::StrAppend(&l, " @", absl::ToUnixMicros(absl::Now()), "\n");
    (void)!write(fd_, l.data(), l.size());
  }
  void Final(const std::string& line) { (void)FinalOrRejoin(line); }
  // The same, but the parent may answer "r" instead of letting it go: another rank is
  // re-attaching (the daemon died after this rank's last collective), so this one must join
  // again too (a group re-forms only once every rank has joined). Returns true then.
  bool FinalOrRejoin(const std::string& line) {
    Say(line);
    pollfd p{go_fd_, POLLIN, 0};
    if (poll(&p, 1, 200000) <= 0) return false;
    char c = 0;
    return read(go_fd_, &c, 1) == 1 && c == 'r';
  }

 private:
  int fd_;
  int go_fd_;
};

struct TrainerConfig {
  int rank = 0;
  std::string group;
  std::string coordinator;
  std::string address;
  std::string manifest;
  uint64_t target = 0;          // train until this generation is committed
  int optimizer_pause_ms = 10;  // between the two halves of the optimizer step
  bool verify_only = false;
};

// One session: a client joined to the group with the module registered (re-attached).
struct Session {
  std::unique_ptr<Client> client;
  RegisteredModule module;
  uint64_t generation = 0;
  ~Session() {
    module = RegisteredModule();  // its views unmap before the client goes
    client.reset();
  }
};

// What a failed step or attach left: an error to retry after (the daemon died, the group is
// re-forming), or a broken check (a wrong value: the trial has failed, stop).
struct Failure {
  bool bad = false;
  std::string text;
};

// Checks this rank's shards (GetShardViews) and a read-only summon of the whole model
// against generation `g`.
std::optional<Failure> VerifyAt(Session& s, uint64_t g) {
  const Plan& plan = *s.module.plan;
  absl::StatusOr<ShardViews> views = s.client->GetShardViews("");
  if (!views.ok()) return Failure{false, Describe(views.status())};
  if (views->generation() != g) {
    return Failure{true, absl::StrCat("GetShardViews says generation ", views->generation(),
                                      ", Register said ", g)};
  }
  if (std::string bad = CheckShards(plan, *views, g); !bad.empty()) return Failure{true, bad};
  SummonOptions read_only;
  read_only.writeback = false;
  absl::StatusOr<std::unique_ptr<SummonedParams>> full = s.client->Summon("", "", read_only);
  if (!full.ok()) return Failure{false, Describe(full.status())};
  if (std::string bad = CheckFull(plan, **full, g); !bad.empty()) return Failure{true, bad};
  if (absl::Status e = (*full)->End(); !e.ok()) return Failure{false, Describe(e)};
  return std::nullopt;
}

// Connects (once the daemon listens), joins, registers (re-attaching, or initialising from
// rank 0 when the module is not initialised), and verifies what it found.
std::optional<Failure> Attach(const TrainerConfig& cfg, Reporter& out, Session& s) {
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (!SocketAccepts(cfg.address)) {
    if (absl::Now() > until) {
      return Failure{false,
                     "DEADLINE_EXCEEDED no daemon listens on " + cfg.address + " within 30 s"};
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  ClientOptions options;
  options.address = cfg.address;
  options.call_timeout = absl::Seconds(15);
  options.join_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
  if (!connected.ok()) return Failure{false, Describe(connected.status())};
  s.client = *std::move(connected);
  if (absl::Status j = s.client->Join(cfg.group, kWorld, cfg.rank, kToken, cfg.coordinator);
      !j.ok()) {
    return Failure{false, Describe(j)};
  }
  for (const std::string& lost : s.client->lost_modules()) out.Say("lost " + lost);
  out.Say("register");
  absl::StatusOr<RegisteredModule> m =
      s.client->Register("", cfg.manifest, ChaosPolicy(), InitMode::kFromRank0);
  if (!m.ok()) return Failure{false, Describe(m.status())};
  s.module = *std::move(m);
  s.generation = s.module.generation;
  if (s.module.init_summon != nullptr) {
    if (cfg.rank == 0) FillFull(*s.module.plan, *s.module.init_summon, 0);
    out.Say("init");
    absl::Status e = s.module.init_summon->End();
    s.module.init_summon.reset();
    if (!e.ok()) return Failure{false, Describe(e)};
    s.generation = 0;
    out.Say("committed 0");
    out.Say("initialised");
  }
  out.Say(absl::StrCat("attached ", s.generation));
  if (std::optional<Failure> f = VerifyAt(s, s.generation)) return f;
  out.Say(absl::StrCat("verified ", s.generation));
  return std::nullopt;
}

// One iteration of the loop: read-only summon (checked), a rank0_only writeback edit (a
// commit: g+1), a gradient reduce-scatter, an in-place optimizer step written in two halves,
// Commit (g+2). Reports each step before it.
std::optional<Failure> Iteration(const TrainerConfig& cfg, Reporter& out, Session& s) {
  const Plan& plan = *s.module.plan;
  Client& c = *s.client;
  out.Say("summon");
  SummonOptions read_only;
  read_only.writeback = false;
  {
    absl::StatusOr<std::unique_ptr<SummonedParams>> full = c.Summon("", "", read_only);
    if (!full.ok()) return Failure{false, Describe(full.status())};
    if (std::string bad = CheckFull(plan, **full, s.generation); !bad.empty()) {
      return Failure{true, bad};
    }
    if (absl::Status e = (*full)->End(); !e.ok()) return Failure{false, Describe(e)};
  }
  SummonOptions edit;
  edit.writeback = true;
  edit.rank0_only = true;
  {
    absl::StatusOr<std::unique_ptr<SummonedParams>> open = c.Summon("", "", edit);
    if (!open.ok()) return Failure{false, Describe(open.status())};
    out.Say("summon_open");
    if (cfg.rank == 0) FillFull(plan, **open, s.generation + 1);
    out.Say("inside_end");
    if (absl::Status e = (*open)->End(); !e.ok()) return Failure{false, Describe(e)};
    ++s.generation;
    out.Say(absl::StrCat("committed ", s.generation));
  }
  out.Say("reduce_scatter");
  absl::Status rs =
      c.ReduceScatterGrads("", 0, ReduceOp::kAvg, false, [&](client::PendingReduceScatter& p) {
        float* data = static_cast<float*>(p.data());
        for (int64_t i = 0; i < p.numel(); ++i) data[i] = static_cast<float>(cfg.rank + 1);
        return absl::OkStatus();
      });
  if (!rs.ok()) return Failure{false, Describe(rs)};
  absl::StatusOr<ShardViews> views = c.GetShardViews("");
  if (!views.ok()) return Failure{false, Describe(views.status())};
  WriteShards(*views, s.generation + 1, 0);
  out.Say("optimizer");
  absl::SleepFor(absl::Milliseconds(cfg.optimizer_pause_ms));
  WriteShards(*views, s.generation + 1, 1);
  out.Say("commit");
  absl::StatusOr<uint64_t> committed = c.Commit("");
  if (!committed.ok()) return Failure{false, Describe(committed.status())};
  if (*committed != s.generation + 1) {
    return Failure{
        true, absl::StrCat("Commit returned generation ", *committed, ", want ", s.generation + 1)};
  }
  s.generation = *committed;
  out.Say(absl::StrCat("committed ", s.generation));
  return std::nullopt;
}

// The trainer: attach, train to the target, and after any error attach again (a fresh
// client: re-join, re-register) and go on from the generation found. At most 40 attaches, 20 ms
// apart doubling to 640 ms (a restarted daemon or a re-forming group can take seconds under
// load: a fixed handful of quick attaches gave up while the coordinator came back), and 150 s
// in all; the last line says how it ended: "done G", "verified G" (verify only),
// "bad ..." (a check failed) or "fatal ..." (gave up).
int RunTrainer() {
  TrainerConfig cfg;
  cfg.rank = EnvInt("FS_CHAOS_RANK", 0);
  cfg.group = Env("FS_CHAOS_GROUP");
  cfg.coordinator = Env("FS_CHAOS_COORDINATOR");
  cfg.address = Env("FS_CHAOS_ADDRESS");
  cfg.manifest = ChaosManifest(kBlocks, Rows(), kCols);
  cfg.target = static_cast<uint64_t>(EnvInt("FS_CHAOS_TARGET", 6));
  cfg.verify_only = Env("FS_CHAOS_MODE") == "verify";
  cfg.optimizer_pause_ms = EnvInt("FS_CHAOS_OPTIMIZER_PAUSE_MS", 10);
  Reporter out(EnvInt("FS_CHAOS_FD", -1), EnvInt("FS_CHAOS_GO_FD", -1));
  const absl::Time give_up = absl::Now() + absl::Seconds(150);
  std::string last_error = "none";
  for (int attach = 0; attach < 40 && absl::Now() < give_up; ++attach) {
    if (attach > 0) absl::SleepFor(absl::Milliseconds(20 << std::min(attach - 1, 5)));
    auto s = std::make_unique<Session>();
    out.Say("attaching");
    std::optional<Failure> f = Attach(cfg, out, *s);
    while (!f.has_value() && !cfg.verify_only && s->generation < cfg.target) {
      f = Iteration(cfg, out, *s);
    }
    if (!f.has_value() && !cfg.verify_only) {
      // The end: the model is the reference's final generation, here and in a summon.
      f = VerifyAt(*s, s->generation);
    }
    if (!f.has_value()) {
      if (cfg.verify_only) {
        out.Final(absl::StrCat("verified ", s->generation));
      } else if (out.FinalOrRejoin(absl::StrCat("done ", s->generation))) {
        out.Say("error REJOIN another rank is re-attaching");
        continue;
      }
      s->client->Leave().IgnoreError();
      return 0;
    }
    if (f->bad) {
      out.Final("bad " + f->text);
      return 0;
    }
    last_error = f->text;
    out.Say("error " + f->text);
  }
  out.Final("fatal gave up re-attaching; last error: " + last_error);
  return 0;
}

TEST(DaemonChaosChild, Run) {
  if (Env("FS_CHAOS_FD").empty()) GTEST_SKIP() << "runs only as a child process";
  _exit(RunTrainer());
}

// ---- The parent ----

// Removes a finished trial's group (and its state record) from every daemon.
void DeleteTrialGroup(ChaosCluster& cluster, const std::string& group) {
  for (int i = 0; i < cluster.size(); ++i) {
    ::flatshard::testing::DeleteTrialGroup(cluster.daemon(i).address(), group);
  }
}

int FailedParts() {
  const ::testing::TestResult* r =
      ::testing::UnitTest::GetInstance()->current_test_info()->result();
  int n = 0;
  for (int i = 0; i < r->total_part_count(); ++i) n += r->GetTestPartResult(i).failed() ? 1 : 0;
  return n;
}

// Where a trial kills: daemon `daemon` once rank `rank` reports `step` for the `occurrence`-th
// time plus `delay` (step ""; then `delay` after the trainers started), and restarts it
// `restart_delay` later.
struct KillPlan {
  int daemon = 0;
  int rank = 0;  // -1: any rank
  std::string step;
  int occurrence = 1;
  absl::Duration delay;
  absl::Duration restart_delay;
  // The trainers' pause between the two halves of their optimizer step: a long one lets a
  // trainer that has not noticed the kill yet write its second half into the shards the
  // restarted daemon adopted (and restored) before its next call fails.
  int optimizer_pause_ms = 10;
  // The module is never dropped as lost (issue 24: no module lost to a single daemon kill;
  // see KillDaemonRightAfterAWritebackEndAnsweredOneRank). False allows a named loss.
  bool no_loss = true;
  std::string Name() const { return step.empty() ? "time" : step; }
};

struct TrialResult {
  bool killed = false;
  std::string outcome;            // "reattached", "lost", "no_reattach" (killed after the end)
  int64_t committed = -1;         // the last generation a rank saw committed before the kill
  int64_t reattached = -1;        // the generation every rank re-attached to
  bool commit_in_flight = false;  // a rank's last step before the kill: Commit or a writeback End
  absl::Duration reattach_time = absl::InfiniteDuration();  // restart exec -> all verified
  std::vector<std::string> errors;                          // every "error" line
  bool ok = false;
};

TrialResult RunTrial(ChaosCluster& cluster, const std::string& group, const KillPlan& plan,
                     uint64_t target) {
  TrialResult result;
  const int failed_before = FailedParts();
  SCOPED_TRACE(absl::StrCat("group ", group, ": kill daemon ", plan.daemon, " at ",
                            plan.step.empty() ? "time"
                                              : absl::StrCat("rank ", plan.rank, " \"", plan.step,
                                                             "\" #", plan.occurrence),
                            " + ", absl::FormatDuration(plan.delay), ", restart after ",
                            absl::FormatDuration(plan.restart_delay)));
  absl::Time kill_started = absl::InfiniteFuture();
  absl::Time killed_at = absl::InfiniteFuture();
  absl::Time restarted_at = absl::InfiniteFuture();
  int64_t final_generation = -1;
  {
    Trainers trial(cluster, group);
    trial.Start("train", target, plan.optimizer_pause_ms);
    int seen = 0;
    bool reached = true;
    if (plan.step.empty()) {
      trial.Pump(plan.delay, [](int, const std::string& l) { return FinalLine(l); });
    } else {
      reached = trial.Pump(absl::Seconds(60), [&](int rank, const std::string& line) {
        return (plan.rank < 0 || rank == plan.rank) && line == plan.step &&
               ++seen == plan.occurrence;
      });
      EXPECT_TRUE(reached) << "no trainer progress within 60 s (a hang)";
      if (reached) absl::SleepFor(plan.delay);
    }
    if (reached) {
      kill_started = absl::Now();
      cluster.Kill(plan.daemon);
      killed_at = absl::Now();
      result.killed = true;
      absl::SleepFor(plan.restart_delay);
      restarted_at = absl::Now();
      EXPECT_TRUE(cluster.Restart(plan.daemon)) << "daemon " << plan.daemon << " did not restart";
    }
    const bool ended = trial.PumpToFinal(absl::Seconds(170));
    EXPECT_TRUE(ended) << "a trainer neither finished nor failed within 170 s (a hang)";
    trial.Release();

    // Per rank: what it saw committed before the kill, and the first generation it attached
    // to and verified after the daemon died (by the times the trainers said them).
    std::map<int, int64_t> reattached;
    std::map<int, bool> lost;
    std::map<int, absl::Time> verified_at;
    for (int r = 0; r < kWorld; ++r) {
      const Trainer& t = trial.trainer(r);
      bool commit_in_flight = false;  // the rank's last step before its first error
      for (const Line& l : t.lines) {
        EXPECT_FALSE(absl::StartsWith(l.text, "bad ")) << "rank " << r << ": " << l.text;
        EXPECT_FALSE(absl::StartsWith(l.text, "fatal ")) << "rank " << r << ": " << l.text;
        int64_t v = 0;
        const bool before = l.sent < kill_started;  // said before the kill
        const bool after = l.sent > killed_at;      // said after the daemon was dead
        if (before) {
          // What the rank was doing when the daemon died: the last step it reported before.
          // (An initialisation is a commit too: "register" then "init" until "committed 0".)
          if (l.text == "commit" || l.text == "inside_end" || l.text == "register" ||
              l.text == "init") {
            commit_in_flight = true;
          } else if (absl::StartsWith(l.text, "committed ")) {
            commit_in_flight = false;
          }
        }
        if (absl::StartsWith(l.text, "error ")) {
          result.errors.push_back(l.text.substr(6));
        } else if (before && absl::StartsWith(l.text, "committed ") &&
                   absl::SimpleAtoi(l.text.substr(10), &v)) {
          result.committed = std::max(result.committed, v);
        } else if (after && absl::StartsWith(l.text, "lost ")) {
          lost[r] = true;
        } else if (after && !reattached.count(r) && absl::StartsWith(l.text, "verified ") &&
                   absl::SimpleAtoi(l.text.substr(9), &v)) {
          reattached[r] = v;
          verified_at[r] = l.at;
        } else if (absl::StartsWith(l.text, "done ") && absl::SimpleAtoi(l.text.substr(5), &v)) {
          if (final_generation >= 0) {
            EXPECT_EQ(v, final_generation) << "rank " << r << " ended at another generation";
          }
          final_generation = std::max(final_generation, v);
        }
      }
      if (commit_in_flight) result.commit_in_flight = true;
      const std::string last = t.lines.empty() ? "(nothing)" : t.lines.back().text;
      EXPECT_TRUE(absl::StartsWith(last, "done ")) << "rank " << r << " ended with: " << last;
    }
    if (final_generation >= 0) {
      EXPECT_GE(final_generation, static_cast<int64_t>(target));
    }

    if (reattached.empty()) {
      // The kill came after the last commit (or before any trainer noticed, and nothing
      // failed): nobody re-attached; the verify phase below still checks the state.
      result.outcome = "no_reattach";
    } else {
      EXPECT_EQ(reattached.size(), static_cast<size_t>(kWorld))
          << "some ranks attached again after the kill, others did not";
      const int64_t g0 = reattached.begin()->second;
      for (const auto& [r, g] : reattached) {
        EXPECT_EQ(g, g0) << "rank " << r << " re-attached to generation " << g << ", rank "
                         << reattached.begin()->first << " to " << g0;
      }
      result.reattached = g0;
      if (!lost.empty()) {
        result.outcome = "lost";
        // A module is dropped as lost only when its ranks' committed generations differ after
        // the restart (README "Restarts": a kill between the ranks' or the daemons' copies of
        // one commit), and the loss is named to every rank at Join: the clear error issue 14
        // allows instead of the committed generation. That takes a kill while a commit
        // (Commit, or a writeback End) was in flight. (KillDaemonRightAfterAWritebackEnd
        // AnsweredOneRank asks more of one daemon: no loss at all.)
        EXPECT_FALSE(plan.no_loss) << "the module was dropped as lost";
        EXPECT_TRUE(result.commit_in_flight)
            << "the module was reported lost although no commit was in flight at the kill";
        EXPECT_EQ(lost.size(), static_cast<size_t>(kWorld)) << "the loss reached only some ranks";
        EXPECT_EQ(g0, 0) << "a lost module is initialised afresh";
      } else {
        result.outcome = "reattached";
        EXPECT_GE(g0, result.committed)
            << "generation " << result.committed << " was committed, yet the ranks re-attached to "
            << g0 << " (a committed step was lost)";
        EXPECT_LE(g0, result.committed + 1)
            << "the ranks re-attached to a generation no rank could have committed";
      }
      absl::Time last_verified = absl::InfinitePast();
      for (const auto& [r, at] : verified_at) last_verified = std::max(last_verified, at);
      if (restarted_at != absl::InfiniteFuture())
        result.reattach_time = last_verified - restarted_at;
    }
    if (FailedParts() != failed_before) {
      for (int r = 0; r < kWorld; ++r) {
        std::string text;
        for (const Line& l : trial.trainer(r).lines) {
          absl::StrAppend(&text, l.sent < kill_started ? "" : "(after kill) ", l.text, " | ");
        }
        std::fprintf(stderr, "trainer rank %d said: %s\n", r, text.c_str());
      }
    }
  }

  // Fresh processes re-attach to what the trial left: the final generation, exactly.
  if (final_generation >= 0) {
    Trainers verify(cluster, group);
    verify.Start("verify", 0);
    EXPECT_TRUE(verify.PumpToFinal(absl::Seconds(60))) << "re-attaching after the trial hung";
    verify.Release();
    for (int r = 0; r < kWorld; ++r) {
      const Trainer& t = verify.trainer(r);
      const std::string last = t.lines.empty() ? "(nothing)" : t.lines.back().text;
      EXPECT_EQ(last, absl::StrCat("verified ", final_generation))
          << "rank " << r << " after the trial: " << last;
    }
  }
  DeleteTrialGroup(cluster, group);
  result.ok = FailedParts() == failed_before;
  if (!result.ok) cluster.PrintLogs(80);
  return result;
}

// Counts for the summary.
struct Summary {
  std::map<std::string, int> count;
  std::vector<double> reattach_ms;
  void Add(const std::string& layout, const KillPlan& plan, const TrialResult& r) {
    ++count["trials"];
    ++count[absl::StrCat(layout, ".kill_point.", plan.Name())];
    ++count[r.killed ? "killed" : "not_killed"];
    ++count[r.ok ? "consistent" : "FAILED"];
    ++count["outcome." + r.outcome];
    if (r.outcome == "reattached") {
      const int64_t d = r.reattached - r.committed;
      ++count[absl::StrCat("reattached_at.committed", d == 0 ? "" : (d > 0 ? "+" : ""),
                           d == 0 ? "" : absl::StrCat(d))];
    }
    for (const std::string& e : r.errors) {
      ++count["error." + e.substr(0, e.find(' '))];
    }
    if (r.reattach_time != absl::InfiniteDuration()) {
      reattach_ms.push_back(absl::ToDoubleMilliseconds(r.reattach_time));
    }
  }
  std::string Text() const {
    std::string s;
    for (const auto& [k, v] : count) absl::StrAppend(&s, k, "=", v, " ");
    if (!reattach_ms.empty()) {
      std::vector<double> t = reattach_ms;
      std::sort(t.begin(), t.end());
      absl::StrAppend(&s, "reattach_ms(min/median/max)=", static_cast<int>(t.front()), "/",
                      static_cast<int>(t[t.size() / 2]), "/", static_cast<int>(t.back()));
    }
    return s;
  }
};

std::vector<std::string> DaemonFlags() {
  return {"--peer_timeout=2s", "--heartbeat_interval=200ms"};
}

#if !FS_CHAOS_SOAK

class DaemonChaosTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!DaemonHasStateDir()) {
      GTEST_SKIP() << "flatshardd has no --state_dir yet (branch restart not merged)";
    }
  }
};

// Runs `plans` one after another on one cluster and checks every trial.
void RunPlans(int daemons, const std::vector<KillPlan>& plans) {
  ChaosCluster cluster(daemons, DaemonFlags());
  Summary summary;
  for (size_t i = 0; i < plans.size(); ++i) {
    TrialResult r = RunTrial(cluster, absl::StrCat("f", i), plans[i], 6);
    EXPECT_TRUE(r.killed) << "trial " << i;
    EXPECT_TRUE(r.ok) << "trial " << i << " (" << plans[i].Name() << ")";
    summary.Add(daemons == 1 ? "single" : "two", plans[i], r);
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf("daemon chaos (%d daemon%s): %s\n", daemons, daemons == 1 ? "" : "s",
              summary.Text().c_str());
}

KillPlan At(int daemon, int rank, const std::string& step, int occurrence, absl::Duration delay,
            absl::Duration restart_delay, int optimizer_pause_ms = 10) {
  KillPlan p;
  p.daemon = daemon;
  p.rank = rank;
  p.step = step;
  p.occurrence = occurrence;
  p.delay = delay;
  p.restart_delay = restart_delay;
  p.optimizer_pause_ms = optimizer_pause_ms;
  return p;
}

// Fixed kill points (with two daemons the victim alternates, the coordinator included):
// mid optimizer step; inside Commit (a commit intent to finish from the shards); inside the
// read-only summon after a Commit.
TEST_P(DaemonChaosTest, KillDaemonAtFixedPointsEveryRankReattachesConsistently) {
  const int daemons = GetParam();
  RunPlans(daemons,
           {
               At(daemons - 1, 1, "optimizer", 1, absl::ZeroDuration(), absl::ZeroDuration()),
               At(0, 2, "commit", 2, absl::Milliseconds(2), absl::Milliseconds(100)),
               At(daemons - 1, 0, "summon", 2, absl::Milliseconds(1), absl::ZeroDuration()),
           });
}

// Fixed on branch mixfix (an adopted group owes a rollback at its first formation and its
// adopted ranks are stale until they read their views). Was: the daemon is killed mid optimizer
// step and restarted at once; it adopts the shards and restores them from the committed copies at
// start, but the trainers, which have not noticed yet, write the second half of their step 400 ms
// later into the very segments it adopted (their mappings outlive the dead daemon). Their Commit
// fails; they re-join and re-register, and the re-formed group is NOT rolled back again: Register
// and GetShardViews report generation 1 while the shards hold half of generation 2 ("bad
// shard of unit 0 element 171 = 2172, want generation 1's 1172"): a silent mix. After a
// trainer crash the re-form rolls back (client.h, Commit); an adopted group owes the same
// rollback at its first re-form.
TEST_P(DaemonChaosTest, StaleTrainerWritesIntoAdoptedShardsAfterTheRestart) {
  const int daemons = GetParam();
  RunPlans(daemons,
           {At(daemons - 1, 1, "optimizer", 1, absl::ZeroDuration(), absl::ZeroDuration(), 400)});
}

// Found by DaemonChaosSoak seed 1 (fixed on branch restart at fd22c9d): the daemon killed
// right after a rank0_only writeback End answered one rank ("committed 1") but before the
// other ranks' copies were recorded ready used to drop the whole module as lost after the
// restart (and, before 327d518, without telling a one-daemon group: Register silently
// initialised the model afresh). Within one daemon nothing needs to be lost: with one daemon
// every rank must re-attach at >= the answered generation, never a named loss.
TEST_P(DaemonChaosTest, KillDaemonRightAfterAWritebackEndAnsweredOneRank) {
  const int daemons = GetParam();
  std::vector<KillPlan> plans = {
      At(0, -1, "committed 1", 1, absl::ZeroDuration(), absl::ZeroDuration()),
      At(daemons - 1, -1, "committed 3", 1, absl::ZeroDuration(), absl::ZeroDuration())};
  if (daemons == 1) {
    for (KillPlan& p : plans) p.no_loss = true;
  }
  RunPlans(daemons, plans);
}

// A client of the daemon that died must never be taken for a session of the restarted one.
// Session ids restart at 1 in every daemon process, and an adopted group takes the same
// (group, rank, token): a trainer's client from before the restart (its channel reconnects
// to the new daemon on the same socket) calls with session 1 while the rank's new session,
// joined after the restart, is session 1 again.
TEST_P(DaemonChaosTest, AClientFromBeforeTheRestartIsNotTakenForTheNewSession) {
  if (GetParam() != 1) GTEST_SKIP() << "one daemon is enough";
  ChaosCluster cluster(1, DaemonFlags());
  const std::string manifest = ChaosManifest(1, 4, 16);
  auto connect = [&] {
    ClientOptions o;
    o.address = cluster.AddressFor(0);
    o.call_timeout = absl::Seconds(10);
    o.join_timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  std::unique_ptr<Client> old_client = connect();
  ASSERT_NE(old_client, nullptr);
  ASSERT_TRUE(old_client->Join("sess", 1, 0, kToken).ok());
  absl::StatusOr<RegisteredModule> m =
      old_client->Register("", manifest, ChaosPolicy(), InitMode::kZeros);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(old_client->Commit("").ok());
  cluster.Kill(0);
  ASSERT_TRUE(cluster.Restart(0));
  std::unique_ptr<Client> new_client = connect();
  ASSERT_NE(new_client, nullptr);
  ASSERT_TRUE(new_client->Join("sess", 1, 0, kToken).ok());
  absl::StatusOr<RegisteredModule> again =
      new_client->Register("", manifest, ChaosPolicy(), InitMode::kZeros);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->generation, 1u);
  // The old client's calls must fail (its session died with the old daemon).
  absl::StatusOr<uint64_t> stale = old_client->Commit("");
  EXPECT_FALSE(stale.ok()) << "the restarted daemon committed generation " << *stale
                           << " for a client whose session died with the old daemon";
  absl::StatusOr<ShardViews> views = old_client->GetShardViews("");
  EXPECT_FALSE(views.ok()) << "the restarted daemon answered a client from before the restart";
}

// Fixed on branch mixfix (safety net: a module whose local ranks hold different generations,
// counting a ready commit's, is reported "mixed" and dropped as lost on every daemon, naming
// each rank's generation). Was: BUG (found by DaemonChaosSoak seed 4, trial "two 26";
// timing-dependent): daemon node1 is killed while a Commit's agreement is under way. On the
// surviving daemon node0 rank 0 is answered "committed 2" and rank 2 "generation 2 was not
// committed on any rank"; after the restart the group re-forms with ranks 0 and 1 at generation 2
// and rank 2 at generation 1, and a summon hands every rank a mix of the two (scale[684] = 1685,
// generation 1's value, in a model said to be at generation 2). The rendezvous compares one
// generation per daemon; the two local ranks of node0 disagree. This test kills node1 inside Commit
// at a range of small delays, 8 trials; any of them may hit it.
TEST_P(DaemonChaosTest, KillOneOfTwoDaemonsInsideCommitNeverMixesGenerations) {
  if (GetParam() != 2) GTEST_SKIP() << "two daemons";
  std::vector<KillPlan> plans;
  for (int i = 0; i < 8; ++i) {
    plans.push_back(At(1, i % 2 == 0 ? 1 : 0, "commit", 1 + i % 3, absl::Microseconds(250 * i),
                       absl::Milliseconds(20 * i)));
  }
  RunPlans(2, plans);
}

// Found by DaemonChaosSoak seed 2413 (two daemons): daemon 0 killed during the module's
// initialisation, after its init End agreed on every rank but before daemon 0 recorded it; rank
// 1 was answered "initialised", the restarted daemon 0 had no record, and the module was dropped
// as lost. Fixed on s12-init24 (the re-form undoes the initialisation on every daemon,
// server/module/init_undo.cc; init_restart_test holds each window deterministically): either
// daemon killed at the registration and at the init End, at a few delays; never a loss.
TEST_P(DaemonChaosTest, KillADaemonDuringTheInitialisationLosesNothing) {
  const int daemons = GetParam();
  std::vector<KillPlan> plans;
  for (int i = 0; i < 4; ++i) {
    plans.push_back(At(i % daemons, i % kWorld, i < 2 ? "register" : "init", 1,
                       absl::Microseconds(500 * i), absl::Milliseconds(50 * i)));
  }
  RunPlans(daemons, plans);
}

INSTANTIATE_TEST_SUITE_P(Daemons, DaemonChaosTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 1 ? std::string("Single")
                                                  : std::string("TwoDaemons");
                         });

#else  // FS_CHAOS_SOAK

// FS_CHAOS_TRIALS randomized trials per layout (default 50; FS_CHAOS_SEED; FS_CHAOS_LAYOUTS
// "1", "2" or "1,2"): a random victim daemon, kill point (a loop step of a random rank and
// iteration, the initialisation, or a random time), delay after it (none, up to 3 ms, up to
// 30 ms) and restart delay (0-300 ms).
TEST(DaemonChaosSoak, RandomKills) {
  if (!DaemonHasStateDir()) {
    GTEST_SKIP() << "flatshardd has no --state_dir yet (branch restart not merged)";
  }
  const int trials = EnvInt("FS_CHAOS_TRIALS", 50);
  const uint32_t seed = Env("FS_CHAOS_SEED").empty()
                            ? static_cast<uint32_t>(absl::ToUnixMicros(absl::Now()))
                            : static_cast<uint32_t>(std::atoll(Env("FS_CHAOS_SEED").c_str()));
  const std::string layouts = Env("FS_CHAOS_LAYOUTS").empty() ? "1,2" : Env("FS_CHAOS_LAYOUTS");
  std::mt19937 rng(seed);
  Summary summary;
  std::printf("daemon chaos soak: seed %u, %d trials per layout\n", seed, trials);
  for (int daemons : {1, 2}) {
    if (!absl::StrContains(layouts, absl::StrCat(daemons))) continue;
    ChaosCluster cluster(daemons, DaemonFlags());
    const std::string layout = daemons == 1 ? "single" : "two";
    for (int i = 0; i < trials; ++i) {
      KillPlan plan;
      plan.daemon = static_cast<int>(rng() % daemons);
      const int kind = static_cast<int>(rng() % 8);
      if (kind == 0) {
        plan.delay = absl::Milliseconds(static_cast<int>(rng() % 1500));
      } else if (kind == 1) {
        // Inside the initialisation (its Register, its init End), said once by every rank.
        plan.step = rng() % 2 == 0 ? "register" : "init";
        plan.rank = static_cast<int>(rng() % kWorld);
        plan.delay = absl::Microseconds(static_cast<int>(rng() % 30000));
      } else {
        plan.step = LoopSteps()[rng() % LoopSteps().size()];
        plan.rank = static_cast<int>(rng() % kWorld);
        plan.occurrence = 1 + static_cast<int>(rng() % 3);
        const int d = static_cast<int>(rng() % 3);
        plan.delay = d == 0 ? absl::ZeroDuration()
                            : absl::Microseconds(static_cast<int>(rng() % (d == 1 ? 3000 : 30000)));
      }
      plan.restart_delay = absl::Milliseconds(static_cast<int>(rng() % 300));
      // FS_CHAOS_ONLY_TRIAL=N: reproduce trial N of a seed alone.
      if (!Env("FS_CHAOS_ONLY_TRIAL").empty() && EnvInt("FS_CHAOS_ONLY_TRIAL", -1) != i) continue;
      TrialResult r = RunTrial(cluster, absl::StrCat("s", daemons, "x", i), plan, 6);
      summary.Add(layout, plan, r);
      std::printf("trial %s %d: kill daemon %d at %s: %s, committed %lld, re-attached %lld%s\n",
                  layout.c_str(), i, plan.daemon, plan.Name().c_str(), r.ok ? "ok" : "FAILED",
                  static_cast<long long>(r.committed), static_cast<long long>(r.reattached),
                  r.reattach_time == absl::InfiniteDuration()
                      ? ""
                      : absl::StrCat(" in ", absl::FormatDuration(r.reattach_time)).c_str());
      std::fflush(stdout);
    }
  }
  std::printf("daemon chaos soak (seed %u): %s\n", seed, summary.Text().c_str());
  RecordProperty("summary", summary.Text());
}

#endif  // FS_CHAOS_SOAK

}  // namespace
}  // namespace flatshard::chaos
