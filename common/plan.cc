#include "common/plan.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/plan_reader.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace flatshard {

int32_t Plan::ShardRank(int32_t rank) const {
  FS_CHECK(rank >= 0 && rank < world_size) << "rank " << rank << " of " << world_size;
  // HYBRID_SHARD shards over consecutive ranks of one node and replicates across nodes.
  return rank % shard_world_size;
}

absl::StatusOr<FlatLayout> UnitLayout(const Plan& plan, const PlanUnit& unit) {
  std::vector<int64_t> numels;
  numels.reserve(unit.params.size());
  for (const PlanParam& p : unit.params) numels.push_back(p.numel);
  FlatLayoutOptions options;
  options.dtype = unit.dtype;
  options.align = plan.use_orig_params;
  options.shard_world_size = plan.shard_world_size;
  options.pad_world_size = plan.sharding_strategy == ShardingStrategy::kNoShard
                               ? plan.world_size
                               : plan.shard_world_size;
  return FlatLayout::Create(numels, options);
}

namespace {

// Byte totals saturate at INT64_MAX: a plan that large is refused by any daemon anyway.
int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t out;
  return __builtin_add_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}
int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t out;
  return __builtin_mul_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}

}  // namespace

PlanMemory SummarizeMemory(const Plan& plan) {
  PlanMemory m;
  for (const PlanUnit& u : plan.units) {
    m.shard_bytes = SaturatingAdd(m.shard_bytes, SaturatingMul(u.shard_numel, ItemSize(u.dtype)));
    m.unsharded_bytes =
        SaturatingAdd(m.unsharded_bytes, SaturatingMul(u.padded_numel, ItemSize(u.dtype)));
  }
  m.peak_summon_bytes = m.shard_bytes;
  if (plan.sharding_strategy != ShardingStrategy::kNoShard) {
    m.peak_summon_bytes = SaturatingAdd(m.peak_summon_bytes, m.unsharded_bytes);
  }
  return m;
}

namespace {

// Appends one field, length-prefixed so that no content can imitate a field boundary.
void Field(std::string* out, absl::string_view s) { absl::StrAppend(out, s.size(), ":", s, ";"); }
void Field(std::string* out, int64_t v) { absl::StrAppend(out, v, ";"); }

}  // namespace

std::string Fingerprint(const Plan& plan) {
  std::string text;
  Field(&text, kPlanFormat);
  Field(&text, plan.world_size);
  Field(&text, ShardingStrategyName(plan.sharding_strategy));
  Field(&text, plan.shard_world_size);
  Field(&text, plan.use_orig_params ? 1 : 0);
  Field(&text, static_cast<int64_t>(plan.units.size()));
  for (const PlanUnit& u : plan.units) {
    Field(&text, u.index);
    Field(&text, u.module);
    Field(&text, u.module_type);
    Field(&text, DTypeName(u.dtype));
    // Only when set, so that plans without mixed precision keep their fingerprints.
    if (u.compute_dtype) Field(&text, absl::StrCat("compute_dtype=", DTypeName(*u.compute_dtype)));
    if (u.reduce_dtype) Field(&text, absl::StrCat("reduce_dtype=", DTypeName(*u.reduce_dtype)));
    Field(&text, u.requires_grad ? 1 : 0);
    Field(&text, u.numel);
    Field(&text, u.padded_numel);
    Field(&text, u.shard_numel);
    Field(&text, static_cast<int64_t>(u.params.size()));
    for (const PlanParam& p : u.params) {
      Field(&text, p.fqn);
      Field(&text, static_cast<int64_t>(p.shape.size()));
      for (int64_t d : p.shape) Field(&text, d);
      Field(&text, p.numel);
      Field(&text, p.offset);
    }
    Field(&text, static_cast<int64_t>(u.shared.size()));
    for (const SharedParam& s : u.shared) {
      Field(&text, s.fqn);
      Field(&text, s.same_as);
    }
  }
  Field(&text, static_cast<int64_t>(plan.ignored_params.size()));
  for (const std::string& fqn : plan.ignored_params) Field(&text, fqn);
  return Sha256Hex(text);
}

