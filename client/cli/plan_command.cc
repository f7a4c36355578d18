#include "client/cli/plan_command.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "client/cli/flags.h"
#include "common/file_util.h"
#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "common/status_macros.h"

namespace flatshard::cli {
namespace {

const std::vector<FlagSpec>& PlanFlags() {
  static const auto* specs = new std::vector<FlagSpec>{
      {"manifest", "FILE", "module tree (flatshard.manifest/1 JSON); required"},
      {"policy", "FILE", "wrap policy (flatshard.policy/1 JSON); default: no auto-wrap"},
      {"world-size", "N", "ranks in the group; required"},
      {"ranks-per-node", "N", "HYBRID_SHARD only: ranks a unit is sharded over (default N)"},
      {"format", "json|table", "output format (default json)"},
      {"json", "", "same as --format json"},
      {"help", "", "show this help"},
  };
  return *specs;
}

std::string Usage() {
  return absl::StrCat(
      "Usage: flatshardctl plan --manifest FILE [--policy FILE] --world-size N "
      "[--format json|table]\n\n"
      "Cuts a module tree into flat-parameter units exactly as PyTorch FSDP's auto-wrap would\n"
      "and prints each unit's parameters, offsets and shard sizes (spec/formats.md \"Plan\").\n\n"
      "Flags:\n",
      FlagsHelp(PlanFlags()),
      "\nExit status: 0 on success; 2 when the input is refused (one line on stderr names the\n"
      "file, JSON path or module and the rule; nothing is printed on stdout).\n");
}

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", what, " file '", path, "': ", text.status().message()));
  }
  return text;
}

// Prefixes a document error with the file it came from.
absl::Status InFile(absl::Status s, const std::string& path) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

struct PlanRequest {
  std::string manifest_path;
  std::string policy_path;
  PlanOptions options;
  bool table = false;
};

absl::StatusOr<PlanRequest> ParseRequest(const ParsedFlags& flags) {
  PlanRequest r;
  auto manifest = flags.Get("manifest");
  if (!manifest) return absl::InvalidArgumentError("--manifest FILE is required");
  r.manifest_path = *manifest;
  r.policy_path = flags.Get("policy").value_or("");
  if (!flags.Has("world-size")) return absl::InvalidArgumentError("--world-size N is required");
  FS_ASSIGN_OR_RETURN(int64_t world, flags.GetInt("world-size", 1, kMaxWorldSize));
  r.options.world_size = static_cast<int32_t>(world);
  if (flags.Has("ranks-per-node")) {
    FS_ASSIGN_OR_RETURN(int64_t per_node, flags.GetInt("ranks-per-node", 1, 1 << 20));
    r.options.ranks_per_node = static_cast<int32_t>(per_node);
  }
  std::string format = flags.Get("format").value_or("json");
  if (flags.Has("json") && format != "json") {
    return absl::InvalidArgumentError("--json conflicts with --format " + format);
  }
  if (format != "json" && format != "table") {
    return absl::InvalidArgumentError("--format must be json or table, got '" + format + "'");
  }
  r.table = format == "table";
  return r;
}

absl::StatusOr<Plan> MakePlan(const PlanRequest& r) {
  FS_ASSIGN_OR_RETURN(std::string manifest_text, ReadFile(r.manifest_path, "manifest"));
  absl::StatusOr<Manifest> manifest = ManifestFromJson(manifest_text);
  FS_RETURN_IF_ERROR(InFile(manifest.status(), r.manifest_path));
  Policy policy;
  if (!r.policy_path.empty()) {
    FS_ASSIGN_OR_RETURN(std::string policy_text, ReadFile(r.policy_path, "policy"));
    absl::StatusOr<Policy> parsed = PolicyFromJson(policy_text);
    FS_RETURN_IF_ERROR(InFile(parsed.status(), r.policy_path));
    policy = *std::move(parsed);
  }
  return BuildPlan(*manifest, policy, r.options);
}

std::string Bytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024 && unit < 5) {
    v /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", v, kUnits[unit]);
}

// Keeps one line per message: the error contract is a single stderr line.
std::string OneLine(absl::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

}  // namespace

std::string FormatPlanTable(const Plan& plan) {
  std::string out = absl::StrFormat(
      "world_size %d  sharding %s  shard group %d  use_orig_params %s  fingerprint %.16s\n\n",
      plan.world_size, ShardingStrategyName(plan.sharding_strategy), plan.shard_world_size,
      plan.use_orig_params ? "true" : "false", plan.fingerprint);
  absl::StrAppendFormat(&out, "%5s  %-32s %-20s %-9s %7s %14s %10s %12s %12s\n", "unit", "module",
                        "type", "dtype", "params", "numel", "padding", "shard/rank", "unsharded");
  int64_t params = 0, numel = 0, padding = 0;
  for (const PlanUnit& u : plan.units) {
    std::string module = u.module.empty() ? "(root)" : u.module;
    if (module.size() > 32) module = "..." + module.substr(module.size() - 29);
    std::string type =
        u.module_type.size() > 20 ? u.module_type.substr(0, 17) + "..." : u.module_type;
    absl::StrAppendFormat(&out, "%5d  %-32s %-20s %-9s %7d %14d %10d %12s %12s\n", u.index, module,
                          type, DTypeName(u.dtype), u.params.size(), u.numel, u.padding_numel(),
                          Bytes(u.shard_numel * ItemSize(u.dtype)),
                          Bytes(u.padded_numel * ItemSize(u.dtype)));
    params += static_cast<int64_t>(u.params.size());
    numel += u.numel;
    padding += u.padding_numel();
  }
  const PlanMemory mem = SummarizeMemory(plan);
  absl::StrAppendFormat(&out, "%5s  %-32s %-20s %-9s %7d %14d %10d %12s %12s\n", "total",
                        absl::StrCat(plan.units.size(), " units"), "", "", params, numel, padding,
                        Bytes(mem.shard_bytes), Bytes(mem.unsharded_bytes));
  absl::StrAppendFormat(&out, "\nper rank: shards %s; peak of a full summon (root, recurse) %s\n",
                        Bytes(mem.shard_bytes), Bytes(mem.peak_summon_bytes));
  if (!plan.ignored_params.empty()) {
    absl::StrAppendFormat(&out, "ignored parameters: %d\n", plan.ignored_params.size());
  }
  for (const std::string& w : plan.warnings) absl::StrAppend(&out, "warning: ", w, "\n");
  return out;
}

int RunPlanCommand(const std::vector<std::string>& args) {
  absl::StatusOr<ParsedFlags> flags = ParseFlags(PlanFlags(), args);
  if (!flags.ok()) {
    std::cerr << "flatshardctl plan: " << OneLine(flags.status().message())
              << " (see flatshardctl plan --help)\n";
    return 2;
  }
  if (flags->Has("help")) {
    std::cout << Usage();
    return 0;
  }
  absl::StatusOr<PlanRequest> request = ParseRequest(*flags);
  if (!request.ok()) {
    std::cerr << "flatshardctl plan: " << OneLine(request.status().message())
              << " (see flatshardctl plan --help)\n";
    return 2;
  }
  absl::StatusOr<Plan> plan = MakePlan(*request);
  if (!plan.ok()) {
    std::cerr << "flatshardctl plan: " << OneLine(plan.status().message()) << "\n";
    return plan.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (request->table) {
    std::cout << FormatPlanTable(*plan);
  } else {
    std::cout << PlanToJson(*plan).dump(2) << "\n";
  }
  std::cout.flush();
  return std::cout ? 0 : 1;
}

}  // namespace flatshard::cli
