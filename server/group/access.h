#pragma once
// Access control of a group (README "Access control"): who may use it and how its join token
// is compared. Used by every owner that answers a caller for a group.

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace flatshard::server::internal {

// Token comparison that takes the same time wherever the first difference is.
inline bool TokensEqual(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

// Access control (README "Access control"): a group answers only callers of the uid that
// created it; remote (TCP) callers have uid -1 and share the groups created over TCP.
template <typename G>
inline absl::Status CheckUid(const G& g, int64_t uid) {
  if (uid == g.owner_uid) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("group ", g.id, ": uid ", uid < 0 ? std::string("(remote)") : absl::StrCat(uid),
                   " is not admitted (the group belongs to uid ",
                   g.owner_uid < 0 ? std::string("(remote)") : absl::StrCat(g.owner_uid), ")"));
}

}  // namespace flatshard::server::internal
