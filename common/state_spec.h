#pragma once
// Optimizer state specs (ShardService.RegisterState): the named state buffers the daemon keeps
// next to each shard of a registered module, per rank and unit. One definition for the daemon
// and the client library (whose public header keeps its own identically shaped
// client::StateSpec, bridged in client.cc). Header-only, C++17, thread-compatible values.
//
// A spec is (name, dtype, shape). SHARD: as many elements as the rank's padded shard of the
// unit (element-wise state: exp_avg, exp_avg_sq, momentum_buffer); SCALAR: one element per
// unit and rank (Adam's `step`). Names are non-empty, at most kMaxStateNameBytes, of letters,
// digits, '_' and '.', unique within a spec list.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace flatshard {

enum class StateShape : uint8_t {
  kShard,   // shard_numel elements of the unit's shard
  kScalar,  // one element
};

inline const char* StateShapeName(StateShape s) {
  return s == StateShape::kShard ? "shard" : "scalar";
}

struct StateSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  StateShape shape = StateShape::kShard;

  bool operator==(const StateSpec& o) const {
    return name == o.name && dtype == o.dtype && shape == o.shape;
  }
  bool operator!=(const StateSpec& o) const { return !(*this == o); }
  // Elements of the buffer for a unit whose shard has `shard_numel` elements.
  int64_t Numel(int64_t shard_numel) const { return shape == StateShape::kShard ? shard_numel : 1; }
};

// State names are short identifiers; longer ones are refused (README "Limits").
inline constexpr size_t kMaxStateNameBytes = 128;
// State buffers per unit and rank.
inline constexpr size_t kMaxStatesPerModule = 64;

// INVALID_ARGUMENT naming the first bad field ("specs[1].name: ..."); OK otherwise.
inline absl::Status ValidateStateSpecs(const std::vector<StateSpec>& specs) {
  if (specs.empty()) return absl::InvalidArgumentError("specs: at least one state is required");
  if (specs.size() > kMaxStatesPerModule) {
    return absl::InvalidArgumentError(
        absl::StrCat("specs: ", specs.size(), " states, at most ", kMaxStatesPerModule));
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string& name = specs[i].name;
    const std::string field = absl::StrCat("specs[", i, "].name");
    if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty"));
    if (name.size() > kMaxStateNameBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", name.size(), " bytes, at most ", kMaxStateNameBytes));
    }
    for (char c : name) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '_' || c == '.';
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": \"", name, "\" has a character other than letters, digits, '_' and '.'"));
      }
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": \"", name, "\" appears twice"));
    }
  }
  return absl::OkStatus();
}

// Why `got` is not the spec `fixed` (empty when equal): names the first differing state and
// field, e.g. "state \"exp_avg\": dtype float16, the module's is float32".
inline std::string StateSpecDifference(const std::vector<StateSpec>& fixed,
                                       const std::vector<StateSpec>& got) {
  for (size_t i = 0; i < fixed.size() && i < got.size(); ++i) {
    const StateSpec& a = fixed[i];
    const StateSpec& b = got[i];
    if (a.name != b.name) {
      return absl::StrCat("specs[", i, "].name: \"", b.name, "\", the module's state ", i, " is \"",
                          a.name, "\"");
    }
    if (a.dtype != b.dtype) {
      return absl::StrCat("state \"", a.name, "\": dtype ", DTypeName(b.dtype),
                          ", the module's is ", DTypeName(a.dtype));
    }
    if (a.shape != b.shape) {
      return absl::StrCat("state \"", a.name, "\": shape ", StateShapeName(b.shape),
                          ", the module's is ", StateShapeName(a.shape));
    }
  }
  if (fixed.size() != got.size()) {
    const bool more = got.size() > fixed.size();
    return absl::StrCat(got.size(), " states, the module has ", fixed.size(), " (",
                        more ? "extra" : "missing", " state \"",
                        more ? got[fixed.size()].name : fixed[got.size()].name, "\")");
  }
  return "";
}

}  // namespace flatshard
