// PlanToJsonText: the compact plan document written straight from the Plan, byte for byte
// what PlanToJson(plan).dump() gives, without building an ordered_json tree first (that tree
// cost more than the planning itself on 10,000-module models).

#include <string>

#include "absl/strings/str_cat.h"
#include "common/plan_json_writer.h"

namespace flatshard {
namespace {

class Writer {
 public:
  Writer(std::string* out, nlohmann::detail::error_handler_t on_invalid_utf8)
      : out_(*out), on_invalid_utf8_(on_invalid_utf8) {}

  void Raw(absl::string_view s) { out_.append(s.data(), s.size()); }
  void Int(int64_t v) { absl::StrAppend(&out_, v); }
  void Bool(bool v) { Raw(v ? "true" : "false"); }
  // Plain printable ASCII is written as is; anything else goes through nlohmann's serializer,
  // so escapes and UTF-8 handling (including its errors) stay exactly those of dump().
  void String(absl::string_view s) {
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x20 || u >= 0x7f || c == '"' || c == '\\') {
        Raw(nlohmann::ordered_json(std::string(s)).dump(-1, ' ', false, on_invalid_utf8_));
        return;
      }
    }
    out_.push_back('"');
    Raw(s);
    out_.push_back('"');
  }
  void Key(absl::string_view k, bool first = false) {
    if (!first) out_.push_back(',');
    String(k);
    out_.push_back(':');
  }
  void IntArray(const std::vector<int64_t>& v) {
    out_.push_back('[');
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out_.push_back(',');
      Int(v[i]);
    }
    out_.push_back(']');
  }
  void StringArray(const std::vector<std::string>& v) {
    out_.push_back('[');
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out_.push_back(',');
      String(v[i]);
    }
    out_.push_back(']');
  }

 private:
  std::string& out_;
  const nlohmann::detail::error_handler_t on_invalid_utf8_;
};

}  // namespace

std::string PlanToJsonText(const Plan& plan, nlohmann::detail::error_handler_t on_invalid_utf8) {
  std::string out;
  size_t estimate = 512;
  for (const PlanUnit& u : plan.units) {
    estimate += 256 + u.module.size();
    for (const PlanParam& p : u.params) estimate += 64 + 2 * p.fqn.size();
  }
  out.reserve(estimate);
  Writer w(&out, on_invalid_utf8);
  w.Raw("{");
  w.Key("format", true);
  w.String(kPlanFormat);
  w.Key("world_size");
  w.Int(plan.world_size);
  w.Key("sharding_strategy");
  w.String(ShardingStrategyName(plan.sharding_strategy));
  w.Key("shard_world_size");
  w.Int(plan.shard_world_size);
  w.Key("use_orig_params");
  w.Bool(plan.use_orig_params);
  w.Key("units");
  w.Raw("[");
  for (size_t i = 0; i < plan.units.size(); ++i) {
    const PlanUnit& u = plan.units[i];
    if (i > 0) w.Raw(",");
    w.Raw("{");
    w.Key("index", true);
    w.Int(u.index);
    w.Key("module");
    w.String(u.module);
    w.Key("module_type");
    w.String(u.module_type);
    w.Key("dtype");
    w.String(DTypeName(u.dtype));
    if (u.compute_dtype) {
      w.Key("compute_dtype");
      w.String(DTypeName(*u.compute_dtype));
    }
    if (u.reduce_dtype) {
      w.Key("reduce_dtype");
      w.String(DTypeName(*u.reduce_dtype));
    }
    w.Key("requires_grad");
    w.Bool(u.requires_grad);
    w.Key("params");
    w.Raw("[");
    for (size_t j = 0; j < u.params.size(); ++j) {
      const PlanParam& p = u.params[j];
      if (j > 0) w.Raw(",");
      w.Raw("{");
      w.Key("fqn", true);
      w.String(p.fqn);
      w.Key("shape");
      w.IntArray(p.shape);
      w.Key("numel");
      w.Int(p.numel);
      w.Key("offset");
      w.Int(p.offset);
      w.Raw("}");
    }
    w.Raw("]");
    w.Key("shared");
    w.Raw("[");
    for (size_t j = 0; j < u.shared.size(); ++j) {
      const SharedParam& s = u.shared[j];
      if (j > 0) w.Raw(",");
      w.Raw("{");
      w.Key("fqn", true);
      w.String(s.fqn);
      w.Key("same_as");
      w.String(s.same_as);
      w.Raw("}");
    }
    w.Raw("]");
    w.Key("numel");
    w.Int(u.numel);
    w.Key("padded_numel");
    w.Int(u.padded_numel);
    w.Key("shard_numel");
    w.Int(u.shard_numel);
    w.Raw("}");
  }
  w.Raw("]");
  w.Key("ignored_params");
  w.StringArray(plan.ignored_params);
  w.Key("warnings");
  w.StringArray(plan.warnings);
  w.Key("fingerprint");
  w.String(plan.fingerprint);
  w.Raw("}");
  return out;
}

}  // namespace flatshard
