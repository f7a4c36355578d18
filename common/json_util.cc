#include "common/json_util.h"

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard {
namespace {

absl::string_view TypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a number with a fraction or exponent";
    default:
      return "an unsupported value";
  }
}

// Depth of bracket nesting outside strings; stops counting once past the limit.
int MaxDepth(absl::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"')
      in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > max_depth) max_depth = depth;
      if (max_depth > kMaxJsonDepth) return max_depth;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

// Builds the DOM in one SAX pass and stops at the first key repeated within one object
// (nlohmann's own DOM builder merges duplicates silently, and its parse callback rescans the
// parent on every object end: quadratic). Strings and keys are moved, not copied.
class StrictDomBuilder {
 public:
  explicit StrictDomBuilder(Json& root) : root_(root) {}

  const std::string& duplicate() const { return duplicate_; }

  bool null() { return Add(nullptr) != nullptr; }
  bool boolean(bool v) { return Add(v) != nullptr; }
  bool number_integer(Json::number_integer_t v) { return Add(v) != nullptr; }
  bool number_unsigned(Json::number_unsigned_t v) { return Add(v) != nullptr; }
  bool number_float(Json::number_float_t v, const std::string&) { return Add(v) != nullptr; }
  bool string(std::string& v) { return Add(std::move(v)) != nullptr; }
  bool binary(Json::binary_t& v) { return Add(Json::binary(std::move(v))) != nullptr; }
  bool start_object(size_t) {
    stack_.push_back(Add(Json::value_t::object));
    return true;
  }
  bool key(std::string& k) {
    auto [it, inserted] = stack_.back()->get_ref<Json::object_t&>().emplace(std::move(k), nullptr);
    if (!inserted) {
      duplicate_ = it->first;
      return false;  // stop: one is enough
    }
    element_ = &it->second;
    return true;
  }
  bool end_object() {
    stack_.pop_back();
    return true;
  }
  bool start_array(size_t) {
    stack_.push_back(Add(Json::value_t::array));
    return true;
  }
  bool end_array() {
    stack_.pop_back();
    return true;
  }
  template <class Exception>
  bool parse_error(size_t, const std::string&, const Exception& e) {
    throw e;  // ParseJson reports it with its position, as nlohmann's parse would
  }

 private:
  template <typename V>
  Json* Add(V&& v) {
    if (stack_.empty()) {
      root_ = Json(std::forward<V>(v));
      return &root_;
    }
    Json* top = stack_.back();
    if (top->is_array()) {
      auto& array = top->get_ref<Json::array_t&>();
      array.emplace_back(std::forward<V>(v));
      return &array.back();
    }
    *element_ = Json(std::forward<V>(v));
    return element_;
  }

  Json& root_;
  std::vector<Json*> stack_;
  Json* element_ = nullptr;
  std::string duplicate_;
};

// The happy path of AsInt, without building the JSON path an error would name.
bool IntInRange(const Json& v, int64_t min, int64_t max, int64_t* out) {
  int64_t value;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    value = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
  } else {
    return false;
  }
  if (value < min || value > max) return false;
  *out = value;
  return true;
}

}  // namespace

std::string Quote(absl::string_view s) {
  // dump() escapes control characters and quotes; error_handler replace keeps bad UTF-8 printable.
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

JsonPath JsonPath::Key(absl::string_view key) const {
  return JsonPath(doc_, absl::StrCat(path_, ".", key));
}

JsonPath JsonPath::Index(size_t i) const {
  return JsonPath(doc_, absl::StrCat(path_, "[", i, "]"));
}

absl::Status JsonPath::Error(absl::string_view what) const {
  return absl::InvalidArgumentError(absl::StrCat(doc_, ": ", path_, ": ", what));
}

absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view doc) {
  if (text.size() > kMaxJsonBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        doc, ": document is ", text.size(), " bytes, more than the limit of ", kMaxJsonBytes));
  }
  if (MaxDepth(text) > kMaxJsonDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat(doc, ": JSON nests deeper than ", kMaxJsonDepth, " levels"));
  }
  Json value;
  StrictDomBuilder builder(value);
  try {
    Json::sax_parse(text.begin(), text.end(), &builder, nlohmann::detail::input_format_t::json,
                    /*strict=*/true, /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    absl::string_view what = e.what();
    if (auto pos = what.find("] "); absl::StartsWith(what, "[json.exception") && pos != what.npos) {
      what.remove_prefix(pos + 2);
    }
    return absl::InvalidArgumentError(absl::StrCat(doc, ": malformed JSON: ", what));
  }
  if (!builder.duplicate().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(doc, ": duplicate key ", Quote(builder.duplicate()), " in an object"));
  }
  return value;
}

