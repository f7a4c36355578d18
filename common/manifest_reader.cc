#include "common/manifest_reader.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/json_util.h"
#include "common/limits.h"

namespace flatshard {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

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
  explicit ManifestReader(absl::string_view text)
      : p_(text.data()), end_(text.data() + text.size()) {}

  std::optional<Manifest> Read() {
    if (!ReadDocument()) return std::nullopt;
    return std::move(manifest_);
  }

 private:
  // --- JSON lexing: only the spellings a writer of manifests uses. ---

  void SkipWs() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  bool Consume(char c) {
    if (p_ == end_ || *p_ != c) return false;
    ++p_;
    return true;
  }
  // A string without escapes, control characters or non-ASCII bytes (those go to the DOM
  // reader, which decodes escapes and checks UTF-8).
  bool String(absl::string_view* out) {
    if (!Consume('"')) return false;
    const char* start = p_;
    while (p_ < end_) {
      const auto c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        *out = absl::string_view(start, static_cast<size_t>(p_ - start));
        ++p_;
        return true;
      }
      if (c < 0x20 || c == '\\' || c >= 0x80) return false;
      ++p_;
    }
    return false;
  }
  // A JSON integer that fits int64: no fraction, exponent or leading zero (a number that
  // does not end at a delimiter fails where the caller expects one).
  bool Int(int64_t* out) {
    const bool negative = Consume('-');
    if (p_ == end_ || !IsDigit(*p_)) return false;
    uint64_t v = 0;
    if (*p_ == '0') {
      ++p_;
    } else {
      const char* start = p_;
      while (p_ < end_ && IsDigit(*p_)) {
        if (p_ - start == 19) return false;  // 19 digits cannot overflow uint64
        v = v * 10 + static_cast<uint64_t>(*p_ - '0');
        ++p_;
      }
    }
    const auto max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (v > max + (negative ? 1 : 0)) return false;
    *out = negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
    return true;
  }
  bool Bool(bool* out) {
    auto literal = [&](absl::string_view word) {
      if (static_cast<size_t>(end_ - p_) < word.size() ||
          std::memcmp(p_, word.data(), word.size()) != 0) {
        return false;
      }
      p_ += word.size();
      return true;
    };
    if (literal("true")) {
      *out = true;
      return true;
    }
    if (literal("false")) {
      *out = false;
      return true;
    }
    return false;
  }
  bool Open(char c) {
    if (!Consume(c)) return false;
    return ++depth_ <= kMaxJsonDepth;  // ParseJson's limit on bracket nesting
  }
  // An object: member(key) is called with the cursor on each value and must read it.
  template <typename F>
  bool Object(F&& member) {
    if (!Open('{')) return false;
    SkipWs();
    if (!Consume('}')) {
      do {
        SkipWs();
        absl::string_view key;
        if (!String(&key)) return false;
        SkipWs();
        if (!Consume(':')) return false;
        SkipWs();
        if (!member(key)) return false;
        SkipWs();
      } while (Consume(','));
      if (!Consume('}')) return false;
    }
    --depth_;
    return true;
  }
  // An array: element() is called with the cursor on each element and must read it.
  template <typename F>
  bool Array(F&& element) {
    if (!Open('[')) return false;
    SkipWs();
    if (!Consume(']')) {
      do {
        SkipWs();
        if (!element()) return false;
        SkipWs();
      } while (Consume(','));
      if (!Consume(']')) return false;
    }
    --depth_;
    return true;
  }
  // Marks member `bit` of an object as present; false when it was already (a duplicate key).
  static bool Once(uint32_t* seen, int bit) {
    if (*seen & (1u << bit)) return false;
    *seen |= 1u << bit;
    return true;
  }

  // --- The manifest (formats.md): the rules of ManifestParser. ---

  bool ReadDocument() {
    uint32_t seen = 0;
    bool ok = Object([&](absl::string_view key) {
      if (key == "format") {
        absl::string_view format;
        return Once(&seen, 0) && String(&format) && format == kManifestFormat;
      }
      if (key == "root") {
        int32_t root = 0;
        return Once(&seen, 1) && ReadModule(/*depth=*/1, &root);  // the root cannot be a ref
      }
      return false;
    });
    SkipWs();
    return ok && seen == 0b11 && p_ == end_;
  }

  // A module value: a module object or {"ref": ID} (ref only below the root). Its instance
  // index is the pre-order of first occurrence, taken at its first key, before any child's.
  bool ReadModule(int depth, int32_t* index) {
    enum { kEmpty, kRef, kModule } kind = kEmpty;
    int32_t self = -1;
    int64_t ref = 0;
    uint32_t seen = 0;
    bool ok = Object([&](absl::string_view key) {
      if (kind == kRef) return false;  // a ref has no other keys
      if (kind == kEmpty) {
        if (key == "ref") {
          kind = kRef;
          return depth > 1 && Int(&ref);
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
      if (!Once(seen, 0) || !Int(&id)) return false;
      manifest_.modules[self].id = id;
      return index_of_id_.emplace(id, self).second;  // ids are unique
    }
    if (key == "type") {
      absl::string_view type;
      if (!Once(seen, 1) || !String(&type) || type.empty()) return false;
      manifest_.modules[self].type = std::string(type);
      return true;
    }
    if (key == "bases") {
      return Once(seen, 2) && Array([&] {
               absl::string_view base;
               if (!String(&base)) return false;
               manifest_.modules[self].bases.emplace_back(base);
               return true;
             });
    }
    if (key == "params") return Once(seen, 3) && ReadTensors(self, /*is_param=*/true);
    if (key == "buffers") return Once(seen, 4) && ReadTensors(self, /*is_param=*/false);
    if (key == "children") {
      return Once(seen, 5) && Array([&] { return ReadChild(self, depth); });
    }
    return false;
  }

  bool ReadChild(int32_t self, int depth) {
    ChildDecl child;
    uint32_t seen = 0;
    bool ok = Object([&](absl::string_view key) {
      if (key == "name") {
        absl::string_view name;
        if (!Once(&seen, 0) || !String(&name) || !IsAttributeName(name)) return false;
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
    return Array([&] {
      TensorDecl decl;
      uint32_t seen = 0;
      bool ok = Object([&](absl::string_view key) {
        if (key == "name") {
          absl::string_view name;
          if (!Once(&seen, 0) || !String(&name) || !IsAttributeName(name)) return false;
          decl.name = std::string(name);
          return true;
        }
        if (key == "id") return Once(&seen, 1) && Int(&decl.id);
        if (key == "shape") {
          return Once(&seen, 2) && Array([&] {
                   int64_t dim = 0;
                   if (!Int(&dim) || dim < 0) return false;
                   decl.shape.push_back(dim);
                   return true;
                 });
        }
        if (key == "dtype") {
          absl::string_view name;
          if (!Once(&seen, 3) || !String(&name)) return false;
          std::optional<DType> dtype = ParseDType(name);
          if (!dtype) return false;
          decl.dtype = *dtype;
          return true;
        }
        if (key == "requires_grad") return Once(&seen, 4) && Bool(&decl.requires_grad);
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

  // Where a tensor id was first declared.
  struct TensorRef {
    int32_t module;
    size_t slot;
  };

  const char* p_;
  const char* const end_;
  int depth_ = 0;
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
