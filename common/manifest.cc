#include "common/manifest.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/limits.h"
#include "common/manifest_json_writer.h"
#include "common/manifest_reader.h"
#include "common/status_macros.h"

namespace flatshard {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// PyTorch refuses empty attribute names and names containing '.'.
absl::Status CheckAttributeName(absl::string_view name, absl::string_view what,
                                const JsonPath& path) {
  if (name.empty()) return path.Error(absl::StrCat(what, " name must not be empty"));
  if (name.find('.') != absl::string_view::npos) {
    return path.Error(absl::StrCat(what, " name ", Quote(name), " must not contain \".\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> NumelOf(const std::vector<int64_t>& shape, const JsonPath& path) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return path.Error(absl::StrCat("shape ", ShapeString(shape), " has more than 2^63 elements"));
    }
  }
  return numel;
}

class ManifestParser {
 public:
  absl::StatusOr<Manifest> Parse(const Json& doc) {
    JsonPath path("manifest");
    FS_RETURN_IF_ERROR(ExpectObject(doc, path, {"format", "root"}));
    FS_ASSIGN_OR_RETURN(std::string format, GetString(doc, "format", path));
    if (format != kManifestFormat) {
      return path.Key("format").Error(
          absl::StrCat("unknown format ", Quote(format), ", expected ", Quote(kManifestFormat)));
    }
    auto root = doc.find("root");
    if (root == doc.end()) return path.Error("missing required key \"root\"");
    if (root->is_object() && root->contains("ref")) {
      return path.Key("root").Error("the root module cannot be a ref");
    }
    FS_RETURN_IF_ERROR(ParseModule(*root, path.Key("root"), 1).status());
    // Tied tensors were checked against their first declaration while parsing.
    return std::move(manifest_);
  }

 private:
  absl::StatusOr<int32_t> ParseModule(const Json& v, const JsonPath& path, int depth) {
    if (v.is_object() && v.contains("ref")) return ParseRef(v, path, depth);
    if (depth > kMaxModuleDepth) {
      return path.Error(absl::StrCat("module tree is deeper than ", kMaxModuleDepth, " levels"));
    }
    FS_RETURN_IF_ERROR(
        ExpectObject(v, path, {"id", "type", "bases", "params", "buffers", "children"}));
    FS_ASSIGN_OR_RETURN(int64_t id, GetInt(v, "id", path));
    if (auto it = index_of_id_.find(id); it != index_of_id_.end()) {
      return path.Key("id").Error(absl::StrCat(
          "module id ", id, " is defined twice (first at ", id_path_[id],
          "); a module registered at several paths is written once and then as {\"ref\": ", id,
          "}"));
    }
    if (static_cast<int64_t>(manifest_.modules.size()) >= kMaxManifestModules) {
      return path.Error(
          absl::StrCat("more than ", kMaxManifestModules, " module instances (the limit)"));
    }
    const int32_t index = static_cast<int32_t>(manifest_.modules.size());
    manifest_.modules.emplace_back();
    height_.push_back(0);
    index_of_id_[id] = index;
    id_path_[id] = path.str();
    open_.insert(index);

    ModuleDecl m;
    m.id = id;
    FS_ASSIGN_OR_RETURN(m.type, GetString(v, "type", path));
    if (m.type.empty()) return path.Key("type").Error("module type must not be empty");
    FS_RETURN_IF_ERROR(GetOptionalStringList(v, "bases", path, &m.bases));
    std::unordered_set<std::string> names;
    FS_RETURN_IF_ERROR(ParseTensors(v, "params", path, "parameter", &names, &m.params));
    FS_RETURN_IF_ERROR(ParseTensors(v, "buffers", path, "buffer", &names, &m.buffers));
    if (auto it = v.find("children"); it != v.end()) {
      JsonPath children_path = path.Key("children");
      FS_RETURN_IF_ERROR(ExpectArray(*it, children_path));
      for (size_t i = 0; i < it->size(); ++i) {
        JsonPath child_path = children_path.Index(i);
        const Json& c = (*it)[i];
        FS_RETURN_IF_ERROR(ExpectObject(c, child_path, {"name", "module"}));
        ChildDecl child;
        FS_ASSIGN_OR_RETURN(child.name, GetString(c, "name", child_path));
        FS_RETURN_IF_ERROR(CheckAttributeName(child.name, "child", child_path.Key("name")));
        if (!names.insert(child.name).second) {
          return child_path.Key("name").Error(
              absl::StrCat("name ", Quote(child.name), " is already used on this module"));
        }
        auto mod = c.find("module");
        if (mod == c.end()) return child_path.Error("missing required key \"module\"");
        FS_ASSIGN_OR_RETURN(child.module, ParseModule(*mod, child_path.Key("module"), depth + 1));
        m.children.push_back(std::move(child));
      }
    }
    open_.erase(index);
    int height = 1;
    for (const ChildDecl& c : m.children) height = std::max(height, 1 + height_[c.module]);
    height_[index] = height;
    manifest_.modules[index] = std::move(m);
    return index;
  }

  absl::StatusOr<int32_t> ParseRef(const Json& v, const JsonPath& path, int depth) {
    if (v.size() != 1) {
      return path.Error("a {\"ref\": ID} module must have no other keys");
    }
    FS_ASSIGN_OR_RETURN(int64_t id, GetInt(v, "ref", path));
    auto it = index_of_id_.find(id);
    if (it == index_of_id_.end()) {
      return path.Key("ref").Error(absl::StrCat(
          "dangling ref: no module with id ", id,
          " is defined before this point (a shared module is written in full at its first "
          "occurrence in pre-order)"));
    }
    if (open_.contains(it->second)) {
      return path.Key("ref").Error(absl::StrCat(
          "cyclic ref: module id ", id, " is an ancestor of this position (", id_path_[id], ")"));
    }
    // Chains of refs can nest deeper than the JSON does: bound the expanded tree's depth.
    if (depth - 1 + height_[it->second] > kMaxModuleDepth) {
      return path.Key("ref").Error(absl::StrCat("module tree is deeper than ", kMaxModuleDepth,
                                                " levels through shared module id ", id));
    }
    return it->second;
  }

  absl::Status ParseTensors(const Json& v, absl::string_view key, const JsonPath& path,
                            absl::string_view what, std::unordered_set<std::string>* names,
                            std::vector<TensorDecl>* out) {
    auto it = v.find(key);
    if (it == v.end()) return absl::OkStatus();
    JsonPath list_path = path.Key(key);
    FS_RETURN_IF_ERROR(ExpectArray(*it, list_path));
    const bool is_param = what == "parameter";
    for (size_t i = 0; i < it->size(); ++i) {
      JsonPath tpath = list_path.Index(i);
      const Json& t = (*it)[i];
      FS_RETURN_IF_ERROR(ExpectObject(t, tpath, {"name", "id", "shape", "dtype", "requires_grad"}));
      TensorDecl decl;
      FS_ASSIGN_OR_RETURN(decl.name, GetString(t, "name", tpath));
      FS_RETURN_IF_ERROR(CheckAttributeName(decl.name, what, tpath.Key("name")));
      if (!names->insert(decl.name).second) {
        return tpath.Key("name").Error(
            absl::StrCat("name ", Quote(decl.name), " is already used on this module"));
      }
      FS_ASSIGN_OR_RETURN(decl.id, GetInt(t, "id", tpath));
      auto shape = t.find("shape");
      if (shape == t.end()) return tpath.Error("missing required key \"shape\"");
      JsonPath shape_path = tpath.Key("shape");
      FS_RETURN_IF_ERROR(ExpectArray(*shape, shape_path));
      for (size_t d = 0; d < shape->size(); ++d) {
        FS_ASSIGN_OR_RETURN(int64_t dim, AsInt((*shape)[d], shape_path.Index(d), 0,
                                               std::numeric_limits<int64_t>::max()));
        decl.shape.push_back(dim);
      }
      FS_ASSIGN_OR_RETURN(decl.numel, NumelOf(decl.shape, shape_path));
      FS_ASSIGN_OR_RETURN(std::string dtype, GetString(t, "dtype", tpath));
      auto parsed = ParseDType(dtype);
      if (!parsed) {
        return tpath.Key("dtype").Error(
            absl::StrCat("unknown dtype ", Quote(dtype),
                         " (one of float32 float16 bfloat16 float64 int8 int32 int64 uint8 bool)"));
      }
      decl.dtype = *parsed;
      FS_RETURN_IF_ERROR(GetOptionalBool(t, "requires_grad", tpath, &decl.requires_grad));
      auto& seen = is_param ? params_seen_ : buffers_seen_;
      if (auto s = seen.find(decl.id); s != seen.end()) {
        const TensorDecl& first = s->second.decl;
        std::string diff;
        if (first.shape != decl.shape) {
          diff = absl::StrCat("shape ", ShapeString(decl.shape), " vs ", ShapeString(first.shape));
        } else if (first.dtype != decl.dtype) {
          diff = absl::StrCat("dtype ", DTypeName(decl.dtype), " vs ", DTypeName(first.dtype));
        } else if (first.requires_grad != decl.requires_grad) {
          diff = absl::StrCat("requires_grad ", decl.requires_grad ? "true" : "false", " vs ",
                              first.requires_grad ? "true" : "false");
        }
        if (!diff.empty()) {
          return tpath.Error(absl::StrCat("conflicting declarations of tied ", what, " id ",
                                          decl.id, ": ", diff, " at ", s->second.path));
        }
      } else {
        seen.emplace(decl.id, FirstDecl{decl, tpath.str()});
      }
      out->push_back(std::move(decl));
    }
    return absl::OkStatus();
  }

  struct FirstDecl {
    TensorDecl decl;
    std::string path;
  };

  Manifest manifest_;
  absl::flat_hash_map<int64_t, int32_t> index_of_id_;
  absl::flat_hash_map<int64_t, std::string> id_path_;
  std::unordered_set<int32_t> open_;
  std::vector<int> height_;  // levels of each completed module's subtree, itself included
  std::unordered_map<int64_t, FirstDecl> params_seen_;
  std::unordered_map<int64_t, FirstDecl> buffers_seen_;
};

Json TensorsToJson(const std::vector<TensorDecl>& tensors) {
  Json list = Json::array();
  for (const TensorDecl& t : tensors) {
    list.push_back({{"name", t.name},
                    {"id", t.id},
                    {"shape", t.shape},
                    {"dtype", std::string(DTypeName(t.dtype))},
                    {"requires_grad", t.requires_grad}});
  }
  return list;
}

Json ModuleToJson(const Manifest& manifest, int32_t index, std::vector<bool>& written) {
  const ModuleDecl& m = manifest.modules[index];
  if (written[index]) return Json{{"ref", m.id}};
  written[index] = true;
  Json children = Json::array();
  for (const ChildDecl& c : m.children) {
    children.push_back({{"name", c.name}, {"module", ModuleToJson(manifest, c.module, written)}});
  }
  Json j = {{"id", m.id},
            {"type", m.type},
            {"bases", m.bases},
            {"params", TensorsToJson(m.params)},
            {"children", std::move(children)}};
  if (!m.buffers.empty()) j["buffers"] = TensorsToJson(m.buffers);
  return j;
}

}  // namespace

bool ModuleDecl::IsInstanceOf(absl::string_view type_name) const {
  return type == type_name || std::find(bases.begin(), bases.end(), type_name) != bases.end();
}

std::optional<int32_t> FindModulePath(const Manifest& manifest, absl::string_view path) {
  if (manifest.modules.empty()) return std::nullopt;
  int32_t m = 0;
  if (path.empty()) return m;
  for (absl::string_view name : absl::StrSplit(path, '.')) {
    const auto& children = manifest.modules[m].children;
    auto it = std::find_if(children.begin(), children.end(),
                           [&](const ChildDecl& c) { return c.name == name; });
    if (it == children.end()) return std::nullopt;
    m = it->module;
  }
  return m;
}

absl::StatusOr<Manifest> ManifestFromJsonValue(const Json& doc) {
  return ManifestParser().Parse(doc);
}

absl::StatusOr<Manifest> ManifestFromJson(absl::string_view text) {
  // Refused before parsing: parsing costs time and memory in proportion to the text.
  FS_RETURN_IF_ERROR(CheckLength("manifest", "the JSON text", text, kMaxManifestJsonBytes));
  if (std::optional<Manifest> m = ReadValidManifest(text)) return *std::move(m);
  // Not valid (or spelled with escapes the fast reader leaves alone): the DOM reader gives the
  // result and names the error.
  FS_ASSIGN_OR_RETURN(Json doc, ParseJson(text, "manifest"));
  return ManifestFromJsonValue(doc);
}

Json ManifestToJson(const Manifest& manifest) {
  std::vector<bool> written(manifest.modules.size(), false);
  Json root = manifest.modules.empty() ? Json::object() : ModuleToJson(manifest, 0, written);
  return Json{{"format", std::string(kManifestFormat)}, {"root", std::move(root)}};
}

absl::Status ValidateManifest(const Manifest& manifest) {
  // The JSON form is the one validated spelling: a manifest built in code is checked by
  // writing it out and parsing it back, so both paths apply exactly the same rules.
  if (manifest.modules.empty()) return absl::InvalidArgumentError("manifest: no root module");
  for (size_t i = 0; i < manifest.modules.size(); ++i) {
    for (const ChildDecl& c : manifest.modules[i].children) {
      if (c.module < 0 || static_cast<size_t>(c.module) >= manifest.modules.size()) {
        return absl::InvalidArgumentError(absl::StrCat("manifest: module ", manifest.modules[i].id,
                                                       " child ", Quote(c.name),
                                                       " refers to a missing module"));
      }
    }
  }
  // A cycle would make the written form infinite: find one first.
  std::vector<int> color(manifest.modules.size(), 0);  // 0 new, 1 open, 2 done
  std::vector<std::pair<int32_t, size_t>> stack = {{0, 0}};
  color[0] = 1;
  while (!stack.empty()) {
    auto& [index, next] = stack.back();
    const auto& children = manifest.modules[index].children;
    if (next == children.size()) {
      color[index] = 2;
      stack.pop_back();
      continue;
    }
    int32_t child = children[next++].module;
    if (color[child] == 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest: cyclic module graph through module id ", manifest.modules[child].id));
    }
    if (color[child] == 0) {
      color[child] = 1;
      stack.emplace_back(child, 0);
    }
  }
  // Longest path from the root, in reverse completion order (children finish first), so the
  // recursive JSON round trip below cannot run out of stack.
  {
    std::vector<int> depth(manifest.modules.size(), 0);
    std::vector<int32_t> order;  // post-order
    std::vector<bool> seen(manifest.modules.size(), false);
    std::vector<std::pair<int32_t, size_t>> walk = {{0, 0}};
    seen[0] = true;
    while (!walk.empty()) {
      auto& [index, next] = walk.back();
      const auto& children = manifest.modules[index].children;
      if (next < children.size()) {
        int32_t child = children[next++].module;
        if (!seen[child]) {
          seen[child] = true;
          walk.emplace_back(child, 0);
        }
        continue;
      }
      order.push_back(index);
      walk.pop_back();
    }
    depth[0] = 1;
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      for (const ChildDecl& c : manifest.modules[*it].children) {
        depth[c.module] = std::max(depth[c.module], depth[*it] + 1);
        if (depth[c.module] > kMaxModuleDepth) {
          return absl::InvalidArgumentError(
              absl::StrCat("manifest: module tree is deeper than ", kMaxModuleDepth, " levels"));
        }
      }
    }
  }
  // Fast path: the same document as text, read by the one-pass reader; anything it does not
  // accept as this very manifest goes the DOM way below, which words the error.
  if (std::optional<std::string> text = ManifestToPlainJsonText(manifest)) {
    std::optional<Manifest> read = ReadValidManifest(*text);
    if (read.has_value() && *read == manifest) return absl::OkStatus();
  }
  FS_ASSIGN_OR_RETURN(Manifest reparsed, ManifestFromJsonValue(ManifestToJson(manifest)));
  if (!(reparsed == manifest)) {
    return absl::InvalidArgumentError(
        "manifest: modules must be listed in pre-order of first occurrence, each reachable "
        "from the root");
  }
  return absl::OkStatus();
}

}  // namespace flatshard
