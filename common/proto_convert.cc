#include "common/proto_convert.h"

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/plan_json_writer.h"
#include "common/status_macros.h"

namespace flatshard {
namespace {

// The proto enums are the domain enums shifted by one (0 is UNSPECIFIED).
v1::DType DTypeToProto(DType d) { return static_cast<v1::DType>(static_cast<int>(d) + 1); }

absl::StatusOr<DType> DTypeFromProto(v1::DType d, absl::string_view where) {
  if (d <= v1::DTYPE_UNSPECIFIED || d > v1::DTYPE_BOOL) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype is unspecified or unknown (", static_cast<int>(d), ")"));
  }
  return static_cast<DType>(static_cast<int>(d) - 1);
}

void TensorsToProto(const std::vector<TensorDecl>& in,
                    google::protobuf::RepeatedPtrField<v1::TensorDecl>* out) {
  for (const TensorDecl& t : in) {
    v1::TensorDecl* p = out->Add();
    p->set_name(t.name);
    p->set_id(t.id);
    p->mutable_shape()->Add(t.shape.begin(), t.shape.end());
    p->set_dtype(DTypeToProto(t.dtype));
    p->set_requires_grad(t.requires_grad);
  }
}

absl::StatusOr<std::vector<TensorDecl>> TensorsFromProto(
    const google::protobuf::RepeatedPtrField<v1::TensorDecl>& in, absl::string_view where) {
  std::vector<TensorDecl> out;
  for (const v1::TensorDecl& p : in) {
    TensorDecl t;
    t.name = p.name();
    t.id = p.id();
    t.shape.assign(p.shape().begin(), p.shape().end());
    FS_ASSIGN_OR_RETURN(t.dtype, DTypeFromProto(p.dtype(), absl::StrCat(where, " ", p.name())));
    t.requires_grad = p.requires_grad();
    t.numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || __builtin_mul_overflow(t.numel, d, &t.numel)) t.numel = -1;
    }
    out.push_back(std::move(t));
  }
  return out;
}

v1::AutoWrapPolicy AutoWrapToProto(const AutoWrapPolicy& p) {
  v1::AutoWrapPolicy out;
  out.set_kind(static_cast<v1::AutoWrapKind>(static_cast<int>(p.kind) + 1));
  out.set_min_num_params(p.min_num_params);
  for (const auto& s : p.force_leaf_types) out.add_force_leaf_types(s);
  for (const auto& s : p.exclude_wrap_types) out.add_exclude_wrap_types(s);
  for (const auto& s : p.types) out.add_types(s);
  for (const auto& s : p.paths) out.add_paths(s);
  for (const auto& m : p.policies) *out.add_policies() = AutoWrapToProto(m);
  return out;
}

absl::StatusOr<AutoWrapPolicy> AutoWrapFromProto(const v1::AutoWrapPolicy& p, int depth) {
  // Each `any` level is two JSON levels; deeper is refused as the JSON form would be.
  if (depth > kMaxJsonDepth / 2) {
    return absl::InvalidArgumentError("policy: auto_wrap policies nest too deep");
  }
  if (p.kind() <= v1::AUTO_WRAP_KIND_UNSPECIFIED || p.kind() > v1::AUTO_WRAP_KIND_ANY) {
    return absl::InvalidArgumentError("policy: auto_wrap.kind is unspecified or unknown");
  }
  AutoWrapPolicy out;
  out.kind = static_cast<AutoWrapKind>(static_cast<int>(p.kind()) - 1);
  out.min_num_params = p.min_num_params();
  out.force_leaf_types.assign(p.force_leaf_types().begin(), p.force_leaf_types().end());
  out.exclude_wrap_types.assign(p.exclude_wrap_types().begin(), p.exclude_wrap_types().end());
  out.types.assign(p.types().begin(), p.types().end());
  out.paths.assign(p.paths().begin(), p.paths().end());
  for (const auto& m : p.policies()) {
    FS_ASSIGN_OR_RETURN(AutoWrapPolicy member, AutoWrapFromProto(m, depth + 1));
    out.policies.push_back(std::move(member));
  }
  return out;
}