absl::Status ExpectObject(const Json& v, const JsonPath& path,
                          std::initializer_list<absl::string_view> allowed) {
  if (!v.is_object()) return path.Error(absl::StrCat("must be an object, got ", TypeName(v)));
  for (const auto& [key, unused] : v.items()) {
    bool known = false;
    for (absl::string_view a : allowed) known = known || key == a;
    if (!known) {
      return path.Error(absl::StrCat("unknown key ", Quote(key),
                                     " (allowed: ", absl::StrJoin(allowed, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ExpectArray(const Json& v, const JsonPath& path) {
  if (!v.is_array()) return path.Error(absl::StrCat("must be an array, got ", TypeName(v)));
  return absl::OkStatus();
}

absl::StatusOr<std::string> AsString(const Json& v, const JsonPath& path) {
  if (!v.is_string()) return path.Error(absl::StrCat("must be a string, got ", TypeName(v)));
  return v.get<std::string>();
}

absl::StatusOr<int64_t> AsInt(const Json& v, const JsonPath& path, int64_t min, int64_t max) {
  int64_t value = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return path.Error(absl::StrCat("integer ", u, " overflows int64"));
    }
    value = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
  } else if (v.is_number_float()) {
    return path.Error(absl::StrCat("must be an integer, got ", v.dump(),
                                   " (too large, or has a fraction or exponent)"));
  } else {
    return path.Error(absl::StrCat("must be an integer, got ", TypeName(v)));
  }
  if (value < min || value > max) {
    if (max == std::numeric_limits<int64_t>::max()) {
      return path.Error(absl::StrCat("must be at least ", min, ", got ", value));
    }
    return path.Error(absl::StrCat("must be in [", min, ", ", max, "], got ", value));
  }
  return value;
}

absl::StatusOr<std::string> GetString(const Json& obj, absl::string_view key,
                                      const JsonPath& path) {
  auto it = obj.find(key);
  if (it == obj.end()) return path.Error(absl::StrCat("missing required key ", Quote(key)));
  // The path is spelled out only for an error.
  if (it->is_string()) return it->get_ref<const std::string&>();
  return AsString(*it, path.Key(key));
}

absl::Status GetOptionalString(const Json& obj, absl::string_view key, const JsonPath& path,
                               std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  if (it->is_string()) {
    *out = it->get_ref<const std::string&>();
    return absl::OkStatus();
  }
  auto s = AsString(*it, path.Key(key));
  if (!s.ok()) return s.status();
  *out = *std::move(s);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> GetInt(const Json& obj, absl::string_view key, const JsonPath& path,
                               int64_t min, int64_t max) {
  auto it = obj.find(key);
  if (it == obj.end()) return path.Error(absl::StrCat("missing required key ", Quote(key)));
  if (int64_t v; IntInRange(*it, min, max, &v)) return v;  // the path only for an error
  return AsInt(*it, path.Key(key), min, max);
}

absl::Status GetOptionalInt(const Json& obj, absl::string_view key, const JsonPath& path,
                            int64_t min, int64_t max, int64_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  if (IntInRange(*it, min, max, out)) return absl::OkStatus();
  auto v = AsInt(*it, path.Key(key), min, max);
  if (!v.ok()) return v.status();
  *out = *v;
  return absl::OkStatus();
}

absl::StatusOr<bool> GetBool(const Json& obj, absl::string_view key, const JsonPath& path) {
  auto it = obj.find(key);
  if (it == obj.end()) return path.Error(absl::StrCat("missing required key ", Quote(key)));
  if (!it->is_boolean()) {
    return path.Key(key).Error(absl::StrCat("must be true or false, got ", TypeName(*it)));
  }
  return it->get<bool>();
}

absl::Status GetOptionalBool(const Json& obj, absl::string_view key, const JsonPath& path,
                             bool* out) {
  if (!obj.contains(key)) return absl::OkStatus();
  auto v = GetBool(obj, key, path);
  if (!v.ok()) return v.status();
  *out = *v;
  return absl::OkStatus();
}

absl::Status GetOptionalStringList(const Json& obj, absl::string_view key, const JsonPath& path,
                                   std::vector<std::string>* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  JsonPath list_path = path.Key(key);
  if (!it->is_array()) {
    return list_path.Error(absl::StrCat("must be an array of strings, got ", TypeName(*it)));
  }
  std::vector<std::string> values;
  values.reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    auto s = AsString((*it)[i], list_path.Index(i));
    if (!s.ok()) return s.status();
    values.push_back(*std::move(s));
  }
  *out = std::move(values);
  return absl::OkStatus();
}

}  // namespace flatshard
