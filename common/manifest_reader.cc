#include "common/manifest_reader.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/json_scanner.h"
#include "common/limits.h"

namespace flatshard {
namespace {

// PyTorch refuses empty attribute names and names containing '.' (as CheckAttributeName).
bool IsAttributeName(absl::string_view name) {
  return !name.empty() && name.find('.') == absl::string_view::npos;
}

// Every `false` below means "not read here" (invalid, or a spelling left to the DOM reader):
// ReadValidManifest then returns nullopt. No rule of formats.md is checked differently from
// ManifestParser (manifest.cc); only the order of the checks differs, which matters for the
// message alone, and the message comes from the DOM reader.
class ManifestReader {
 public:
  explicit ManifestReader(absl::string_view text) : in_(text) {}

  std::optional<Manifest> Read() {
    if (!ReadDocument()) return std::nullopt;
    return std::move(manifest_);
  }

 private:
  // --- The manifest (formats.md): the rules of ManifestParser. ---

  bool ReadDocument() {
    uint32_t seen = 0;
    bool ok = in_.Object([&](absl::string_view key) {
      if (key == "format") {
        absl::string_view format;
        return Once(&seen, 0) && in_.String(&format) && format == kManifestFormat;
      }
      if (key == "root") {
        int32_t root = 0;
        return Once(&seen, 1) && ReadModule(/*depth=*/1, &root);  // the root cannot be a ref
      }
      return false;
    });
    return ok && seen == 0b11 && in_.AtEnd();
  }

  // A module value: a module object or {"ref": ID} (ref only below the root). Its instance
  // index is the pre-order of first occurrence, taken at its first key, before any child's.
  bool ReadModule(int depth, int32_t* index) {
    enum { kEmpty, kRef, kModule } kind = kEmpty;
    int32_t self = -1;
    int64_t ref = 0;
    uint32_t seen = 0;
    bool ok = in_.Object([&](absl::string_view key) {
      if (kind == kRef) return false;  // a ref has no other keys
      if (kind == kEmpty) {
        if (key == "ref") {
          kind = kRef;
          return depth > 1 && in_.Int(&ref);
        }
        kind = kModule;
        if (depth > kMaxModuleDepth ||
            static_cast<int64_t>(manifest_.modules.size()) >= kMaxManifestModules) {
          return false;
        }
        self = static_cast<int32_t>(manifest_.modules.size());
        manifest_.modules.emplace_back();
        height_.push_back(0);  // open
      }
      return ModuleMember(key, self, depth, &seen);
    });
    if (!ok) return false;
    if (kind == kRef) return ResolveRef(ref, depth, index);
    if (kind == kEmpty || (seen & 0b11) != 0b11) return false;  // id and type are required
    if (!NamesAreUnique(manifest_.modules[self])) return false;
    int height = 1;
    for (const ChildDecl& c : manifest_.modules[self].children) {
      height = std::max(height, 1 + height_[c.module]);
    }
    height_[self] = height;
    *index = self;
    return true;
  }

  // The members of module `self`, which may come in any order (children before id, say):
  // ModuleDecl is filled through `self` each time, as children grow manifest_.modules.
  bool ModuleMember(absl::string_view key, int32_t self, int depth, uint32_t* seen) {
    if (key == "id") {
      int64_t id = 0;
      if (!Once(seen, 0) || !in_.Int(&id)) return false;
      manifest_.modules[self].id = id;
      return index_of_id_.emplace(id, self).second;  // ids are unique
    }
    if (key == "type") {
      absl::string_view type;
      if (!Once(seen, 1) || !in_.String(&type) || type.empty()) return false;
      manifest_.modules[self].type = std::string(type);
      return true;
    }
    if (key == "bases") {
      return Once(seen, 2) && in_.Array([&] {
        absl::string_view base;
        if (!in_.String(&base)) return false;
        manifest_.modules[self].bases.emplace_back(base);
        return true;
      });
    }
    if (key == "params") return Once(seen, 3) && ReadTensors(self, /*is_param=*/true);
    if (key == "buffers") return Once(seen, 4) && ReadTensors(self, /*is_param=*/false);
    if (key == "children") {
      return Once(seen, 5) && in_.Array([&] { return ReadChild(self, depth); });
    }
    return false;
  }