absl::StatusOr<ShardingStrategy> StrategyFromProto(v1::ShardingStrategy s, absl::string_view doc) {
  if (s <= v1::SHARDING_STRATEGY_UNSPECIFIED || s > v1::SHARDING_STRATEGY_HYBRID_SHARD_ZERO2) {
    return absl::InvalidArgumentError(
        absl::StrCat(doc, ": sharding_strategy is unspecified or unknown"));
  }
  return static_cast<ShardingStrategy>(static_cast<int>(s) - 1);
}

v1::ShardingStrategy StrategyToProto(ShardingStrategy s) {
  return static_cast<v1::ShardingStrategy>(static_cast<int>(s) + 1);
}

}  // namespace

v1::Manifest ToProto(const Manifest& manifest) {
  v1::Manifest out;
  out.set_format(std::string(kManifestFormat));
  for (const ModuleDecl& m : manifest.modules) {
    v1::ModuleDecl* p = out.add_modules();
    p->set_id(m.id);
    p->set_type(m.type);
    for (const auto& b : m.bases) p->add_bases(b);
    TensorsToProto(m.params, p->mutable_params());
    TensorsToProto(m.buffers, p->mutable_buffers());
    for (const ChildDecl& c : m.children) {
      v1::ModuleChild* child = p->add_children();
      child->set_name(c.name);
      child->set_module(c.module);
    }
  }
  return out;
}

absl::StatusOr<Manifest> FromProto(const v1::Manifest& proto) {
  if (proto.format() != kManifestFormat) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest: unknown format ", Quote(proto.format()), ", expected ", Quote(kManifestFormat)));
  }
  // Counted before anything is converted: a huge manifest is refused for the cost of reading
  // two counters per module.
  if (proto.modules_size() > kMaxManifestModules) {
    return absl::InvalidArgumentError(absl::StrCat("manifest: ", proto.modules_size(),
                                                   " module instances, the limit is ",
                                                   kMaxManifestModules));
  }
  int64_t tensors = 0;
  for (const v1::ModuleDecl& p : proto.modules()) tensors += p.params_size() + p.buffers_size();
  if (tensors > kMaxManifestTensors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest: ", tensors, " parameters and buffers, the limit is ", kMaxManifestTensors));
  }
  Manifest manifest;
  manifest.modules.reserve(proto.modules_size());
  for (int i = 0; i < proto.modules_size(); ++i) {
    const v1::ModuleDecl& p = proto.modules(i);
    ModuleDecl m;
    m.id = p.id();
    m.type = p.type();
    m.bases.assign(p.bases().begin(), p.bases().end());
    const std::string where = absl::StrCat("manifest: module ", p.id());
    FS_ASSIGN_OR_RETURN(m.params, TensorsFromProto(p.params(), where));
    FS_ASSIGN_OR_RETURN(m.buffers, TensorsFromProto(p.buffers(), where));
    for (const v1::ModuleChild& c : p.children()) m.children.push_back({c.name(), c.module()});
    manifest.modules.push_back(std::move(m));
  }
  FS_RETURN_IF_ERROR(ValidateManifest(manifest));
  return manifest;
}

v1::Policy ToProto(const Policy& policy) {
  v1::Policy out;
  out.set_format(std::string(kPolicyFormat));
  *out.mutable_auto_wrap() = AutoWrapToProto(policy.auto_wrap);
  for (const auto& s : policy.ignored_modules) out.add_ignored_modules(s);
  for (const auto& s : policy.ignored_params) out.add_ignored_params(s);
  out.set_use_orig_params(policy.use_orig_params);
  out.set_sharding_strategy(StrategyToProto(policy.sharding_strategy));
  if (policy.mixed_precision) {
    const MixedPrecision& mp = *policy.mixed_precision;
    v1::MixedPrecision* p = out.mutable_mixed_precision();
    if (mp.param_dtype) p->set_param_dtype(DTypeToProto(*mp.param_dtype));
    if (mp.reduce_dtype) p->set_reduce_dtype(DTypeToProto(*mp.reduce_dtype));
    if (mp.buffer_dtype) p->set_buffer_dtype(DTypeToProto(*mp.buffer_dtype));
    for (const auto& s : mp.module_types_to_ignore) p->add_module_types_to_ignore(s);
  }
  return out;
}

