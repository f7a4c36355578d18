#pragma once
// Message helpers every owner of the daemon core uses: how a module path, a caller-given name
// and a list of ranks appear in error texts (bounded, so a message about a huge group or a
// hostile name stays small).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/limits.h"

namespace flatshard::server::internal {

// "ranks 1, 2, 5" or "ranks 1, 2, ... (1048575 ranks)": at most `limit` of them named, so a
// message about a huge group stays small.
inline std::string RankListText(const std::vector<int32_t>& ranks, size_t limit = 16) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < limit; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > limit) absl::StrAppend(&out, ", ... (", ranks.size(), " ranks)");
  return out;
}

// At most 64 characters of a caller-given name, for messages.
inline std::string Short(const std::string& name) {
  return name.size() <= 64 ? name : absl::StrCat(name.substr(0, 61), "...");
}

// A module path as error texts quote it: at most kMaxQuotedBytes of it (README "Limits").
inline std::string Display(const std::string& module) {
  return module.empty() ? std::string("\"\" (the root)")
                        : absl::StrCat("\"", Truncated(module), "\"");
}

}  // namespace flatshard::server::internal
