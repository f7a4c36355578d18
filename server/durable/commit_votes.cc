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

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
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

namespace flatshard::server {

using internal::Display;

void Records::TestingPauseBeforeIntent(uint64_t generation) {
  static const std::pair<uint64_t, absl::Duration> pause = [] {
    std::pair<uint64_t, absl::Duration> p{0, absl::ZeroDuration()};
    const std::string v = absl::GetFlag(FLAGS_testing_pause_before_commit_intent);
    std::vector<std::string> parts = absl::StrSplit(v, absl::MaxSplits(':', 1));
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &p.first) ||
        !absl::ParseDuration(parts[1], &p.second)) {
      if (!v.empty()) FS_LOG(ERROR) << "--testing_pause_before_commit_intent=" << v << " ignored";
      return std::pair<uint64_t, absl::Duration>{0, absl::ZeroDuration()};
    }
    return p;
  }();
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

}  // namespace flatshard::server