absl::StatusOr<Policy> FromProto(const v1::Policy& proto) {
  if (proto.format() != kPolicyFormat) {
    return absl::InvalidArgumentError(absl::StrCat("policy: unknown format ", Quote(proto.format()),
                                                   ", expected ", Quote(kPolicyFormat)));
  }
  Policy policy;
  FS_ASSIGN_OR_RETURN(policy.auto_wrap, AutoWrapFromProto(proto.auto_wrap(), 0));
  policy.ignored_modules.assign(proto.ignored_modules().begin(), proto.ignored_modules().end());
  policy.ignored_params.assign(proto.ignored_params().begin(), proto.ignored_params().end());
  policy.use_orig_params = proto.use_orig_params();
  FS_ASSIGN_OR_RETURN(policy.sharding_strategy,
                      StrategyFromProto(proto.sharding_strategy(), "policy"));
  if (proto.has_mixed_precision()) {
    const v1::MixedPrecision& p = proto.mixed_precision();
    MixedPrecision mp;
    if (p.has_param_dtype()) {
      FS_ASSIGN_OR_RETURN(mp.param_dtype, DTypeFromProto(p.param_dtype(), "policy: param_dtype"));
    }
    if (p.has_reduce_dtype()) {
      FS_ASSIGN_OR_RETURN(mp.reduce_dtype,
                          DTypeFromProto(p.reduce_dtype(), "policy: reduce_dtype"));
    }
    if (p.has_buffer_dtype()) {
      FS_ASSIGN_OR_RETURN(mp.buffer_dtype,
                          DTypeFromProto(p.buffer_dtype(), "policy: buffer_dtype"));
    }
    mp.module_types_to_ignore.assign(p.module_types_to_ignore().begin(),
                                     p.module_types_to_ignore().end());
    policy.mixed_precision = std::move(mp);
  }
  // Same rules as the JSON form, nesting limits included: check the text it would be.
  FS_RETURN_IF_ERROR(
      PolicyFromJson(PolicyToJson(policy).dump(-1, ' ', false, Json::error_handler_t::replace))
          .status());
  return policy;
}

v1::Plan ToProto(const Plan& plan) {
  v1::Plan out;
  out.set_format(std::string(kPlanFormat));
  out.set_world_size(plan.world_size);
  out.set_sharding_strategy(StrategyToProto(plan.sharding_strategy));
  out.set_shard_world_size(plan.shard_world_size);
  out.set_use_orig_params(plan.use_orig_params);
  for (const PlanUnit& u : plan.units) {
    v1::PlanUnit* p = out.add_units();
    p->set_index(u.index);
    p->set_module(u.module);
    p->set_module_type(u.module_type);
    p->set_dtype(DTypeToProto(u.dtype));
    if (u.compute_dtype) p->set_compute_dtype(DTypeToProto(*u.compute_dtype));
    if (u.reduce_dtype) p->set_reduce_dtype(DTypeToProto(*u.reduce_dtype));
    p->set_requires_grad(u.requires_grad);
    for (const PlanParam& param : u.params) {
      v1::PlanParam* pp = p->add_params();
      pp->set_fqn(param.fqn);
      pp->mutable_shape()->Add(param.shape.begin(), param.shape.end());
      pp->set_numel(param.numel);
      pp->set_offset(param.offset);
    }
    for (const SharedParam& s : u.shared) {
      v1::SharedParam* sp = p->add_shared();
      sp->set_fqn(s.fqn);
      sp->set_same_as(s.same_as);
    }
    p->set_numel(u.numel);
    p->set_padded_numel(u.padded_numel);
    p->set_shard_numel(u.shard_numel);
  }
  for (const auto& s : plan.ignored_params) out.add_ignored_params(s);
  for (const auto& s : plan.warnings) out.add_warnings(s);
  out.set_fingerprint(plan.fingerprint);
  return out;
}

