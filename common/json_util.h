#pragma once
// Strict reading of the JSON documents of formats.md (manifest, policy, plan).
//
// Every error is INVALID_ARGUMENT and names the document and the JSON path of the
// offending value ("manifest: $.root.params[0].shape[1]: must be a non-negative integer").
// Unknown keys, wrong types, duplicate keys, floats where integers belong, integers that
// overflow int64 and nesting deeper than kMaxJsonDepth are refused. Nothing here throws.
// Thread-safe: pure functions.

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

using Json = nlohmann::json;

// Deeper documents are refused before parsing (the module tree is at most a third as deep).
inline constexpr int kMaxJsonDepth = 512;
// Larger documents are refused before parsing.
inline constexpr size_t kMaxJsonBytes = size_t{1} << 30;

// Parses `text` as one JSON document named `doc` in errors.
absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view doc);

// A position in a JSON document, for error messages.
class JsonPath {
 public:
  explicit JsonPath(absl::string_view doc) : doc_(doc), path_("$") {}
  JsonPath Key(absl::string_view key) const;
  JsonPath Index(size_t i) const;
  const std::string& str() const { return path_; }
  absl::string_view doc() const { return doc_; }
  // INVALID_ARGUMENT "<doc>: <path>: <what>".
  absl::Status Error(absl::string_view what) const;

 private:
  JsonPath(absl::string_view doc, std::string path) : doc_(doc), path_(std::move(path)) {}
  std::string doc_;
  std::string path_;
};

// Checks that `v` is an object whose keys are all in `allowed`.
absl::Status ExpectObject(const Json& v, const JsonPath& path,
                          std::initializer_list<absl::string_view> allowed);
absl::Status ExpectArray(const Json& v, const JsonPath& path);

// Members of an object already checked by ExpectObject. The Get* forms require the key;
// the GetOptional* forms leave `*out` unchanged when the key is absent.
absl::StatusOr<std::string> GetString(const Json& obj, absl::string_view key, const JsonPath& path);
absl::Status GetOptionalString(const Json& obj, absl::string_view key, const JsonPath& path,
                               std::string* out);
absl::StatusOr<int64_t> GetInt(const Json& obj, absl::string_view key, const JsonPath& path,
                               int64_t min = std::numeric_limits<int64_t>::min(),
                               int64_t max = std::numeric_limits<int64_t>::max());
absl::Status GetOptionalInt(const Json& obj, absl::string_view key, const JsonPath& path,
                            int64_t min, int64_t max, int64_t* out);
absl::StatusOr<bool> GetBool(const Json& obj, absl::string_view key, const JsonPath& path);
absl::Status GetOptionalBool(const Json& obj, absl::string_view key, const JsonPath& path,
                             bool* out);
absl::Status GetOptionalStringList(const Json& obj, absl::string_view key, const JsonPath& path,
                                   std::vector<std::string>* out);

// Converts one value (not a member).
absl::StatusOr<int64_t> AsInt(const Json& v, const JsonPath& path, int64_t min, int64_t max);
absl::StatusOr<std::string> AsString(const Json& v, const JsonPath& path);

// Quotes a string for an error message, JSON style.
std::string Quote(absl::string_view s);

}  // namespace flatshard
