// Records: votes. No module is lost to a single daemon kill (README "Restarts").
//
// A Commit reaches one rank only once every rank of the group voted yes, each with its
// shards written: so when a daemon is killed between its ranks' votes and their commit intent
// (or the agreement itself is torn by the kill), another daemon may hold generation G while
// this one's ranks hold G in their shards and G-1 in their committed copies. Each daemon
// records, before its first local vote for G goes out, that its ranks voted for G ("voted"
// in the module's record; a write without an fsync: the page cache outlives the process, the
// shared-memory shards do not outlive the machine). A rank that voted and has not learnt the
// outcome can end at G-1 (rolled back from its committed copy) or at G (rolled forward from
// its shards); it reports "G-1|G" at rendezvous (internal::HeldKey), every daemon resolves
// the module to the lowest generation all of them can end at (internal::ResolveHeld, in
// ReconcileModules), and the rollback of the re-form rolls the voted ranks there
// (Modules::RollbackNow, RollForward). So the daemons end at one committed generation:
// G when any rank committed it (then every rank voted), G-1 when none did (then no trainer
// was answered G).
//
// A writeback End of a group over several daemons votes the same way, one round later: its
// ranks write back into their shards only after the first agreement (every rank's End), so
// once every local rank has written back the daemon records its vote ("voted": G), then the
// ranks exchange votes (a second agreement, Modules::VoteEnd), and only then does any daemon
// copy into the committed copies (intent, copies, end, as Records::EndArrive). A daemon killed
// before its vote: no daemon copied, every daemon resolves to G-1; after it: its shards hold
// G, it is rolled forward or back with the others. Cost: one more all-gather of the ranks'
// votes per committing writeback End on several daemons (one daemon: unchanged).

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "server/durable/records.h"
#include "server/messages.h"

// Testing only: a kill point between a Commit's agreement and its intent record, the
// moment a daemon's ranks voted and another daemon may have committed already.
ABSL_FLAG(std::string, testing_pause_before_commit_intent, "",
          "Testing only: \"G:DURATION\" pauses this daemon's commit of generation G for "
          "DURATION after every rank agreed and before its intent is recorded (a kill then "
          "leaves its ranks voted, its record one generation behind).");

// Testing only: kill points of a writeback End on several daemons.
ABSL_FLAG(std::string, testing_pause_end_vote, "",
          "Testing only: \"POINT:G:DURATION\" pauses this daemon's writeback End of "
          "generation G for DURATION at POINT: before_vote (its ranks wrote back, their vote is "
          "not recorded), after_vote (recorded, not sent), before_intent (every rank voted "
          "yes, the intent is not recorded) or deferred_copy (with a state directory, also on "
          "one daemon: the End answered, its own ranges' copy from the summon buffers into the "
          "committed copies, recorded, not started).");

namespace flatshard::server {

using internal::Display;

namespace {

// A testing pause "G:DURATION" (`flag` names it in the error); {0, 0} when unset or invalid.
std::pair<uint64_t, absl::Duration> ParsePause(const std::string& v, const char* flag) {
  std::pair<uint64_t, absl::Duration> p{0, absl::ZeroDuration()};
  std::vector<std::string> parts = absl::StrSplit(v, absl::MaxSplits(':', 1));
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &p.first) ||
      !absl::ParseDuration(parts[1], &p.second)) {
    if (!v.empty()) FS_LOG(ERROR) << "--" << flag << "=" << v << " ignored";
    return {0, absl::ZeroDuration()};
  }
  return p;
}

}  // namespace

void Records::TestingPauseBeforeIntent(uint64_t generation) {
  static const std::pair<uint64_t, absl::Duration> pause =
      ParsePause(absl::GetFlag(FLAGS_testing_pause_before_commit_intent),
                 "testing_pause_before_commit_intent");
  if (pause.first == 0 || pause.first != generation) return;
  FS_LOG(WARNING) << "testing: commit of generation " << generation
                  << " paused between its agreement and its intent for "
                  << absl::FormatDuration(pause.second);
  absl::SleepFor(pause.second);
}

void Records::RecordVote(const Caller& caller, const std::string& module, uint64_t generation,
                         absl::AnyInvocable<void()> then) {
  if (!enabled()) {
    then();
    return;
  }
  // One write per daemon and Commit: the other local ranks' votes find it recorded. They
  // still queue behind it on the group's strand, so no vote goes out before it is written.
  RunDurable(caller.group, [this, caller, module, generation, then = std::move(then)]() mutable {
    EditAndRecord(
        caller.group, module,
        [&](Registered& reg) {
          if (reg.voted_commit == generation) return false;
          reg.voted_commit = generation;
          return true;
        },
        /*sync=*/false);
    then();
  });
}

bool Records::ClearVoteLocked(Registered& reg, int32_t rank) {
  if (rank >= 0 && rank < static_cast<int32_t>(reg.voted.size())) reg.voted[rank] = 0;
  if (reg.voted_commit == 0) return false;
  if (std::any_of(reg.voted.begin(), reg.voted.end(), [](uint64_t v) { return v != 0; })) {
    return false;
  }
  reg.voted_commit = 0;
  return true;
}

void Records::VoteRefused(const Caller& caller, const std::string& module,
                          absl::AnyInvocable<void()> then) {
  bool cleared = false;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (Registered* reg = FindModuleLocked(g, module)) cleared = ClearVoteLocked(*reg, caller.rank);
  }
  if (!cleared || !enabled()) {
    then();
    return;
  }
  // A stale vote in the record would let a later restart roll shards forward that an End
  // then wrote: it goes before the trainer hears of the refusal.
  RunDurable(caller.group, [this, caller, module, then = std::move(then)]() mutable {
    EditAndRecord(
        caller.group, module, [](Registered&) { return true; }, /*sync=*/false);
    then();
  });
}

