#pragma once
// Flag parsing for flatshardctl subcommands: `--name VALUE`, `--name=VALUE` and boolean
// `--name`. Unknown flags, missing values and repeated flags are errors naming the flag.
// Thread-compatible.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace flatshard::cli {

struct FlagSpec {
  std::string name;        // without the leading "--"
  std::string value_name;  // e.g. "FILE"; empty for a boolean flag
  std::string help;
};

class ParsedFlags {
 public:
  bool Has(const std::string& name) const { return values_.contains(name); }
  std::optional<std::string> Get(const std::string& name) const;
  // INVALID_ARGUMENT unless the value is an integer in [min, max].
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t min, int64_t max) const;

 private:
  friend absl::StatusOr<ParsedFlags> ParseFlags(const std::vector<FlagSpec>&,
                                                const std::vector<std::string>&);
  std::map<std::string, std::string> values_;
};

absl::StatusOr<ParsedFlags> ParseFlags(const std::vector<FlagSpec>& specs,
                                       const std::vector<std::string>& args);

// "  --name VALUE   help" lines, aligned.
std::string FlagsHelp(const std::vector<FlagSpec>& specs);

}  // namespace flatshard::cli
