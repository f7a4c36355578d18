#pragma once
// The module tree a trainer registers (formats.md "Manifest"), as PyTorch's nn.Module holds it.
//
// A module instance registered at several paths is stored once; children refer to instances
// by index, so the tree is a DAG. Parsing guarantees: module ids are unique, every `ref`
// names a module defined earlier (so there are no cycles), names are valid attribute names,
// tied parameters (one tensor id at several places) agree on shape, dtype and requires_grad,
// and every numel fits in int64. Thread-safe for concurrent reads.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/json_util.h"

namespace flatshard {

inline constexpr absl::string_view kManifestFormat = "flatshard.manifest/1";
// Deeper module trees are refused (real models nest a few dozen levels; the JSON depth limit
// alone would allow about 170).
inline constexpr int kMaxModuleDepth = 160;

// One registration of a parameter or buffer on a module (`recurse=False`).
struct TensorDecl {
  std::string name;  // attribute name on its module
  int64_t id = 0;    // tensor identity: equal ids are one (tied) tensor
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  bool requires_grad = true;
  int64_t numel = 1;  // product of `shape` (1 for a scalar)

  friend bool operator==(const TensorDecl&, const TensorDecl&) = default;
};

struct ChildDecl {
  std::string name;
  int32_t module = 0;  // index into Manifest::modules
  friend bool operator==(const ChildDecl&, const ChildDecl&) = default;
};

struct ModuleDecl {
  int64_t id = 0;
  std::string type;
  std::vector<std::string> bases;  // nearest ancestor class first
  std::vector<TensorDecl> params;
  std::vector<TensorDecl> buffers;
  std::vector<ChildDecl> children;

  // isinstance-like: `type_name` is the class itself or one of its bases.
  bool IsInstanceOf(absl::string_view type_name) const;
  friend bool operator==(const ModuleDecl&, const ModuleDecl&) = default;
};

struct Manifest {
  // Instances in definition order (pre-order of first occurrence); modules[0] is the root.
  std::vector<ModuleDecl> modules;

  const ModuleDecl& root() const { return modules.front(); }
  friend bool operator==(const Manifest&, const Manifest&) = default;
};

// The module instance registered at `path` (a `.`-joined module FQN; "" is the root), or
// nullopt when no such path exists.
std::optional<int32_t> FindModulePath(const Manifest& manifest, absl::string_view path);

// Parses and validates a manifest document. INVALID_ARGUMENT names the JSON path and rule.
absl::StatusOr<Manifest> ManifestFromJson(absl::string_view text);
absl::StatusOr<Manifest> ManifestFromJsonValue(const Json& doc);
// Writes the canonical JSON form (refs for repeated instances).
Json ManifestToJson(const Manifest& manifest);
// Checks the invariants listed above on a manifest built in code (e.g. from protobuf).
absl::Status ValidateManifest(const Manifest& manifest);

}  // namespace flatshard
