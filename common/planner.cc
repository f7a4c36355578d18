#include "common/planner.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/flat_layout.h"
#include "common/status_macros.h"

namespace flatshard {
namespace {

std::string JoinPath(absl::string_view prefix, absl::string_view name) {
  return prefix.empty() ? std::string(name) : absl::StrCat(prefix, ".", name);
}

// Python's repr of a list of strings, as FSDP's messages print FQN lists.
std::string PyList(const std::vector<std::string>& items) {
  return absl::StrCat("[",
                      absl::StrJoin(items, ", ",
                                    [](std::string* out, const std::string& s) {
                                      absl::StrAppend(out, "'", s, "'");
                                    }),
                      "]");
}

std::string ModuleName(absl::string_view path) {
  return path.empty() ? std::string("the root module") : absl::StrCat("module ", Quote(path));
}

bool IsInstanceOfAny(const ModuleDecl& m, const std::vector<std::string>& types) {
  for (const std::string& t : types) {
    if (m.IsInstanceOf(t)) return true;
  }
  return false;
}

// One distinct tensor (parameter identity) of the manifest.
struct TensorInfo {
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
  bool requires_grad = true;
  bool ignored = false;
  int32_t unit = -1;   // formation index of the unit that holds it
  uint32_t stamp = 0;  // epoch marker for distinct counting
};

// A unit as formed (post-order); sorted into pre-order at the end.
struct FormedUnit {
  int32_t module = 0;
  std::string path;
  std::vector<int32_t> tensors;  // distinct, flat order
  PlanUnit unit;
};

class Planner {
 public:
  Planner(const Manifest& manifest, const Policy& policy, const PlanOptions& options)
      : manifest_(manifest), policy_(policy), options_(options) {}

  absl::StatusOr<Plan> Run() {
    FS_RETURN_IF_ERROR(CheckOptions());
    FS_RETURN_IF_ERROR(IndexTensors());
    FS_RETURN_IF_ERROR(CheckExpandedSize());
    FS_RETURN_IF_ERROR(ResolveIgnored());
    FS_RETURN_IF_ERROR(ResolveExplicitPaths(policy_.auto_wrap, "policy: $.auto_wrap"));
    SetUpEffectivePolicy();

    const int32_t root = 0;
    is_unit_.assign(manifest_.modules.size(), false);
    if (policy_.auto_wrap.kind != AutoWrapKind::kNone && !module_ignored_[root]) {
      FS_RETURN_IF_ERROR(Wrap(root, "", /*only_children=*/true).status());
    }
    if (!module_ignored_[root]) FS_RETURN_IF_ERROR(FormUnit(root, ""));
    return Finish();
  }

 private:
  absl::Status CheckOptions() {
    if (options_.world_size < 1 || options_.world_size > kMaxWorldSize) {
      return absl::InvalidArgumentError(
          absl::StrCat(options_.world_size < 1 ? "world size must be at least 1, got "
                                               : "world size must be at most 1048576, got ",
                       options_.world_size));
    }
    plan_.world_size = options_.world_size;
    plan_.sharding_strategy = policy_.sharding_strategy;
    plan_.use_orig_params = policy_.use_orig_params;
    switch (policy_.sharding_strategy) {
      case ShardingStrategy::kNoShard:
        plan_.shard_world_size = 1;
        break;
      case ShardingStrategy::kHybridShard:
      case ShardingStrategy::kHybridShardZero2: {
        int32_t per_node =
            options_.ranks_per_node == 0 ? options_.world_size : options_.ranks_per_node;
        if (per_node < 1 || options_.world_size % per_node != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(ShardingStrategyName(policy_.sharding_strategy), ": ranks per node ",
                           per_node, " must be >= 1 and divide world size ", options_.world_size));
        }
        plan_.shard_world_size = per_node;
        break;
      }
      default:
        plan_.shard_world_size = options_.world_size;
    }
    return absl::OkStatus();
  }

  absl::Status IndexTensors() {
    const size_t n = manifest_.modules.size();
    if (n == 0) return absl::InvalidArgumentError("manifest: no root module");
    param_tensor_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      for (const TensorDecl& p : manifest_.modules[i].params) {
        auto [it, inserted] =
            tensor_of_id_.try_emplace(p.id, static_cast<int32_t>(tensors_.size()));
        if (inserted) {
          tensors_.push_back(TensorInfo{p.numel, p.dtype, p.requires_grad});
        }
        param_tensor_[i].push_back(it->second);
      }
    }
    return absl::OkStatus();
  }

