#include "client/cli/flags.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace flatshard::cli {

std::optional<std::string> ParsedFlags::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<int64_t> ParsedFlags::GetInt(const std::string& name, int64_t min,
                                            int64_t max) const {
  auto v = Get(name);
  int64_t value = 0;
  if (!v || !absl::SimpleAtoi(*v, &value) || value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be an integer in [", min,
                                                   ", ", max, "], got '", v.value_or(""), "'"));
  }
  return value;
}

absl::StatusOr<ParsedFlags> ParseFlags(const std::vector<FlagSpec>& specs,
                                       const std::vector<std::string>& args) {
  ParsedFlags parsed;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    auto spec =
        std::find_if(specs.begin(), specs.end(), [&](const FlagSpec& s) { return s.name == name; });
    if (spec == specs.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (parsed.values_.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " given twice"));
    }
    if (spec->value_name.empty()) {
      if (inline_value) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " takes no value"));
      }
      parsed.values_[name] = "true";
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("flag --", name, " needs a value (", spec->value_name, ")"));
      }
      inline_value = args[++i];
    }
    parsed.values_[name] = *inline_value;
  }
  return parsed;
}

std::string FlagsHelp(const std::vector<FlagSpec>& specs) {
  size_t width = 0;
  std::vector<std::string> lefts;
  for (const FlagSpec& s : specs) {
    lefts.push_back(absl::StrCat("--", s.name, s.value_name.empty() ? "" : " ", s.value_name));
    width = std::max(width, lefts.back().size());
  }
  std::string out;
  for (size_t i = 0; i < specs.size(); ++i) {
    absl::StrAppend(&out, "  ", lefts[i], std::string(width - lefts[i].size() + 2, ' '),
                    specs[i].help, "\n");
  }
  return out;
}

}  // namespace flatshard::cli
