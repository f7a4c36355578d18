#pragma once
// A module's initialisation across daemons (init_undo.cc): what a daemon killed during it
// leaves is undone on every daemon at the re-form (Modules::UndoInitLocked), and the testing
// kill points inside it.

namespace flatshard::server::internal {

// --testing_pause_init=POINT:DURATION: sleeps (on the group's durable worker) when it names
// `point`: "register_before_record" (every rank agreed to a registration, this daemon has not
// recorded it) or "end_before_intent" (every rank agreed to the init End, this daemon has not
// recorded its init intent).
void TestingPauseInit(const char* point);

}  // namespace flatshard::server::internal