  bool ReadChild(int32_t self, int depth) {
    ChildDecl child;
    uint32_t seen = 0;
    bool ok = in_.Object([&](absl::string_view key) {
      if (key == "name") {
        absl::string_view name;
        if (!Once(&seen, 0) || !in_.String(&name) || !IsAttributeName(name)) return false;
        child.name = std::string(name);
        return true;
      }
      if (key == "module") return Once(&seen, 1) && ReadModule(depth + 1, &child.module);
      return false;
    });
    if (!ok || seen != 0b11) return false;
    manifest_.modules[self].children.push_back(std::move(child));
    return true;
  }

  // A ref names a module whose subtree is complete: defined earlier in pre-order and not an
  // ancestor of this position.
  bool ResolveRef(int64_t id, int depth, int32_t* index) {
    auto it = index_of_id_.find(id);
    if (it == index_of_id_.end()) return false;
    const int height = height_[it->second];
    if (height == 0 || depth - 1 + height > kMaxModuleDepth) return false;
    *index = it->second;
    return true;
  }

  bool ReadTensors(int32_t self, bool is_param) {
    return in_.Array([&] {
      TensorDecl decl;
      uint32_t seen = 0;
      bool ok = in_.Object([&](absl::string_view key) {
        if (key == "name") {
          absl::string_view name;
          if (!Once(&seen, 0) || !in_.String(&name) || !IsAttributeName(name)) return false;
          decl.name = std::string(name);
          return true;
        }
        if (key == "id") return Once(&seen, 1) && in_.Int(&decl.id);
        if (key == "shape") {
          return Once(&seen, 2) && in_.Array([&] {
            int64_t dim = 0;
            if (!in_.Int(&dim) || dim < 0) return false;
            decl.shape.push_back(dim);
            return true;
          });
        }
        if (key == "dtype") {
          absl::string_view name;
          if (!Once(&seen, 3) || !in_.String(&name)) return false;
          std::optional<DType> dtype = ParseDType(name);
          if (!dtype) return false;
          decl.dtype = *dtype;
          return true;
        }
        if (key == "requires_grad") return Once(&seen, 4) && in_.Bool(&decl.requires_grad);
        return false;
      });
      if (!ok || (seen & 0b1111) != 0b1111) return false;
      decl.numel = 1;
      for (int64_t d : decl.shape) {
        if (__builtin_mul_overflow(decl.numel, d, &decl.numel)) return false;
      }
      std::vector<TensorDecl>& list =
          is_param ? manifest_.modules[self].params : manifest_.modules[self].buffers;
      // Tied tensors (one id at several places) agree with the first declaration.
      auto [first, inserted] =
          (is_param ? params_seen_ : buffers_seen_).emplace(decl.id, TensorRef{self, list.size()});
      if (!inserted) {
        const ModuleDecl& m = manifest_.modules[first->second.module];
        const TensorDecl& f = (is_param ? m.params : m.buffers)[first->second.slot];
        if (f.shape != decl.shape || f.dtype != decl.dtype ||
            f.requires_grad != decl.requires_grad) {
          return false;
        }
      }
      list.push_back(std::move(decl));
      return true;
    });
  }

  // Parameter, buffer and child names share one namespace per module.
  bool NamesAreUnique(const ModuleDecl& m) {
    names_.clear();
    for (const TensorDecl& t : m.params) names_.push_back(t.name);
    for (const TensorDecl& t : m.buffers) names_.push_back(t.name);
    for (const ChildDecl& c : m.children) names_.push_back(c.name);
    std::sort(names_.begin(), names_.end());
    return std::adjacent_find(names_.begin(), names_.end()) == names_.end();
  }

  static bool Once(uint32_t* seen, int bit) { return JsonScanner::Once(seen, bit); }

  // Where a tensor id was first declared.
  struct TensorRef {
    int32_t module;
    size_t slot;
  };

  JsonScanner in_;
  Manifest manifest_;
  absl::flat_hash_map<int64_t, int32_t> index_of_id_;
  std::vector<int> height_;  // levels of each module's subtree, itself included; 0 while open
  absl::flat_hash_map<int64_t, TensorRef> params_seen_;
  absl::flat_hash_map<int64_t, TensorRef> buffers_seen_;
  std::vector<absl::string_view> names_;  // scratch of NamesAreUnique
};

}  // namespace

std::optional<Manifest> ReadValidManifest(absl::string_view text) {
  if (text.size() > kMaxJsonBytes) return std::nullopt;
  return ManifestReader(text).Read();
}

}  // namespace flatshard
