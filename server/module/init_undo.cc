// Modules: a daemon killed during a module's initialisation (no module lost to a single
// daemon kill, README "Restarts"). A registration, and the End of an init summon, commit on
// each daemon once every rank agreed; a daemon killed before its record comes back without the
// module while the others hold it at generation 0 (or one comes back initialised while another
// daemon's init never completed). No step was trained on it yet and the trainers hold its
// initial values, so the re-form undoes the initialisation on every daemon
// (internal::InitUndoneEverywhere) and every rank's next Register runs it again, instead of
// dropping the module as lost.
// Within one daemon the init is decided once for all its local ranks (SettleInit): their init
// Ends may split (an all-gather torn by a peer's death completes on one rank and fails on
// another, or one rank's writeback fails), and a rank whose init never applied must not see
// the module as usable (its shard holds zeros, not the model). A daemon left so reports the
// module not initialised, and the re-form undoes the init on the daemons that completed it.

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "server/durable/records.h"
#include "server/messages.h"
#include "server/module/generations.h"
#include "server/module/init_undo.h"
#include "server/module/modules.h"
#include "server/module/unit_ops.h"
#include "server/module/writeback_end.h"

ABSL_FLAG(std::string, testing_pause_init, "",
          "Testing only: \"POINT:DURATION\" pauses this daemon for DURATION inside every "
          "initialisation at POINT: register_before_record (every rank agreed to a "
          "registration, this daemon has not recorded it) or end_before_intent (every rank "
          "agreed to an init End, this daemon has not recorded it).");

ABSL_FLAG(int, testing_init_end_fails, -1,
          "Testing only: the first init End of rank R on this daemon fails as if the "
          "agreement's all-gather had failed on that rank alone (as when a peer daemon dies "
          "mid-collective), although every rank agreed and the others apply. -1: never.");

ABSL_FLAG(std::string, testing_pause_register_install, "",
          "Testing only: \"R:DURATION\" makes the registration of local rank R wait DURATION, "
          "once every rank agreed, before this daemon installs it, while its other local ranks "
          "install, record and answer theirs.");

namespace flatshard::server {

using internal::Display;

absl::Duration internal::TestingRegisterInstallPause(int32_t rank) {
  static const std::pair<int32_t, absl::Duration> pause = [] {
    const std::string v = absl::GetFlag(FLAGS_testing_pause_register_install);
    const size_t colon = v.find(':');
    int32_t r = -1;
    absl::Duration d;
    if (colon == std::string::npos || !absl::SimpleAtoi(v.substr(0, colon), &r) || r < 0 ||
        !absl::ParseDuration(v.substr(colon + 1), &d)) {
      if (!v.empty()) FS_LOG(ERROR) << "--testing_pause_register_install=" << v << " ignored";
      return std::make_pair(-1, absl::ZeroDuration());
    }
    return std::make_pair(r, d);
  }();
  return rank == pause.first ? pause.second : absl::ZeroDuration();
}

bool internal::TestingInitAgreementFails(int32_t rank) {
  static std::atomic<bool> fired{false};
  if (rank != absl::GetFlag(FLAGS_testing_init_end_fails)) return false;
  return !fired.exchange(true);
}

void Modules::WritebackEnd::SettleInit(Modules& modules, absl::Status own,
                                       StatusCallback done) const {
  // Every local rank's init End gets here once it agreed (applied, failed, or its module
  // dropped), so no wait outlasts the slowest local rank's End; a failure answers at once.
  absl::Status part =
      own.ok() ? own
               : absl::Status(own.code(), absl::StrCat("rank ", caller.rank,
                                                       "'s init End failed: ", own.message()));
  modules.assembly_.Arrive(
      slot, caller.rank, locals, std::move(part), std::nullopt,
      absl::StrCat("group ", caller.group, ": the init End of summon ", summon),
      [&modules, caller = caller, summon = summon, module = module, own = std::move(own),
       done = std::move(done)](absl::Status verdict) mutable {
        absl::Status answer = std::move(own);  // a rank whose own End failed keeps its error
        {
          std::shared_ptr<Group> held = modules.table_.FindOrGone(caller.group);
          Group& g = *held;
          absl::MutexLock lock(&g.mu);
          auto found = g.removed ? g.registered.end() : g.registered.find(module);
          if (answer.ok() && found != g.registered.end()) {
            Registered& reg = found->second;
            // With records, initialized is already set once every local rank's copies are
            // (Records::MarkCommitDoneLocked): every local rank applied then.
            if (verdict.ok() || reg.initialized) {
              reg.initialized = true;
              reg.uninitialized_why.clear();
              FS_LOG(INFO) << "group=" << caller.group << " rank=" << caller.rank
                           << " module=" << Display(module)
                           << " initialised (generation 0): every local rank's init End applied";
            } else {
              answer = absl::FailedPreconditionError(
                  absl::StrCat("summon ", summon, ": module ", Display(module),
                               ": its initial values did not commit on every rank of this daemon (",
                               verdict.message(), "); register it again on every rank"));
            }
          }
        }
        modules.FinishEnd(caller, summon, std::move(answer), std::move(done));
      });
}

void internal::TestingPauseInit(const char* point) {
  static const std::pair<std::string, absl::Duration> pause = [] {
    const std::string v = absl::GetFlag(FLAGS_testing_pause_init);
    const size_t colon = v.find(':');
    absl::Duration d;
    const std::string at = v.substr(0, colon);
    if (colon == std::string::npos ||
        (at != "register_before_record" && at != "end_before_intent") ||
        !absl::ParseDuration(v.substr(colon + 1), &d)) {
      if (!v.empty()) FS_LOG(ERROR) << "--testing_pause_init=" << v << " ignored";
      return std::make_pair(std::string(), absl::ZeroDuration());
    }
    return std::make_pair(at, d);
  }();
  if (pause.first != point) return;
  FS_LOG(WARNING) << "testing: initialisation paused at " << point << " for "
                  << absl::FormatDuration(pause.second);
  absl::SleepFor(pause.second);
}

void Modules::UndoInitLocked(Group& g, const std::string& module, const std::string& why,
                             AfterUnlock* run) {
  auto it = g.registered.find(module);
  if (it == g.registered.end()) return;
  Registered& reg = it->second;
  const bool was = internal::InitHeld(reg);
  reg.initialized = false;
  reg.uninitialized_why = why;
  // Copies of an init End under way (never expected: its ranks re-join once it answered)
  // finish into nothing: that End fails (FinishAppliedEnd).
  reg.init_undone = reg.busy > 0;
  if (reg.busy == 0) reg.pending_commit.reset();
  reg.generation.assign(reg.generation.size(), 0);
  reg.voted.clear();
  reg.voted_commit = 0;
  reg.resolved_generation.reset();
  // Its record goes (an uninitialised module is not kept), so a restart does not adopt it.
  records_.PersistModuleLater(g, module, run);
  FS_LOG(WARNING) << "group=" << g.id << " module=" << Display(module)
                  << (was ? " not initialised any more: " : " stays not initialised: ") << why
                  << " (every rank registers it again)";
}

}  // namespace flatshard::server