absl::Status Records::RollForward(
    const std::string& group, const std::string& module, uint64_t target,
    const std::vector<std::pair<int32_t, std::vector<DurablePair>>>& forward,
    const std::vector<int32_t>& at_target) {
  std::vector<int32_t> ready;
  for (const auto& [rank, durable] : forward) ready.push_back(rank);
  std::vector<int32_t> done = at_target;
  std::sort(ready.begin(), ready.end());
  std::sort(done.begin(), done.end());
  // The intent first: a kill during the copies finishes them from the shards at restart.
  EditAndRecord(group, module, [&](Registered& reg) {
    reg.pending_commit = state::PendingCommit{target, "commit", ready, done};
    return true;
  });
  absl::Status status;
  std::vector<int32_t> copied;
  for (const auto& [rank, durable] : forward) {
    absl::Status s = CopyCommitted(rank, durable, /*to_committed=*/true);
    if (s.ok()) {
      copied.push_back(rank);
    } else if (status.ok()) {
      status = s;
    }
  }
  EditAndRecord(
      group, module,
      [&](Registered& reg) {
        for (int32_t r : copied) MarkCommitDoneLocked(reg, r, target);
        return true;
      },
      /*sync=*/false);
  if (status.ok()) {
    FS_LOG(INFO) << "group=" << group << " module=" << Display(module) << " rank(s) "
                 << absl::StrJoin(ready, ",") << " rolled forward to generation " << target
                 << " from their shards (they voted for it; another rank committed it)";
  }
  return status;
}

void Records::TestingPauseEndVote(const char* point, uint64_t generation) {
  static const std::pair<std::string, std::pair<uint64_t, absl::Duration>> pause = [] {
    const std::string v = absl::GetFlag(FLAGS_testing_pause_end_vote);
    const size_t colon = v.find(':');
    const std::string at = v.substr(0, colon);
    if (colon == std::string::npos || (at != "before_vote" && at != "after_vote" &&
                                       at != "before_intent" && at != "deferred_copy")) {
      if (!v.empty()) FS_LOG(ERROR) << "--testing_pause_end_vote=" << v << " ignored";
      return std::make_pair(std::string(), std::make_pair(uint64_t{0}, absl::ZeroDuration()));
    }
    return std::make_pair(at, ParsePause(v.substr(colon + 1), "testing_pause_end_vote"));
  }();
  if (pause.second.first == 0 || pause.second.first != generation || pause.first != point) return;
  FS_LOG(WARNING) << "testing: writeback End of generation " << generation << " paused at " << point
                  << " for " << absl::FormatDuration(pause.second.second);
  absl::SleepFor(pause.second.second);
}

void Records::EndVoteArrive(const Caller& caller, const std::string& module, uint64_t k,
                            uint64_t generation, bool applying, absl::Status status,
                            absl::AnyInvocable<void(absl::Status)> vote) {
  std::vector<EndArrival> batch;
  EndArrival mine{caller.rank, applying, std::move(status), {}, std::move(vote), {}};
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (Registered* reg = FindModuleLocked(g, module)) {
      std::vector<EndArrival>& arrived = reg->end_votes[k];
      arrived.push_back(std::move(mine));
      size_t local = 0;
      for (const std::vector<UnitShard>& s : reg->shards_by_rank) local += s.empty() ? 0 : 1;
      if (arrived.size() < local) return;  // the last local rank records the daemon's vote
      batch = std::move(arrived);
      reg->end_votes.erase(k);
      while (!reg->end_votes.empty() && reg->end_votes.begin()->first + 64 < k) {
        reg->end_votes.erase(reg->end_votes.begin());
      }
    } else {
      batch.push_back(std::move(mine));
    }
  }
  RunDurable(caller.group,
             [this, group = caller.group, module, generation, batch = std::move(batch)]() mutable {
               ProcessEndVotes(group, module, generation, std::move(batch));
             });
}

void Records::ProcessEndVotes(const std::string& group, const std::string& module,
                              uint64_t generation, std::vector<EndArrival> batch) {
  // The record's vote covers every local rank (a restart may roll each forward from its
  // shards), so it is written only when every local rank wrote back; else every local rank
  // votes no, naming the first that did not.
  absl::Status no;
  for (const EndArrival& a : batch) {
    if (a.applying && a.status.ok()) continue;
    no = absl::FailedPreconditionError(
        absl::StrCat("rank ", a.rank, " did not write back into its shards",
                     a.applying ? absl::StrCat(": ", a.status.message())
                                : std::string(" (its agreement failed)")));
    break;
  }
  if (no.ok()) {
    TestingPauseEndVote("before_vote", generation);
    EditAndRecord(
        group, module,
        [&](Registered& reg) {
          if (reg.voted.size() < reg.generation.size()) reg.voted.resize(reg.generation.size());
          for (const EndArrival& a : batch) {
            if (a.rank < static_cast<int32_t>(reg.voted.size())) reg.voted[a.rank] = generation;
          }
          reg.voted_commit = generation;
          return true;
        },
        /*sync=*/false);
    TestingPauseEndVote("after_vote", generation);
  }
  for (EndArrival& a : batch) {
    if (a.finish) a.finish(no);
  }
}

}  // namespace flatshard::server
