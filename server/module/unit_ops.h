#pragma once
// Helpers of the module owner's unit operations (server/module/): which units a path selects,
// the collective views of a unit's buffers, and the record each rank contributes to a writeback
// End's or a Commit's agreement.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/plan.h"
#include "common/rpc_types.h"
#include "server/collective/collective_engine.h"
#include "server/shard_store.h"

namespace flatshard::server::internal {

inline std::string UnitSummary(const PlanUnit& u) {
  return absl::StrCat("\"", u.module, "\" (", u.module_type, ", ", u.params.size(), " params, ",
                      u.numel, " elements, ", DTypeName(u.dtype), ")");
}

// True when registering `b` would nest FSDP units inside those of `a` or the other way round.
inline bool Nested(const std::string& a, const std::string& b) {
  auto inside = [](const std::string& outer, const std::string& inner) {
    return outer.empty() ||
           (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
            inner[outer.size()] == '.');
  };
  return inside(a, b) || inside(b, a);
}

// Units of `plan` whose module is `path` (recurse=false) or in its subtree (recurse=true).
inline std::vector<int32_t> SelectUnits(const Plan& plan, const std::string& path, bool recurse) {
  std::vector<int32_t> units;
  for (const PlanUnit& u : plan.units) {
    const bool exact = u.module == path;
    const bool below = path.empty() || (u.module.size() > path.size() &&
                                        u.module.compare(0, path.size(), path) == 0 &&
                                        u.module[path.size()] == '.');
    if (exact || (recurse && below)) units.push_back(u.index);
  }
  return units;
}

// Whether a summon with `options` hands `unit` out in its compute dtype, cast by the daemon.
inline bool CastsForCompute(const SummonOptions& options, const PlanUnit& unit) {
  return options.compute_precision && unit.ComputeDType() != unit.dtype;
}

inline collective::ConstBuffer ConstOf(const Buffer& b, DType dtype) {
  return b.view(dtype).AsConst();
}
inline collective::MutableBuffer MutableOf(const Buffer* b, DType dtype) {
  if (b == nullptr) return collective::MutableBuffer{nullptr, 0, dtype};
  return b->view(dtype);
}

inline void CopyText(absl::string_view text, char* out, size_t size) {
  std::memset(out, 0, size);
  std::memcpy(out, text.data(), std::min(text.size(), size - 1));
}
inline std::string TextOf(const char* text, size_t size) {
  return std::string(text, strnlen(text, size));
}

// The "unit" of the agreement all-gathers (in the collective's fingerprint, so a rank that
// ends a summon while another commits fails with a mismatch instead of agreeing).
inline constexpr int64_t kEndAgreeUnit = -2;
inline constexpr int64_t kCommitAgreeUnit = -3;
inline constexpr int64_t kEndVoteAgreeUnit = -4;  // a writeback End's votes (end_vote.cc)
// The payload Modules::Agree puts on a refusal (a verdict every rank got alike), which a
// failed all-gather lacks (its outcome may differ between ranks).
inline constexpr char kAgreeRefusedPayload[] = "flatshard.agree/refused";

// Failed writeback Ends remembered per group for repeated Ends.
inline constexpr size_t kFailedEndsKept = 256;

// What each rank contributes to a writeback End's or a Commit's agreement (an all-gather):
// every rank reaches the same verdict from the same records, so all apply or none.
struct AgreeRecord {
  uint8_t ok;     // 1: this rank can apply
  uint8_t stale;  // 1: refused because the rank's views predate a rollback
  uint8_t reserved[6];
  uint64_t generation;  // the rank's committed generation
  char text[240];       // why not; NUL-padded, truncated
};
static_assert(sizeof(AgreeRecord) == 256);

inline constexpr char kAlreadyUnsharding[] =
    "Cannot manually unshard parameters when already unsharding parameters";

}  // namespace flatshard::server::internal