absl::StatusOr<Plan> FromProto(const v1::Plan& proto) {
  if (proto.format() != kPlanFormat) {
    return absl::InvalidArgumentError(absl::StrCat("plan: unknown format ", Quote(proto.format()),
                                                   ", expected ", Quote(kPlanFormat)));
  }
  Plan plan;
  plan.world_size = proto.world_size();
  FS_ASSIGN_OR_RETURN(plan.sharding_strategy, StrategyFromProto(proto.sharding_strategy(), "plan"));
  plan.shard_world_size = proto.shard_world_size();
  plan.use_orig_params = proto.use_orig_params();
  for (const v1::PlanUnit& p : proto.units()) {
    PlanUnit u;
    u.index = p.index();
    u.module = p.module();
    u.module_type = p.module_type();
    FS_ASSIGN_OR_RETURN(u.dtype, DTypeFromProto(p.dtype(), absl::StrCat("plan: unit ", p.index())));
    if (p.compute_dtype() != v1::DTYPE_UNSPECIFIED) {
      FS_ASSIGN_OR_RETURN(u.compute_dtype,
                          DTypeFromProto(p.compute_dtype(),
                                         absl::StrCat("plan: unit ", p.index(), " compute_dtype")));
    }
    if (p.reduce_dtype() != v1::DTYPE_UNSPECIFIED) {
      FS_ASSIGN_OR_RETURN(u.reduce_dtype,
                          DTypeFromProto(p.reduce_dtype(),
                                         absl::StrCat("plan: unit ", p.index(), " reduce_dtype")));
    }
    u.requires_grad = p.requires_grad();
    for (const v1::PlanParam& pp : p.params()) {
      u.params.push_back(
          PlanParam{pp.fqn(), {pp.shape().begin(), pp.shape().end()}, pp.numel(), pp.offset()});
    }
    for (const v1::SharedParam& sp : p.shared()) u.shared.push_back({sp.fqn(), sp.same_as()});
    u.numel = p.numel();
    u.padded_numel = p.padded_numel();
    u.shard_numel = p.shard_numel();
    plan.units.push_back(std::move(u));
  }
  plan.ignored_params.assign(proto.ignored_params().begin(), proto.ignored_params().end());
  plan.warnings.assign(proto.warnings().begin(), proto.warnings().end());
  plan.fingerprint = proto.fingerprint();
  // One set of consistency rules: those of the JSON reader. Invalid UTF-8 is replaced in the
  // text, so the plan read back differs and is refused.
  FS_ASSIGN_OR_RETURN(Plan reparsed,
                      PlanFromJson(PlanToJsonText(plan, Json::error_handler_t::replace)));
  if (!(reparsed == plan)) {
    return absl::InvalidArgumentError("plan: strings must be valid UTF-8");
  }
  return plan;
}

// ---- ShardService's values ----

v1::InitMode ToProto(InitMode mode) {
  switch (mode) {
    case InitMode::kZeros:
      return v1::INIT_MODE_ZEROS;
    case InitMode::kFromEveryRank:
      return v1::INIT_MODE_FROM_EVERY_RANK;
    case InitMode::kFromRank0:
      return v1::INIT_MODE_FROM_RANK0;
  }
  return v1::INIT_MODE_UNSPECIFIED;
}

absl::StatusOr<InitMode> FromProto(v1::InitMode mode) {
  switch (mode) {
    case v1::INIT_MODE_ZEROS:
      return InitMode::kZeros;
    case v1::INIT_MODE_FROM_EVERY_RANK:
      return InitMode::kFromEveryRank;
    case v1::INIT_MODE_FROM_RANK0:
      return InitMode::kFromRank0;
    default:
      return absl::InvalidArgumentError("init mode is unspecified or unknown");
  }
}

v1::ReduceOp ToProto(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return v1::REDUCE_OP_SUM;
    case ReduceOp::kAvg:
      return v1::REDUCE_OP_AVG;
  }
  return v1::REDUCE_OP_UNSPECIFIED;
}