  // Refs can make the expanded tree exponential in the manifest's size; every traversal below
  // is bounded by its size, so check it first.
  absl::Status CheckExpandedSize() {
    // Per module, over its expanded subtree (itself included): how many module paths, and how
    // many bytes of relative module paths and parameter FQNs the planner will build. Children
    // complete before parents (refs only name completed modules), so a memoized DFS
    // terminates; iterative to stay off the stack. Sums saturate just past the limits.
    struct Size {
      int64_t paths = -1;       // module paths
      int64_t path_bytes = 0;   // bytes of the relative module paths
      int64_t params = 0;       // parameter occurrences
      int64_t param_bytes = 0;  // bytes of the relative parameter FQNs
    };
    const size_t n = manifest_.modules.size();
    const int64_t path_limit = options_.max_module_paths;
    const int64_t byte_limit = options_.max_name_bytes;
    auto add = [](int64_t a, int64_t b, int64_t cap) {
      int64_t out;
      return __builtin_add_overflow(a, b, &out) || out > cap ? cap + 1 : out;
    };
    auto mul = [](int64_t a, int64_t b, int64_t cap) {
      int64_t out;
      return __builtin_mul_overflow(a, b, &out) || out > cap ? cap + 1 : out;
    };
    std::vector<Size> size(n);
    std::vector<Size> acc(n);
    auto enter = [&](int32_t m) {
      const ModuleDecl& mod = manifest_.modules[m];
      acc[m] = Size{1, 0, static_cast<int64_t>(mod.params.size()), 0};
      for (const TensorDecl& p : mod.params) {
        acc[m].param_bytes = add(acc[m].param_bytes, p.name.size(), byte_limit);
      }
    };
    std::vector<std::pair<int32_t, size_t>> stack = {{0, 0}};
    enter(0);
    while (!stack.empty()) {
      auto& [m, next] = stack.back();
      const ModuleDecl& mod = manifest_.modules[m];
      if (next < mod.children.size()) {
        const ChildDecl& child = mod.children[next];
        const Size& c = size[child.module];
        if (c.paths < 0) {
          enter(child.module);
          stack.emplace_back(child.module, 0);
          continue;
        }
        const int64_t prefix = static_cast<int64_t>(child.name.size()) + 1;  // "name."
        Size& a = acc[m];
        a.paths = add(a.paths, c.paths, path_limit);
        a.path_bytes =
            add(a.path_bytes, add(c.path_bytes, mul(c.paths, prefix, byte_limit), byte_limit),
                byte_limit);
        a.params = add(a.params, c.params, path_limit);
        a.param_bytes =
            add(a.param_bytes, add(c.param_bytes, mul(c.params, prefix, byte_limit), byte_limit),
                byte_limit);
        ++next;
        continue;
      }
      size[m] = acc[m];
      stack.pop_back();
    }
    if (size[0].paths > path_limit || size[0].params > path_limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: the module tree has more than ", path_limit,
                       " module paths once shared modules (refs) are expanded at every path"));
    }
    if (size[0].path_bytes > byte_limit || size[0].param_bytes > byte_limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: module paths and parameter names take more than ", byte_limit,
                       " bytes once shared modules (refs) are expanded at every path"));
    }
    return absl::OkStatus();
  }

  absl::Status ResolveIgnored() {
    const size_t n = manifest_.modules.size();
    module_ignored_.assign(n, false);
    for (size_t i = 0; i < policy_.ignored_modules.size(); ++i) {
      const std::string& path = policy_.ignored_modules[i];
      auto m = FindModulePath(manifest_, path);
      if (!m) {
        return absl::InvalidArgumentError(
            absl::StrCat("policy: $.ignored_modules[", i, "]: no module at path ", Quote(path)));
      }
      if (*m == 0) {
        plan_.warnings.push_back(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will "
            "result in all parameters being ignored and is not well-supported");
      }
      // The instance and its whole subtree, wherever else they are registered.
      std::vector<int32_t> stack = {*m};
      while (!stack.empty()) {
        int32_t x = stack.back();
        stack.pop_back();
        if (module_ignored_[x]) continue;
        module_ignored_[x] = true;
        for (int32_t t : param_tensor_[x]) tensors_[t].ignored = true;
        for (const ChildDecl& c : manifest_.modules[x].children) stack.push_back(c.module);
      }
    }
    for (size_t i = 0; i < policy_.ignored_params.size(); ++i) {
      const std::string& fqn = policy_.ignored_params[i];
      size_t dot = fqn.rfind('.');
      absl::string_view module_path =
          dot == std::string::npos ? "" : absl::string_view(fqn).substr(0, dot);
      absl::string_view name = dot == std::string::npos ? absl::string_view(fqn)
                                                        : absl::string_view(fqn).substr(dot + 1);
      auto m = FindModulePath(manifest_, module_path);
      bool found = false;
      if (m) {
        const auto& params = manifest_.modules[*m].params;
        for (size_t p = 0; p < params.size(); ++p) {
          if (params[p].name == name) {
            tensors_[param_tensor_[*m][p]].ignored = true;
            found = true;
            break;
          }
        }
      }
      if (!found) {
        return absl::InvalidArgumentError(
            absl::StrCat("policy: $.ignored_params[", i, "]: no parameter ", Quote(fqn)));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ResolveExplicitPaths(const AutoWrapPolicy& p, const std::string& where) {
    if (p.kind == AutoWrapKind::kExplicit) {
      for (size_t i = 0; i < p.paths.size(); ++i) {
        auto m = FindModulePath(manifest_, p.paths[i]);
        if (!m) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".paths[", i, "]: no module at path ", Quote(p.paths[i])));
        }
        explicit_modules_[&p].push_back(*m);
      }
    }
    for (size_t i = 0; i < p.policies.size(); ++i) {
      FS_RETURN_IF_ERROR(
          ResolveExplicitPaths(p.policies[i], absl::StrCat(where, ".policies[", i, "]")));
    }
    return absl::OkStatus();
  }

  // FSDP wraps modules of MixedPrecision._module_classes_to_ignore separately (as
  // `_or_policy(policy, _wrap_module_cls_individually)`), but only with an auto-wrap policy.
  void SetUpEffectivePolicy() {
    effective_ = &policy_.auto_wrap;
    if (policy_.auto_wrap.kind == AutoWrapKind::kNone || !policy_.mixed_precision ||
        policy_.mixed_precision->module_types_to_ignore.empty()) {
      return;
    }
    const auto& types = policy_.mixed_precision->module_types_to_ignore;
    mp_override_.kind = AutoWrapKind::kAny;
    mp_override_.policies.push_back(policy_.auto_wrap);
    AutoWrapPolicy individually;
    individually.kind = AutoWrapKind::kModuleTypes;
    individually.types = types;
    mp_override_.policies.push_back(std::move(individually));
    // The copy's explicit members must resolve like the original's.
    CopyExplicit(policy_.auto_wrap, mp_override_.policies[0]);
    effective_ = &mp_override_;
    std::vector<std::string> overridden;  // type(m) of every module that is such an instance
    for (const ModuleDecl& m : manifest_.modules) {
      if (IsInstanceOfAny(m, types) &&
          std::find(overridden.begin(), overridden.end(), m.type) == overridden.end()) {
        overridden.push_back(m.type);
      }
    }
    if (!overridden.empty()) {
      std::sort(overridden.begin(), overridden.end());
      plan_.warnings.push_back(absl::StrCat(
          "Both mixed precision and an auto_wrap_policy were specified, where the wrapped "
          "module has submodules of type: {",
          absl::StrJoin(overridden, ", "),
          "}. These modules will be wrapped as separate units with mixed precision disabled."));
    }
  }

  // FSDP's MixedPrecision at run time: compute summons in param_dtype, gradients reduced in
  // reduce_dtype (param_dtype when unset, as FSDP, whose gradients come in param_dtype).
  // A unit rooted at a module of module_types_to_ignore keeps full precision (FSDP wraps it
  // with mixed_precision=None); set only where it differs from the shards' dtype.
  void SetPrecision(const ModuleDecl& root, PlanUnit* unit) const {
    if (!policy_.mixed_precision) return;
    const MixedPrecision& mp = *policy_.mixed_precision;
    if (IsInstanceOfAny(root, mp.module_types_to_ignore)) return;
    if (mp.param_dtype && *mp.param_dtype != unit->dtype) unit->compute_dtype = mp.param_dtype;
    const std::optional<DType> reduce = mp.reduce_dtype ? mp.reduce_dtype : mp.param_dtype;
    if (reduce && *reduce != unit->dtype) unit->reduce_dtype = reduce;
  }

  void CopyExplicit(const AutoWrapPolicy& from, const AutoWrapPolicy& to) {
    if (auto it = explicit_modules_.find(&from); it != explicit_modules_.end()) {
      explicit_modules_[&to] = it->second;
    }
    for (size_t i = 0; i < from.policies.size(); ++i)
      CopyExplicit(from.policies[i], to.policies[i]);
  }

  // The policy callable of FSDP: `recurse=true` asks whether to descend, `recurse=false`
  // whether to wrap given the not-yet-wrapped numel.
  bool Evaluate(const AutoWrapPolicy& p, int32_t m, bool recurse, int64_t numel) const {
    const ModuleDecl& mod = manifest_.modules[m];
    switch (p.kind) {
      case AutoWrapKind::kNone:
        return false;
      case AutoWrapKind::kAlways:
        return true;
      case AutoWrapKind::kSizeBased: {
        const bool is_large = numel >= p.min_num_params;
        return is_large &&
               !IsInstanceOfAny(mod, recurse ? p.force_leaf_types : p.exclude_wrap_types);
      }
      case AutoWrapKind::kModuleTypes:
        return recurse || IsInstanceOfAny(mod, p.types);
      case AutoWrapKind::kExplicit: {
        if (recurse) return true;
        auto it = explicit_modules_.find(&p);
        return it != explicit_modules_.end() &&
               std::find(it->second.begin(), it->second.end(), m) != it->second.end();
      }
      case AutoWrapKind::kAny:
        for (const AutoWrapPolicy& member : p.policies) {
          if (Evaluate(member, m, recurse, numel)) return true;
        }
        return false;
    }
    return false;
  }

  // Numel of the distinct tensors under `m` that are neither ignored nor in a unit.
  int64_t UnwrappedNumel(int32_t m) {
    ++epoch_;
    int64_t total = 0;
    std::vector<int32_t> stack = {m};
    module_stamp_.resize(manifest_.modules.size(), 0);
    while (!stack.empty()) {
      int32_t x = stack.back();
      stack.pop_back();
      if (module_stamp_[x] == epoch_ || module_ignored_[x] || (x != m && is_unit_[x])) continue;
      module_stamp_[x] = epoch_;
      for (int32_t t : param_tensor_[x]) {
        TensorInfo& info = tensors_[t];
        if (info.stamp == epoch_ || info.ignored || info.unit >= 0) continue;
        info.stamp = epoch_;
        // Saturates: past 2^63 every size policy's answer is the same anyway.
        if (__builtin_add_overflow(total, info.numel, &total)) {
          total = std::numeric_limits<int64_t>::max();
        }
      }
      for (const ChildDecl& c : manifest_.modules[x].children) stack.push_back(c.module);
    }
    return total;
  }

  // FSDP's `_recursive_wrap`; returns the numel it wrapped.
  absl::StatusOr<int64_t> Wrap(int32_t m, const std::string& path, bool only_children) {
    if (is_unit_[m]) return 0;
    const int64_t numel = UnwrappedNumel(m);
    if (!Evaluate(*effective_, m, /*recurse=*/true, numel)) return 0;
    int64_t wrapped = 0;
    for (const ChildDecl& c : manifest_.modules[m].children) {
      if (module_ignored_[c.module]) continue;
      FS_ASSIGN_OR_RETURN(int64_t w, Wrap(c.module, JoinPath(path, c.name), false));
      if (__builtin_add_overflow(wrapped, w, &wrapped)) {
        wrapped = std::numeric_limits<int64_t>::max();  // saturates, like UnwrappedNumel
      }
    }
    if (!only_children && Evaluate(*effective_, m, /*recurse=*/false, numel - wrapped)) {
      FS_RETURN_IF_ERROR(FormUnit(m, path));
      return numel;
    }
    return wrapped;
  }

  // Marks `m` (reached at `path`) as a unit and flattens what its subtree still holds.
  absl::Status FormUnit(int32_t m, const std::string& path) {
    is_unit_[m] = true;
    FormedUnit formed;
    formed.module = m;
    formed.path = path;
    PlanUnit& unit = formed.unit;
    unit.module = path;
    unit.module_type = manifest_.modules[m].type;
    const int32_t unit_id = static_cast<int32_t>(formed_.size());
    // named_modules(remove_duplicate=False) pre-order: a shared instance is walked at every
    // path, so later FQNs of a tensor in this unit become `shared` entries.
    absl::flat_hash_map<int32_t, size_t> first_fqn;  // tensor -> index into unit.params
    struct Frame {
      int32_t module;
      std::string path;
    };
    std::vector<Frame> stack = {{m, path}};
    while (!stack.empty()) {
      Frame f = std::move(stack.back());
      stack.pop_back();
      if (module_ignored_[f.module] || (f.module != m && is_unit_[f.module])) continue;
      const ModuleDecl& mod = manifest_.modules[f.module];
      for (size_t p = 0; p < mod.params.size(); ++p) {
        const int32_t t = param_tensor_[f.module][p];
        TensorInfo& info = tensors_[t];
        if (info.ignored || (info.unit >= 0 && info.unit != unit_id)) continue;
        std::string fqn = JoinPath(f.path, mod.params[p].name);
        if (info.unit == unit_id) {
          unit.shared.push_back(SharedParam{std::move(fqn), unit.params[first_fqn[t]].fqn});
          continue;
        }
        info.unit = unit_id;
        first_fqn[t] = unit.params.size();
        formed.tensors.push_back(t);
        unit.params.push_back(PlanParam{std::move(fqn), mod.params[p].shape, info.numel, 0});
      }
      for (auto c = mod.children.rbegin(); c != mod.children.rend(); ++c) {
        stack.push_back(Frame{c->module, JoinPath(f.path, c->name)});
      }
    }
    if (unit.params.empty()) return absl::OkStatus();  // FSDP makes no FlatParameter
    FS_RETURN_IF_ERROR(CheckFlattenable(formed));
    formed_.push_back(std::move(formed));
    return absl::OkStatus();
  }

  // FlatParamHandle's `_validate_tensors_to_flatten` and FSDP's `_validate_frozen_params`.
  absl::Status CheckFlattenable(FormedUnit& formed) {
    PlanUnit& unit = formed.unit;
    const std::string where = absl::StrCat("unit of ", ModuleName(formed.path));
    const TensorInfo& first = tensors_[formed.tensors[0]];
    std::vector<std::string> trainable, frozen;
    int64_t trainable_numel = 0, frozen_numel = 0;
    for (size_t i = 0; i < formed.tensors.size(); ++i) {
      const TensorInfo& info = tensors_[formed.tensors[i]];
      const std::string& fqn = unit.params[i].fqn;
      if (!IsFloatingPoint(info.dtype)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": Cannot flatten integer dtype tensors: parameter ", fqn,
                         " has dtype ", DTypeName(info.dtype)));
      }
      if (info.dtype != first.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": Must flatten tensors with uniform dtype but got ", DTypeName(first.dtype),
            " (", unit.params[0].fqn, ") and ", DTypeName(info.dtype), " (", fqn, ")"));
      }
      (info.requires_grad ? trainable : frozen).push_back(fqn);
      int64_t& sum = info.requires_grad ? trainable_numel : frozen_numel;
      if (__builtin_add_overflow(sum, info.numel, &sum)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": flat buffer would exceed 2^63 elements"));
      }
    }
    int64_t total_numel = 0;
    if (__builtin_add_overflow(trainable_numel, frozen_numel, &total_numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": flat buffer would exceed 2^63 elements"));
    }
    unit.dtype = first.dtype;
    unit.requires_grad = !trainable.empty();
    if (!trainable.empty() && !frozen.empty()) {
      std::string msg = absl::StrCat(formed.path.empty() ? "The root module" : Quote(formed.path),
                                     " has both parameters with requires_grad=True and False.");
      if (policy_.use_orig_params) {
        absl::StrAppend(&msg,
                        " We do not recommend wrapping such modules since the gradient memory "
                        "usage will be higher than expected (",
                        total_numel, " numel instead of ", trainable_numel,
                        " numel before sharding via reduce-scatter; ", frozen_numel,
                        " extra gradient numel).");
      } else {
        absl::StrAppend(&msg,
                        " FSDP does not support wrapping such modules when "
                        "use_orig_params=False.");
      }
      absl::StrAppend(&msg,
                      " If possible, wrap the frozen parameters with FSDP separately. The "
                      "following parameters have requires_grad=True: ",
                      PyList(trainable),
                      " The following parameters have requires_grad=False: ", PyList(frozen));
      if (!policy_.use_orig_params) return absl::InvalidArgumentError(msg);
      plan_.warnings.push_back(std::move(msg));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Plan> Finish() {
    // Pre-order of first occurrence (modules() order) of every instance.
    std::vector<int32_t> preorder(manifest_.modules.size(), -1);
    int32_t next = 0;
    std::vector<int32_t> stack = {0};
    while (!stack.empty()) {
      int32_t x = stack.back();
      stack.pop_back();
      if (preorder[x] >= 0) continue;
      preorder[x] = next++;
      const auto& children = manifest_.modules[x].children;
      for (auto c = children.rbegin(); c != children.rend(); ++c) stack.push_back(c->module);
    }
    std::sort(formed_.begin(), formed_.end(), [&](const FormedUnit& a, const FormedUnit& b) {
      return preorder[a.module] < preorder[b.module];
    });
    for (size_t i = 0; i < formed_.size(); ++i) {
      PlanUnit& unit = formed_[i].unit;
      unit.index = static_cast<int32_t>(i);
      absl::StatusOr<FlatLayout> made = UnitLayout(plan_, unit);
      if (!made.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit of ", ModuleName(unit.module), ": ", made.status().message()));
      }
      const FlatLayout& layout = *made;
      // The flat buffer's bytes must fit in int64 (and so in size_t and off_t), or every
      // allocation of it overflows: refuse here, naming the largest parameter.
      int64_t padded_bytes = 0;
      if (__builtin_mul_overflow(layout.padded_numel(), ItemSize(unit.dtype), &padded_bytes)) {
        const PlanParam* largest = &unit.params[0];
        for (const PlanParam& p : unit.params) {
          if (p.numel > largest->numel) largest = &p;
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "unit of ", ModuleName(unit.module), ": its flat buffer of ", layout.padded_numel(),
            " ", DTypeName(unit.dtype), " elements exceeds 2^63 bytes; largest parameter ",
            largest->fqn, " has shape [", absl::StrJoin(largest->shape, ", "), "]"));
      }
      for (size_t p = 0; p < unit.params.size(); ++p) unit.params[p].offset = layout.offsets()[p];
      unit.numel = layout.numel();
      unit.padded_numel = layout.padded_numel();
      unit.shard_numel = layout.shard_numel();
      SetPrecision(manifest_.modules[formed_[i].module], &unit);
      plan_.units.push_back(std::move(unit));
    }
    // Ignored parameters by every FQN they have, in named_parameters(remove_duplicate=False)
    // order: those are the state-dict keys the trainer keeps for itself.
    struct Frame {
      int32_t module;
      std::string path;
    };
    std::vector<Frame> frames = {{0, ""}};
    while (!frames.empty()) {
      Frame f = std::move(frames.back());
      frames.pop_back();
      const ModuleDecl& mod = manifest_.modules[f.module];
      for (size_t p = 0; p < mod.params.size(); ++p) {
        if (tensors_[param_tensor_[f.module][p]].ignored) {
          plan_.ignored_params.push_back(JoinPath(f.path, mod.params[p].name));
        }
      }
      for (auto c = mod.children.rbegin(); c != mod.children.rend(); ++c) {
        frames.push_back(Frame{c->module, JoinPath(f.path, c->name)});
      }
    }
    plan_.fingerprint = Fingerprint(plan_);
    return std::move(plan_);
  }

  const Manifest& manifest_;
  const Policy& policy_;
  const PlanOptions& options_;

  std::vector<TensorInfo> tensors_;
  absl::flat_hash_map<int64_t, int32_t> tensor_of_id_;
  std::vector<std::vector<int32_t>> param_tensor_;  // module -> tensor index per param
  std::vector<bool> module_ignored_;
  std::vector<bool> is_unit_;
  std::vector<uint32_t> module_stamp_;
  uint32_t epoch_ = 0;
  absl::flat_hash_map<const AutoWrapPolicy*, std::vector<int32_t>> explicit_modules_;
  AutoWrapPolicy mp_override_;
  const AutoWrapPolicy* effective_ = nullptr;
  std::vector<FormedUnit> formed_;
  Plan plan_;
};

}  // namespace

absl::StatusOr<Plan> BuildPlan(const Manifest& manifest, const Policy& policy,
                               const PlanOptions& options) {
  return Planner(manifest, policy, options).Run();
}

}  // namespace flatshard
