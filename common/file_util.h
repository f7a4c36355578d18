#pragma once
// Reading a whole (small) file: manifests, policies, PEM certificates. Callers put the error in
// their own words (the flag or document it came from). Thread-safe.

#include <string>

#include "absl/status/statusor.h"

namespace flatshard {

// The file's bytes. On failure INVALID_ARGUMENT whose message is only the reason
// ("No such file or directory"), for the caller to prefix with what the file was.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace flatshard