nlohmann::ordered_json PlanToJson(const Plan& plan) {
  using OJson = nlohmann::ordered_json;
  OJson units = OJson::array();
  for (const PlanUnit& u : plan.units) {
    OJson params = OJson::array();
    for (const PlanParam& p : u.params) {
      params.push_back(
          {{"fqn", p.fqn}, {"shape", p.shape}, {"numel", p.numel}, {"offset", p.offset}});
    }
    OJson shared = OJson::array();
    for (const SharedParam& s : u.shared) {
      shared.push_back({{"fqn", s.fqn}, {"same_as", s.same_as}});
    }
    OJson unit = {{"index", u.index},
                  {"module", u.module},
                  {"module_type", u.module_type},
                  {"dtype", std::string(DTypeName(u.dtype))}};
    if (u.compute_dtype) unit["compute_dtype"] = std::string(DTypeName(*u.compute_dtype));
    if (u.reduce_dtype) unit["reduce_dtype"] = std::string(DTypeName(*u.reduce_dtype));
    unit["requires_grad"] = u.requires_grad;
    unit["params"] = std::move(params);
    unit["shared"] = std::move(shared);
    unit["numel"] = u.numel;
    unit["padded_numel"] = u.padded_numel;
    unit["shard_numel"] = u.shard_numel;
    units.push_back(std::move(unit));
  }
  return OJson{{"format", std::string(kPlanFormat)},
               {"world_size", plan.world_size},
               {"sharding_strategy", std::string(ShardingStrategyName(plan.sharding_strategy))},
               {"shard_world_size", plan.shard_world_size},
               {"use_orig_params", plan.use_orig_params},
               {"units", std::move(units)},
               {"ignored_params", plan.ignored_params},
               {"warnings", plan.warnings},
               {"fingerprint", plan.fingerprint}};
}

namespace {

// The product of `shape`, -1 when it overflows int64.
int64_t ShapeNumel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(numel, d, &numel)) return -1;
  }
  return numel;
}

absl::StatusOr<std::vector<int64_t>> GetShape(const Json& obj, const JsonPath& path) {
  auto it = obj.find("shape");
  if (it == obj.end()) return path.Error("missing required key \"shape\"");
  JsonPath shape_path = path.Key("shape");
  FS_RETURN_IF_ERROR(ExpectArray(*it, shape_path));
  std::vector<int64_t> shape;
  for (size_t i = 0; i < it->size(); ++i) {
    FS_ASSIGN_OR_RETURN(
        int64_t d, AsInt((*it)[i], shape_path.Index(i), 0, std::numeric_limits<int64_t>::max()));
    shape.push_back(d);
  }
  return shape;
}

absl::StatusOr<PlanUnit> ParseUnit(const Json& v, const JsonPath& path) {
  FS_RETURN_IF_ERROR(
      ExpectObject(v, path,
                   {"index", "module", "module_type", "dtype", "compute_dtype", "reduce_dtype",
                    "requires_grad", "params", "shared", "numel", "padded_numel", "shard_numel"}));
  PlanUnit u;
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  FS_ASSIGN_OR_RETURN(int64_t index, GetInt(v, "index", path, 0, INT32_MAX));
  u.index = static_cast<int32_t>(index);
  FS_ASSIGN_OR_RETURN(u.module, GetString(v, "module", path));
  FS_ASSIGN_OR_RETURN(u.module_type, GetString(v, "module_type", path));
  FS_ASSIGN_OR_RETURN(std::string dtype, GetString(v, "dtype", path));
  auto parsed = ParseDType(dtype);
  if (!parsed || !IsFloatingPoint(*parsed)) {
    return path.Key("dtype").Error(absl::StrCat("unknown floating dtype ", Quote(dtype)));
  }
  u.dtype = *parsed;
  for (const char* key : {"compute_dtype", "reduce_dtype"}) {
    if (!v.contains(key)) continue;
    FS_ASSIGN_OR_RETURN(std::string name, GetString(v, key, path));
    auto d = ParseDType(name);
    if (!d || !IsFloatingPoint(*d)) {
      return path.Key(key).Error(absl::StrCat("unknown floating dtype ", Quote(name)));
    }
    (std::string_view(key) == "compute_dtype" ? u.compute_dtype : u.reduce_dtype) = *d;
  }
  FS_ASSIGN_OR_RETURN(u.requires_grad, GetBool(v, "requires_grad", path));
  auto params = v.find("params");
  if (params == v.end()) return path.Error("missing required key \"params\"");
  FS_RETURN_IF_ERROR(ExpectArray(*params, path.Key("params")));
  const JsonPath params_path = path.Key("params");
  for (size_t i = 0; i < params->size(); ++i) {
    JsonPath ppath = params_path.Index(i);
    const Json& pj = (*params)[i];
    FS_RETURN_IF_ERROR(ExpectObject(pj, ppath, {"fqn", "shape", "numel", "offset"}));
    PlanParam p;
    FS_ASSIGN_OR_RETURN(p.fqn, GetString(pj, "fqn", ppath));
    FS_ASSIGN_OR_RETURN(p.shape, GetShape(pj, ppath));
    FS_ASSIGN_OR_RETURN(p.numel, GetInt(pj, "numel", ppath, 0, kMax));
    FS_ASSIGN_OR_RETURN(p.offset, GetInt(pj, "offset", ppath, 0, kMax));
    if (ShapeNumel(p.shape) != p.numel) {
      return ppath.Key("numel").Error(absl::StrCat("numel ", p.numel, " does not match shape [",
                                                   absl::StrJoin(p.shape, ", "), "]"));
    }
    u.params.push_back(std::move(p));
  }
  if (auto shared = v.find("shared"); shared != v.end()) {
    FS_RETURN_IF_ERROR(ExpectArray(*shared, path.Key("shared")));
    const JsonPath shared_path = path.Key("shared");
    for (size_t i = 0; i < shared->size(); ++i) {
      JsonPath spath = shared_path.Index(i);
      FS_RETURN_IF_ERROR(ExpectObject((*shared)[i], spath, {"fqn", "same_as"}));
      SharedParam s;
      FS_ASSIGN_OR_RETURN(s.fqn, GetString((*shared)[i], "fqn", spath));
      FS_ASSIGN_OR_RETURN(s.same_as, GetString((*shared)[i], "same_as", spath));
      u.shared.push_back(std::move(s));
    }
  }
  FS_ASSIGN_OR_RETURN(u.numel, GetInt(v, "numel", path, 0, kMax));
  FS_ASSIGN_OR_RETURN(u.padded_numel, GetInt(v, "padded_numel", path, 0, kMax));
  FS_ASSIGN_OR_RETURN(u.shard_numel, GetInt(v, "shard_numel", path, 0, kMax));
  return u;
}