absl::StatusOr<ReduceOp> FromProto(v1::ReduceOp op) {
  switch (op) {
    case v1::REDUCE_OP_SUM:
      return ReduceOp::kSum;
    case v1::REDUCE_OP_AVG:
      return ReduceOp::kAvg;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "op must be REDUCE_OP_SUM (1) or REDUCE_OP_AVG (2), got ", static_cast<int>(op)));
  }
}

v1::SummonOptions ToProto(const SummonOptions& o) {
  v1::SummonOptions p;
  p.set_recurse(o.recurse);
  p.set_writeback(o.writeback);
  p.set_rank0_only(o.rank0_only);
  p.set_offload_to_cpu(o.offload_to_cpu);
  p.set_with_grads(o.with_grads);
  p.set_compute_precision(o.compute_precision);
  return p;
}

SummonOptions FromProto(const v1::SummonOptions& p) {
  SummonOptions o;
  o.recurse = p.recurse();
  o.writeback = p.writeback();
  o.rank0_only = p.rank0_only();
  o.offload_to_cpu = p.offload_to_cpu();
  o.with_grads = p.with_grads();
  o.compute_precision = p.compute_precision();
  return o;
}

v1::Caller ToProto(const Caller& c) {
  v1::Caller p;
  p.set_group(c.group);
  p.set_rank(c.rank);
  p.set_token(c.token);
  p.set_session(c.session);
  return p;
}

Caller FromProto(const v1::Caller& p) {
  return Caller{p.group(), p.rank(), p.token(), p.session()};
}

v1::CudaEvent ToProto(const IpcEvent& e) {
  v1::CudaEvent p;
  p.set_id(e.id);
  p.set_ipc_handle(e.ipc_handle);
  p.set_device_uuid(e.device_uuid);
  return p;
}

IpcEvent FromProto(const v1::CudaEvent& p) {
  return IpcEvent{p.id(), p.ipc_handle(), p.device_uuid()};
}

v1::MemoryHandle ToProto(const MemoryHandle& h) {
  v1::MemoryHandle p;
  p.set_segment(h.segment);
  p.set_segment_bytes(h.segment_bytes);
  p.set_offset(h.offset);
  p.set_bytes(h.bytes);
  if (h.cuda) {
    v1::CudaMemory* cuda = p.mutable_cuda();
    cuda->set_ipc_handle(h.cuda_ipc_handle);
    cuda->set_device_uuid(h.device_uuid);
    cuda->set_device(h.device);
  }
  return p;
}

MemoryHandle FromProto(const v1::MemoryHandle& p) {
  MemoryHandle h;
  h.segment = p.segment();
  h.segment_bytes = p.segment_bytes();
  h.offset = p.offset();
  h.bytes = p.bytes();
  if (p.has_cuda()) {
    h.cuda = true;
    h.cuda_ipc_handle = p.cuda().ipc_handle();
    h.device_uuid = p.cuda().device_uuid();
    h.device = p.cuda().device();
  }
  return h;
}

v1::StateSpec ToProto(const StateSpec& spec) {
  v1::StateSpec p;
  p.set_name(spec.name);
  p.set_dtype(DTypeToProto(spec.dtype));
  p.set_shape(spec.shape == StateShape::kShard ? v1::STATE_SHAPE_SHARD : v1::STATE_SHAPE_SCALAR);
  return p;
}

absl::StatusOr<std::vector<StateSpec>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::StateSpec>& specs) {
  std::vector<StateSpec> out;
  out.reserve(specs.size());
  for (int i = 0; i < specs.size(); ++i) {
    const v1::StateSpec& p = specs[i];
    StateSpec s;
    s.name = p.name();
    FS_ASSIGN_OR_RETURN(s.dtype, DTypeFromProto(p.dtype(), absl::StrCat("specs[", i, "].dtype")));
    switch (p.shape()) {
      case v1::STATE_SHAPE_SHARD:
        s.shape = StateShape::kShard;
        break;
      case v1::STATE_SHAPE_SCALAR:
        s.shape = StateShape::kScalar;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("specs[", i, "].shape: unspecified or unknown (",
                         static_cast<int>(p.shape()), "); SHARD or SCALAR"));
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace flatshard
