#pragma once
// A module's initialisation across local ranks and daemons (init_undo.cc): decided once per
// daemon for all its local ranks (Modules::WritebackEnd::SettleInit); what a daemon killed
// during it leaves is undone on every daemon at the re-form (Modules::UndoInitLocked); and the
// testing kill and failure points inside it.

#include <cstdint>

#include "absl/time/time.h"

namespace flatshard::server::internal {

// --testing_pause_init=POINT:DURATION: sleeps (on the group's durable worker) when it names
// `point`: "register_before_record" (every rank agreed to a registration, this daemon has not
// recorded it) or "end_before_intent" (every rank agreed to the init End, this daemon has not
// recorded its init intent).
void TestingPauseInit(const char* point);

// --testing_init_end_fails=R: true once, for the first init End of rank `rank` == R on this
// daemon whose agreement passed: it then fails as if its all-gather had failed on it alone.
bool TestingInitAgreementFails(int32_t rank);

// --testing_pause_register_install=R:DURATION: how long the registration of local rank R
// waits, once every rank agreed, before this daemon installs it (the other local ranks
// install and answer meanwhile); zero for any other rank, or without the flag.
absl::Duration TestingRegisterInstallPause(int32_t rank);

}  // namespace flatshard::server::internal
