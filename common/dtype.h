#pragma once
// DType lives in the client library's public header (it is part of the client API); the
// daemon, the planner and the CLI include it from here. Implemented in common/dtype.cc.
#include "client/include/flatshard/dtype.h"  // IWYU pragma: export
