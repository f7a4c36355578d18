#include "common/plan_reader.h"

#include <cstdint>
#include <limits>
#include <utility>

#include "common/json_scanner.h"

namespace flatshard {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Every `false` means "not read here": ScanPlan returns nullopt. The fields' rules are those of
// PlanFromJsonValue's (plan.cc), checked in document order.
class PlanScanner {
 public:
  explicit PlanScanner(absl::string_view text) : in_(text) {}

  std::optional<ScannedPlan> Scan() {
    uint32_t seen = 0;
    Plan& plan = out_.plan;
    bool ok = in_.Object([&](absl::string_view key) {
      if (key == "format") {
        absl::string_view format;
        return Once(&seen, 0) && in_.String(&format) && format == kPlanFormat;
      }
      if (key == "world_size") {
        int64_t v = 0;
        if (!Once(&seen, 1) || !in_.Int(1, INT32_MAX, &v)) return false;
        plan.world_size = static_cast<int32_t>(v);
        return true;
      }
      if (key == "sharding_strategy") {
        absl::string_view v;
        if (!Once(&seen, 2) || !in_.String(&v)) return false;
        out_.sharding_strategy = std::string(v);
        return true;
      }
      if (key == "shard_world_size") {
        int64_t v = 0;
        if (!Once(&seen, 3) || !in_.Int(&v)) return false;
        out_.shard_world_size = v;
        return true;
      }
      if (key == "use_orig_params") return Once(&seen, 4) && in_.Bool(&plan.use_orig_params);
      if (key == "units") {
        return Once(&seen, 5) && in_.Array([&] { return ReadUnit(); });
      }
      if (key == "ignored_params") return Once(&seen, 6) && ReadStrings(&plan.ignored_params);
      if (key == "warnings") return Once(&seen, 7) && ReadStrings(&plan.warnings);
      if (key == "fingerprint") return Once(&seen, 8) && ReadString(&plan.fingerprint);
      return false;
    });
    constexpr uint32_t kRequired = (1u << 0) | (1u << 1) | (1u << 5) | (1u << 8);
    if (!ok || (seen & kRequired) != kRequired || !in_.AtEnd()) return std::nullopt;
    return std::move(out_);
  }

 private:
  static bool Once(uint32_t* seen, int bit) { return JsonScanner::Once(seen, bit); }

  bool ReadString(std::string* out) {
    absl::string_view v;
    if (!in_.String(&v)) return false;
    *out = std::string(v);
    return true;
  }
  bool ReadStrings(std::vector<std::string>* out) {
    out->clear();
    return in_.Array([&] {
      out->emplace_back();
      return ReadString(&out->back());
    });
  }
  bool ReadFloatingDType(DType* out) {
    absl::string_view name;
    if (!in_.String(&name)) return false;
    std::optional<DType> d = ParseDType(name);
    if (!d || !IsFloatingPoint(*d)) return false;
    *out = *d;
    return true;
  }

  bool ReadUnit() {
    PlanUnit u;
    uint32_t seen = 0;
    bool ok = in_.Object([&](absl::string_view key) {
      if (key == "index") {
        int64_t v = 0;
        if (!Once(&seen, 0) || !in_.Int(0, INT32_MAX, &v)) return false;
        u.index = static_cast<int32_t>(v);
        return true;
      }
      if (key == "module") return Once(&seen, 1) && ReadString(&u.module);
      if (key == "module_type") return Once(&seen, 2) && ReadString(&u.module_type);
      if (key == "dtype") return Once(&seen, 3) && ReadFloatingDType(&u.dtype);
      if (key == "compute_dtype") {
        DType d;
        if (!Once(&seen, 4) || !ReadFloatingDType(&d)) return false;
        u.compute_dtype = d;
        return true;
      }
      if (key == "reduce_dtype") {
        DType d;
        if (!Once(&seen, 5) || !ReadFloatingDType(&d)) return false;
        u.reduce_dtype = d;
        return true;
      }
      if (key == "requires_grad") return Once(&seen, 6) && in_.Bool(&u.requires_grad);
      if (key == "params") {
        return Once(&seen, 7) && in_.Array([&] { return ReadParam(&u); });
      }
      if (key == "shared") {
        return Once(&seen, 8) && in_.Array([&] { return ReadShared(&u); });
      }
      if (key == "numel") return Once(&seen, 9) && in_.Int(0, kMax, &u.numel);
      if (key == "padded_numel") return Once(&seen, 10) && in_.Int(0, kMax, &u.padded_numel);
      if (key == "shard_numel") return Once(&seen, 11) && in_.Int(0, kMax, &u.shard_numel);
      return false;
    });
    // Everything but compute_dtype, reduce_dtype and shared is required.
    constexpr uint32_t kRequired = 0b111011001111;
    if (!ok || (seen & kRequired) != kRequired) return false;
    out_.plan.units.push_back(std::move(u));
    return true;
  }

  bool ReadParam(PlanUnit* u) {
    PlanParam p;
    uint32_t seen = 0;
    bool ok = in_.Object([&](absl::string_view key) {
      if (key == "fqn") return Once(&seen, 0) && ReadString(&p.fqn);
      if (key == "shape") {
        return Once(&seen, 1) && in_.Array([&] {
          int64_t d = 0;
          if (!in_.Int(0, kMax, &d)) return false;
          p.shape.push_back(d);
          return true;
        });
      }
      if (key == "numel") return Once(&seen, 2) && in_.Int(0, kMax, &p.numel);
      if (key == "offset") return Once(&seen, 3) && in_.Int(0, kMax, &p.offset);
      return false;
    });
    if (!ok || seen != 0b1111) return false;
    u->params.push_back(std::move(p));
    return true;
  }

  bool ReadShared(PlanUnit* u) {
    SharedParam s;
    uint32_t seen = 0;
    bool ok = in_.Object([&](absl::string_view key) {
      if (key == "fqn") return Once(&seen, 0) && ReadString(&s.fqn);
      if (key == "same_as") return Once(&seen, 1) && ReadString(&s.same_as);
      return false;
    });
    if (!ok || seen != 0b11) return false;
    u->shared.push_back(std::move(s));
    return true;
  }

  JsonScanner in_;
  ScannedPlan out_;
};

}  // namespace

std::optional<ScannedPlan> ScanPlan(absl::string_view text) {
  if (text.size() > kMaxJsonBytes) return std::nullopt;
  return PlanScanner(text).Scan();
}

}  // namespace flatshard
