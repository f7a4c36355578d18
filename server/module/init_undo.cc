// Modules: a daemon killed during a module's initialisation (no module lost to a single
// daemon kill, README "Restarts"). A registration, and the End of an init summon, commit on
// each daemon once every rank agreed; a daemon killed before its record comes back without the
// module while the others hold it at generation 0 (or one comes back initialised while another
// daemon's init never completed). No step was trained on it yet and the trainers hold its
// initial values, so the re-form undoes the initialisation on every daemon
// (internal::InitUndoneEverywhere) and every rank's next Register runs it again, instead of
// dropping the module as lost.

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
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

ABSL_FLAG(std::string, testing_pause_init, "",
          "Testing only: \"POINT:DURATION\" pauses this daemon for DURATION inside every "
          "initialisation at POINT: register_before_record (every rank agreed to a "
          "registration, this daemon has not recorded it) or end_before_intent (every rank "
          "agreed to an init End, this daemon has not recorded it).");

ABSL_FLAG(int, testing_init_end_fails, -1,
          "Testing only: the first init End of rank R on this daemon fails as if the "
          "agreement's all-gather had failed on that rank alone (as when a peer daemon dies "
          "mid-collective), although every rank agreed and the others apply. -1: never.");

namespace flatshard::server {

using internal::Display;

bool internal::TestingInitAgreementFails(int32_t rank) {
  static std::atomic<bool> fired{false};
  if (rank != absl::GetFlag(FLAGS_testing_init_end_fails)) return false;
  return !fired.exchange(true);
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
