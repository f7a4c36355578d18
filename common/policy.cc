#include "common/policy.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/status_macros.h"

namespace flatshard {
namespace {

constexpr std::array<std::pair<AutoWrapKind, absl::string_view>, 6> kKinds = {{
    {AutoWrapKind::kNone, "none"},
    {AutoWrapKind::kAlways, "always"},
    {AutoWrapKind::kSizeBased, "size_based"},
    {AutoWrapKind::kModuleTypes, "module_types"},
    {AutoWrapKind::kExplicit, "explicit"},
    {AutoWrapKind::kAny, "any"},
}};

constexpr std::array<std::pair<ShardingStrategy, absl::string_view>, 5> kStrategies = {{
    {ShardingStrategy::kFullShard, "FULL_SHARD"},
    {ShardingStrategy::kShardGradOp, "SHARD_GRAD_OP"},
    {ShardingStrategy::kNoShard, "NO_SHARD"},
    {ShardingStrategy::kHybridShard, "HYBRID_SHARD"},
    {ShardingStrategy::kHybridShardZero2, "_HYBRID_SHARD_ZERO2"},
}};

absl::StatusOr<AutoWrapPolicy> ParseAutoWrap(const Json& v, const JsonPath& path) {
  if (!v.is_object()) return path.Error("must be an object with a \"kind\"");
  FS_ASSIGN_OR_RETURN(std::string kind_name, GetString(v, "kind", path));
  auto kind = ParseAutoWrapKind(kind_name);
  if (!kind) {
    return path.Key("kind").Error(
        absl::StrCat("unknown auto_wrap kind ", Quote(kind_name),
                     " (one of none, always, size_based, module_types, explicit, any)"));
  }
  AutoWrapPolicy p;
  p.kind = *kind;
  switch (p.kind) {
    case AutoWrapKind::kNone:
    case AutoWrapKind::kAlways:
      FS_RETURN_IF_ERROR(ExpectObject(v, path, {"kind"}));
      break;
    case AutoWrapKind::kSizeBased:
      FS_RETURN_IF_ERROR(ExpectObject(
          v, path, {"kind", "min_num_params", "force_leaf_types", "exclude_wrap_types"}));
      FS_RETURN_IF_ERROR(GetOptionalInt(v, "min_num_params", path, 0,
                                        std::numeric_limits<int64_t>::max(), &p.min_num_params));
      FS_RETURN_IF_ERROR(GetOptionalStringList(v, "force_leaf_types", path, &p.force_leaf_types));
      FS_RETURN_IF_ERROR(
          GetOptionalStringList(v, "exclude_wrap_types", path, &p.exclude_wrap_types));
      break;
    case AutoWrapKind::kModuleTypes:
      FS_RETURN_IF_ERROR(ExpectObject(v, path, {"kind", "types"}));
      if (!v.contains("types")) return path.Error("missing required key \"types\"");
      FS_RETURN_IF_ERROR(GetOptionalStringList(v, "types", path, &p.types));
      break;
    case AutoWrapKind::kExplicit:
      FS_RETURN_IF_ERROR(ExpectObject(v, path, {"kind", "paths"}));
      if (!v.contains("paths")) return path.Error("missing required key \"paths\"");
      FS_RETURN_IF_ERROR(GetOptionalStringList(v, "paths", path, &p.paths));
      break;
    case AutoWrapKind::kAny: {
      FS_RETURN_IF_ERROR(ExpectObject(v, path, {"kind", "policies"}));
      auto it = v.find("policies");
      if (it == v.end()) return path.Error("missing required key \"policies\"");
      JsonPath list_path = path.Key("policies");
      FS_RETURN_IF_ERROR(ExpectArray(*it, list_path));
      if (it->empty()) return list_path.Error("must list at least one policy");
      for (size_t i = 0; i < it->size(); ++i) {
        FS_ASSIGN_OR_RETURN(AutoWrapPolicy member, ParseAutoWrap((*it)[i], list_path.Index(i)));
        p.policies.push_back(std::move(member));
      }
      break;
    }
  }
  return p;
}

absl::StatusOr<std::optional<DType>> ParseFloatDType(const Json& obj, absl::string_view key,
                                                     const JsonPath& path) {
  if (!obj.contains(key)) return std::nullopt;
  FS_ASSIGN_OR_RETURN(std::string name, GetString(obj, key, path));
  auto dtype = ParseDType(name);
  if (!dtype || !IsFloatingPoint(*dtype)) {
    return path.Key(key).Error(absl::StrCat("unknown floating dtype ", Quote(name),
                                            " (one of float32 float16 bfloat16 float64)"));
  }
  return dtype;
}

Json AutoWrapToJson(const AutoWrapPolicy& p) {
  Json j = {{"kind", std::string(AutoWrapKindName(p.kind))}};
  switch (p.kind) {
    case AutoWrapKind::kNone:
    case AutoWrapKind::kAlways:
      break;
    case AutoWrapKind::kSizeBased:
      j["min_num_params"] = p.min_num_params;
      j["force_leaf_types"] = p.force_leaf_types;
      j["exclude_wrap_types"] = p.exclude_wrap_types;
      break;
    case AutoWrapKind::kModuleTypes:
      j["types"] = p.types;
      break;
    case AutoWrapKind::kExplicit:
      j["paths"] = p.paths;
      break;
    case AutoWrapKind::kAny: {
      Json list = Json::array();
      for (const AutoWrapPolicy& m : p.policies) list.push_back(AutoWrapToJson(m));
      j["policies"] = std::move(list);
      break;
    }
  }
  return j;
}

}  // namespace

absl::string_view AutoWrapKindName(AutoWrapKind kind) {
  for (const auto& [k, name] : kKinds) {
    if (k == kind) return name;
  }
  return "?";
}

std::optional<AutoWrapKind> ParseAutoWrapKind(absl::string_view name) {
  for (const auto& [k, n] : kKinds) {
    if (n == name) return k;
  }
  return std::nullopt;
}

absl::string_view ShardingStrategyName(ShardingStrategy strategy) {
  for (const auto& [s, name] : kStrategies) {
    if (s == strategy) return name;
  }
  return "?";
}

std::optional<ShardingStrategy> ParseShardingStrategy(absl::string_view name) {
  for (const auto& [s, n] : kStrategies) {
    if (n == name) return s;
  }
  return std::nullopt;
}

absl::StatusOr<Policy> PolicyFromJsonValue(const Json& doc) {
  JsonPath path("policy");
  FS_RETURN_IF_ERROR(ExpectObject(doc, path,
                                  {"format", "auto_wrap", "ignored_modules", "ignored_params",
                                   "use_orig_params", "sharding_strategy", "mixed_precision"}));
  std::string format(kPolicyFormat);
  FS_RETURN_IF_ERROR(GetOptionalString(doc, "format", path, &format));
  if (format != kPolicyFormat) {
    return path.Key("format").Error(
        absl::StrCat("unknown format ", Quote(format), ", expected ", Quote(kPolicyFormat)));
  }
  Policy policy;
  if (auto it = doc.find("auto_wrap"); it != doc.end()) {
    FS_ASSIGN_OR_RETURN(policy.auto_wrap, ParseAutoWrap(*it, path.Key("auto_wrap")));
  }
  FS_RETURN_IF_ERROR(GetOptionalStringList(doc, "ignored_modules", path, &policy.ignored_modules));
  FS_RETURN_IF_ERROR(GetOptionalStringList(doc, "ignored_params", path, &policy.ignored_params));
  FS_RETURN_IF_ERROR(GetOptionalBool(doc, "use_orig_params", path, &policy.use_orig_params));
  std::string strategy(ShardingStrategyName(policy.sharding_strategy));
  FS_RETURN_IF_ERROR(GetOptionalString(doc, "sharding_strategy", path, &strategy));
  auto parsed = ParseShardingStrategy(strategy);
  if (!parsed) {
    return path.Key("sharding_strategy")
        .Error(absl::StrCat("unknown sharding strategy ", Quote(strategy),
                            " (one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                            "_HYBRID_SHARD_ZERO2)"));
  }
  policy.sharding_strategy = *parsed;
  if (auto it = doc.find("mixed_precision"); it != doc.end() && !it->is_null()) {
    JsonPath mp_path = path.Key("mixed_precision");
    FS_RETURN_IF_ERROR(ExpectObject(
        *it, mp_path, {"param_dtype", "reduce_dtype", "buffer_dtype", "module_types_to_ignore"}));
    MixedPrecision mp;
    FS_ASSIGN_OR_RETURN(mp.param_dtype, ParseFloatDType(*it, "param_dtype", mp_path));
    FS_ASSIGN_OR_RETURN(mp.reduce_dtype, ParseFloatDType(*it, "reduce_dtype", mp_path));
    FS_ASSIGN_OR_RETURN(mp.buffer_dtype, ParseFloatDType(*it, "buffer_dtype", mp_path));
    FS_RETURN_IF_ERROR(
        GetOptionalStringList(*it, "module_types_to_ignore", mp_path, &mp.module_types_to_ignore));
    policy.mixed_precision = std::move(mp);
  }
  return policy;
}

absl::StatusOr<Policy> PolicyFromJson(absl::string_view text) {
  FS_RETURN_IF_ERROR(CheckLength("policy", "the JSON text", text, kMaxPolicyJsonBytes));
  FS_ASSIGN_OR_RETURN(Json doc, ParseJson(text, "policy"));
  return PolicyFromJsonValue(doc);
}

Json PolicyToJson(const Policy& policy) {
  Json j = {{"format", std::string(kPolicyFormat)},
            {"auto_wrap", AutoWrapToJson(policy.auto_wrap)},
            {"ignored_modules", policy.ignored_modules},
            {"ignored_params", policy.ignored_params},
            {"use_orig_params", policy.use_orig_params},
            {"sharding_strategy", std::string(ShardingStrategyName(policy.sharding_strategy))}};
  if (policy.mixed_precision) {
    const MixedPrecision& mp = *policy.mixed_precision;
    Json m = {{"module_types_to_ignore", mp.module_types_to_ignore}};
    if (mp.param_dtype) m["param_dtype"] = std::string(DTypeName(*mp.param_dtype));
    if (mp.reduce_dtype) m["reduce_dtype"] = std::string(DTypeName(*mp.reduce_dtype));
    if (mp.buffer_dtype) m["buffer_dtype"] = std::string(DTypeName(*mp.buffer_dtype));
    j["mixed_precision"] = std::move(m);
  }
  return j;
}

}  // namespace flatshard