// The shard world `strategy` allows (shard_world already in [1, world_size]).
absl::Status CheckShardWorld(ShardingStrategy strategy, int64_t world_size, int64_t shard_world,
                             const JsonPath& path) {
  switch (strategy) {
    case ShardingStrategy::kNoShard:
      if (shard_world != 1) {
        return path.Key("shard_world_size").Error("must be 1 for NO_SHARD");
      }
      break;
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardZero2:
      if (world_size % shard_world != 0) {
        return path.Key("shard_world_size")
            .Error(absl::StrCat(shard_world, " does not divide world_size ", world_size));
      }
      break;
    default:
      if (shard_world != world_size) {
        return path.Key("shard_world_size")
            .Error(absl::StrCat("must equal world_size ", world_size, " for ",
                                ShardingStrategyName(strategy)));
      }
  }
  return absl::OkStatus();
}

// Unit `i` of `plan` (its index, offsets and sizes) against the layout rules.
absl::Status CheckUnit(const Plan& plan, const PlanUnit& u, size_t i, const JsonPath& upath) {
  if (u.index != static_cast<int32_t>(i)) {
    return upath.Key("index").Error(absl::StrCat("must be ", i, ", got ", u.index));
  }
  absl::StatusOr<FlatLayout> made = UnitLayout(plan, u);
  if (!made.ok()) return upath.Error(made.status().message());
  const FlatLayout& layout = *made;
  for (size_t p = 0; p < u.params.size(); ++p) {
    if (u.params[p].offset != layout.offsets()[p]) {
      return upath.Key("params").Index(p).Key("offset").Error(
          absl::StrCat("offset ", u.params[p].offset, " does not match the layout rules (want ",
                       layout.offsets()[p], ")"));
    }
  }
  if (u.numel != layout.numel() || u.padded_numel != layout.padded_numel() ||
      u.shard_numel != layout.shard_numel()) {
    return upath.Error(absl::StrCat("numel/padded_numel/shard_numel ", u.numel, "/", u.padded_numel,
                                    "/", u.shard_numel, " do not match the layout rules (want ",
                                    layout.numel(), "/", layout.padded_numel(), "/",
                                    layout.shard_numel(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckFingerprint(const Plan& plan, const JsonPath& path) {
  if (std::string want = Fingerprint(plan); plan.fingerprint != want) {
    return path.Key("fingerprint")
        .Error(absl::StrCat("fingerprint ", Quote(plan.fingerprint),
                            " does not match the plan's content (", want, ")"));
  }
  return absl::OkStatus();
}

// The rules of PlanFromJsonValue that ScanPlan leaves (the fields together); any error means
// "give the document to the DOM path", which words it.
absl::Status CheckScannedPlan(ScannedPlan& scanned) {
  Plan& plan = scanned.plan;
  const JsonPath path("plan");
  std::optional<ShardingStrategy> strategy =
      ParseShardingStrategy(scanned.sharding_strategy.value_or(
          std::string(ShardingStrategyName(plan.sharding_strategy))));
  if (!strategy) return absl::InvalidArgumentError("sharding_strategy");
  plan.sharding_strategy = *strategy;
  const int64_t shard_world = scanned.shard_world_size.value_or(
      plan.sharding_strategy == ShardingStrategy::kNoShard ? 1 : plan.world_size);
  if (shard_world < 1 || shard_world > plan.world_size) {
    return absl::InvalidArgumentError("shard_world_size");
  }
  FS_RETURN_IF_ERROR(CheckShardWorld(plan.sharding_strategy, plan.world_size, shard_world, path));
  plan.shard_world_size = static_cast<int32_t>(shard_world);
  for (size_t i = 0; i < plan.units.size(); ++i) {
    for (const PlanParam& p : plan.units[i].params) {
      if (ShapeNumel(p.shape) != p.numel) return absl::InvalidArgumentError("numel");
    }
    FS_RETURN_IF_ERROR(CheckUnit(plan, plan.units[i], i, path));  // the path of no message
  }
  return CheckFingerprint(plan, path);
}

}  // namespace

absl::StatusOr<Plan> PlanFromJsonValue(const Json& doc) {
  JsonPath path("plan");
  FS_RETURN_IF_ERROR(
      ExpectObject(doc, path,
                   {"format", "world_size", "sharding_strategy", "shard_world_size",
                    "use_orig_params", "units", "ignored_params", "warnings", "fingerprint"}));
  FS_ASSIGN_OR_RETURN(std::string format, GetString(doc, "format", path));
  if (format != kPlanFormat) {
    return path.Key("format").Error(
        absl::StrCat("unknown format ", Quote(format), ", expected ", Quote(kPlanFormat)));
  }
  Plan plan;
  FS_ASSIGN_OR_RETURN(int64_t world_size, GetInt(doc, "world_size", path, 1, INT32_MAX));
  plan.world_size = static_cast<int32_t>(world_size);
  std::string strategy(ShardingStrategyName(plan.sharding_strategy));
  FS_RETURN_IF_ERROR(GetOptionalString(doc, "sharding_strategy", path, &strategy));
  auto parsed = ParseShardingStrategy(strategy);
  if (!parsed) {
    return path.Key("sharding_strategy")
        .Error(absl::StrCat("unknown sharding strategy ", Quote(strategy)));
  }
  plan.sharding_strategy = *parsed;
  int64_t shard_world = plan.sharding_strategy == ShardingStrategy::kNoShard ? 1 : world_size;
  FS_RETURN_IF_ERROR(GetOptionalInt(doc, "shard_world_size", path, 1, world_size, &shard_world));
  FS_RETURN_IF_ERROR(CheckShardWorld(plan.sharding_strategy, world_size, shard_world, path));
  plan.shard_world_size = static_cast<int32_t>(shard_world);
  FS_RETURN_IF_ERROR(GetOptionalBool(doc, "use_orig_params", path, &plan.use_orig_params));
  auto units = doc.find("units");
  if (units == doc.end()) return path.Error("missing required key \"units\"");
  FS_RETURN_IF_ERROR(ExpectArray(*units, path.Key("units")));
  const JsonPath units_path = path.Key("units");
  for (size_t i = 0; i < units->size(); ++i) {
    JsonPath upath = units_path.Index(i);
    FS_ASSIGN_OR_RETURN(PlanUnit u, ParseUnit((*units)[i], upath));
    FS_RETURN_IF_ERROR(CheckUnit(plan, u, i, upath));
    plan.units.push_back(std::move(u));
  }
  FS_RETURN_IF_ERROR(GetOptionalStringList(doc, "ignored_params", path, &plan.ignored_params));
  FS_RETURN_IF_ERROR(GetOptionalStringList(doc, "warnings", path, &plan.warnings));
  FS_ASSIGN_OR_RETURN(plan.fingerprint, GetString(doc, "fingerprint", path));
  FS_RETURN_IF_ERROR(CheckFingerprint(plan, path));
  return plan;
}

absl::StatusOr<Plan> PlanFromJson(absl::string_view text) {
  if (std::optional<ScannedPlan> scanned = ScanPlan(text)) {
    if (CheckScannedPlan(*scanned).ok()) return std::move(scanned->plan);
  }
  // Not valid (or spelled with escapes the scanner leaves alone): the DOM path gives the
  // result and names the error.
  FS_ASSIGN_OR_RETURN(Json doc, ParseJson(text, "plan"));
  return PlanFromJsonValue(doc);
}

}  // namespace flatshard
