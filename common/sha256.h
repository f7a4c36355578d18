#pragma once
// SHA-256 (FIPS 180-4), for stable fingerprints of plans and checksums; computed by OpenSSL's
// libcrypto. Thread-safe: pure function.

#include <string>
#include "absl/strings/string_view.h"

namespace flatshard {

// Lower-case hex digest of `data` (64 characters).
std::string Sha256Hex(absl::string_view data);

}  // namespace flatshard
