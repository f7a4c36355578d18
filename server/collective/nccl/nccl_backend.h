#pragma once
// TEMPORARY STUB (not committed)
#include <string>
#include "absl/status/statusor.h"
namespace flatshard::collective { absl::StatusOr<std::string> MakeNcclUniqueId(); }
