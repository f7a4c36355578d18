#include "common/manifest_json_writer.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace flatshard {
namespace {

class Writer {
 public:
  explicit Writer(const Manifest& manifest)
      : manifest_(manifest), written_(manifest.modules.size(), false) {}

  bool Document(std::string* out) {
    out_ = out;
    Raw("{\"format\":");
    if (!String(kManifestFormat)) return false;
    Raw(",\"root\":");
    if (!Module(0)) return false;
    Raw("}");
    return true;
  }

 private:
  void Raw(absl::string_view s) { out_->append(s.data(), s.size()); }
  bool String(absl::string_view s) {
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x20 || u >= 0x7f || c == '"' || c == '\\') return false;
    }
    absl::StrAppend(out_, "\"", s, "\"");
    return true;
  }

  bool Module(int32_t index) {
    const ModuleDecl& m = manifest_.modules[index];
    if (written_[index]) {
      absl::StrAppend(out_, "{\"ref\":", m.id, "}");
      return true;
    }
    written_[index] = true;
    absl::StrAppend(out_, "{\"id\":", m.id, ",\"type\":");
    if (!String(m.type)) return false;
    Raw(",\"bases\":[");
    for (size_t i = 0; i < m.bases.size(); ++i) {
      if (i > 0) Raw(",");
      if (!String(m.bases[i])) return false;
    }
    Raw("],\"params\":");
    if (!Tensors(m.params)) return false;
    if (!m.buffers.empty()) {
      Raw(",\"buffers\":");
      if (!Tensors(m.buffers)) return false;
    }
    Raw(",\"children\":[");
    for (size_t i = 0; i < m.children.size(); ++i) {
      Raw(i > 0 ? ",{\"name\":" : "{\"name\":");
      if (!String(m.children[i].name)) return false;
      Raw(",\"module\":");
      if (!Module(m.children[i].module)) return false;
      Raw("}");
    }
    Raw("]}");
    return true;
  }

  bool Tensors(const std::vector<TensorDecl>& tensors) {
    Raw("[");
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorDecl& t = tensors[i];
      Raw(i > 0 ? ",{\"name\":" : "{\"name\":");
      if (!String(t.name)) return false;
      absl::StrAppend(out_, ",\"id\":", t.id, ",\"shape\":[");
      for (size_t d = 0; d < t.shape.size(); ++d) {
        absl::StrAppend(out_, d > 0 ? "," : "", t.shape[d]);
      }
      absl::StrAppend(out_, "],\"dtype\":\"", DTypeName(t.dtype),
                      "\",\"requires_grad\":", t.requires_grad ? "true" : "false", "}");
    }
    Raw("]");
    return true;
  }

  const Manifest& manifest_;
  std::vector<bool> written_;
  std::string* out_ = nullptr;
};

}  // namespace

std::optional<std::string> ManifestToPlainJsonText(const Manifest& manifest) {
  if (manifest.modules.empty()) return std::nullopt;
  std::string text;
  if (!Writer(manifest).Document(&text)) return std::nullopt;
  return text;
}

}  // namespace flatshard
