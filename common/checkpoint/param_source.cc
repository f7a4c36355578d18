#include "common/checkpoint/param_source.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_util.h"
#include "common/status_macros.h"

namespace flatshard::checkpoint {
namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

class CheckpointParamSource : public ParamSource {
 public:
  // `tensor`: the per-(rank, unit) tensor read (kShardTensor, or an optimizer state's name);
  // `dtype`: its element type when not the unit's.
  explicit CheckpointParamSource(const Checkpoint& ckpt, std::string tensor = kShardTensor,
                                 std::optional<DType> dtype = std::nullopt)
      : ckpt_(ckpt), tensor_(std::move(tensor)), dtype_(dtype) {
    for (const PlanUnit& u : ckpt_.meta.plan.units) {
      for (const PlanParam& p : u.params) {
        params_[p.fqn] = SourceParam{p.shape, dtype_.value_or(u.dtype), p.numel};
        where_[p.fqn] = {&u, &p};
      }
      for (const SharedParam& s : u.shared) {
        auto it = where_.find(s.same_as);
        if (it == where_.end()) continue;
        params_[s.fqn] = params_[s.same_as];
        where_[s.fqn] = it->second;
      }
    }
    for (const SharedParam& s : ckpt_.meta.tied) {
      auto it = where_.find(s.same_as);
      if (it == where_.end()) continue;
      params_[s.fqn] = params_[s.same_as];
      where_[s.fqn] = it->second;
    }
    for (const FileEntry& f : ckpt_.meta.files) {
      fds_.push_back(::open(absl::StrCat(ckpt_.dir, "/", f.name).c_str(), O_RDONLY | O_CLOEXEC));
    }
  }
  ~CheckpointParamSource() override {
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  const std::map<std::string, SourceParam>& params() const override { return params_; }
  std::string Describe() const override {
    return tensor_ == kShardTensor
               ? absl::StrCat("checkpoint ", ckpt_.dir)
               : absl::StrCat("optimizer state ", Quote(tensor_), " of checkpoint ", ckpt_.dir);
  }

  absl::Status Read(const std::string& fqn, int64_t begin, int64_t count,
                    void* dst) const override {
    auto it = where_.find(fqn);
    if (it == where_.end()) {
      return absl::NotFoundError(absl::StrCat(Describe(), " has no parameter ", Quote(fqn)));
    }
    const PlanUnit& u = *it->second.first;
    const PlanParam& p = *it->second.second;
    if (begin < 0 || count < 0 || begin + count > p.numel) {
      return absl::InvalidArgumentError(absl::StrCat("elements [", begin, ", ", begin + count,
                                                     ") of ", Quote(fqn), " (", p.numel, ")"));
    }
    const int64_t item = ItemSize(dtype_.value_or(u.dtype));
    const int64_t shard = u.shard_numel;
    int64_t flat = p.offset + begin;
    auto* out = static_cast<char*>(dst);
    while (count > 0) {
      // Shard rank k holds flat elements [k * shard, (k + 1) * shard); shard rank k is global
      // rank k (Plan::ShardRank: rank % shard_world_size; NO_SHARD: one shard, rank 0's).
      const int32_t k = static_cast<int32_t>(flat / shard);
      const int64_t in_shard = flat - int64_t{k} * shard;
      const int64_t take = std::min(count, shard - in_shard);
      const TensorEntry* t = ckpt_.meta.FindTensor(k, u.index, tensor_);
      if (t == nullptr || k >= static_cast<int32_t>(fds_.size()) || t->bytes < shard * item) {
        return absl::FailedPreconditionError(absl::StrCat(Describe(), ": no ", Quote(tensor_),
                                                          " of rank ", k, " unit ", u.index,
                                                          " for ", Quote(fqn)));
      }
      const std::string path = absl::StrCat(ckpt_.dir, "/", ckpt_.meta.files[k].name);
      if (fds_[k] < 0) return absl::FailedPreconditionError(absl::StrCat(path, ": cannot open"));
      FS_RETURN_IF_ERROR(
          internal::ReadAll(fds_[k], out, take * item, t->offset + in_shard * item, path));
      out += take * item;
      flat += take;
      count -= take;
    }
    return absl::OkStatus();
  }

 private:
  const Checkpoint ckpt_;
  const std::string tensor_;
  const std::optional<DType> dtype_;
  std::map<std::string, SourceParam> params_;
  std::map<std::string, std::pair<const PlanUnit*, const PlanParam*>> where_;
  std::vector<int> fds_;
};

class SafetensorsParamSource : public ParamSource {
 public:
  SafetensorsParamSource(std::string path, safetensors::Header header, int fd)
      : path_(std::move(path)), header_(std::move(header)), fd_(fd) {
    for (const safetensors::TensorInfo& t : header_.tensors) {
      std::optional<DType> dtype = safetensors::DTypeOfCode(t.code);
      // A dtype flatshard has no type for is listed as uint8 of no shape: Bind refuses it
      // with both dtypes named if a plan needs it.
      params_[t.name] = SourceParam{t.shape, dtype.value_or(DType::kUInt8), t.numel()};
      if (!dtype) unsupported_[t.name] = t.code;
    }
  }
  ~SafetensorsParamSource() override { ::close(fd_); }
  const std::map<std::string, SourceParam>& params() const override { return params_; }
  std::string Describe() const override { return absl::StrCat("safetensors file ", path_); }
  const std::map<std::string, std::string>& unsupported() const { return unsupported_; }

  absl::Status Read(const std::string& fqn, int64_t begin, int64_t count,
                    void* dst) const override {
    const safetensors::TensorInfo* t = header_.Find(fqn);
    if (t == nullptr) {
      return absl::NotFoundError(absl::StrCat(Describe(), " has no tensor ", Quote(fqn)));
    }
    const int64_t item = safetensors::CodeSize(t->code);
    if (begin < 0 || count < 0 || begin + count > t->numel()) {
      return absl::InvalidArgumentError(
          absl::StrCat("elements [", begin, ", ", begin + count, ") of ", Quote(fqn)));
    }
    return internal::ReadAll(fd_, dst, count * item, header_.data_start + t->begin + begin * item,
                             path_);
  }

 private:
  const std::string path_;
  const safetensors::Header header_;
  const int fd_;
  std::map<std::string, SourceParam> params_;
  std::map<std::string, std::string> unsupported_;
};

}  // namespace

std::unique_ptr<ParamSource> CheckpointSource(const Checkpoint& ckpt) {
  return std::make_unique<CheckpointParamSource>(ckpt);
}

std::unique_ptr<ParamSource> CheckpointStateSource(const Checkpoint& ckpt, const StateSpec& spec) {
  return std::make_unique<CheckpointParamSource>(ckpt, spec.name, spec.dtype);
}

absl::StatusOr<std::unique_ptr<ParamSource>> SafetensorsSource(const std::string& path) {
  FS_ASSIGN_OR_RETURN(safetensors::Header header, safetensors::ReadHeader(path));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": open: ", std::strerror(errno)));
  return std::unique_ptr<ParamSource>(new SafetensorsParamSource(path, std::move(header), fd));
}

absl::StatusOr<std::vector<Binding>> Bind(const ParamSource& source, const Plan& target,
                                          int64_t* unused, const std::vector<SharedParam>& tied,
                                          std::optional<DType> dtype) {
  std::vector<Binding> out;
  std::set<std::string> used;
  for (const PlanUnit& u : target.units) {
    for (const PlanParam& p : u.params) {
      std::vector<std::string> names = {p.fqn};
      for (const SharedParam& s : u.shared) {
        if (s.same_as == p.fqn) names.push_back(s.fqn);
      }
      for (const SharedParam& s : tied) {
        if (s.same_as == p.fqn) names.push_back(s.fqn);
      }
      const SourceParam* found = nullptr;
      std::string found_name;
      for (const std::string& n : names) {
        auto it = source.params().find(n);
        if (it != source.params().end()) {
          found = &it->second;
          found_name = n;
          break;
        }
      }
      if (found == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter ", Quote(p.fqn), " of unit ", u.index, " (", Quote(u.module), ") is not in ",
            source.Describe(), names.size() > 1 ? " (nor its tied aliases)" : ""));
      }
      if (found->shape != p.shape) {
        return absl::FailedPreconditionError(
            absl::StrCat("parameter ", Quote(p.fqn), ": shape ", ShapeText(found->shape), " in ",
                         source.Describe(), ", ", ShapeText(p.shape), " in the module"));
      }
      if (found->dtype != dtype.value_or(u.dtype)) {
        return absl::FailedPreconditionError(
            absl::StrCat("parameter ", Quote(p.fqn), ": dtype ", DTypeName(found->dtype), " in ",
                         source.Describe(), ", ", DTypeName(dtype.value_or(u.dtype)),
                         " in the module (no conversion)"));
      }
      if (const auto* st = dynamic_cast<const SafetensorsParamSource*>(&source)) {
        auto bad = st->unsupported().find(found_name);
        if (bad != st->unsupported().end()) {
          return absl::FailedPreconditionError(
              absl::StrCat("parameter ", Quote(p.fqn), ": dtype ", bad->second, " in ",
                           source.Describe(), ", ", DTypeName(u.dtype), " in the module"));
        }
      }
      for (const std::string& n : names) used.insert(n);
      out.push_back(Binding{&u, &p, found_name});
    }
  }
  if (unused != nullptr) {
    *unused = 0;
    for (const auto& [name, p] : source.params()) *unused += used.contains(name) ? 0 : 1;
  }
  return out;
}

absl::Status FillShard(const ParamSource& source, const std::vector<Binding>& bindings,
                       const Plan& target, int32_t unit, int32_t shard_rank, void* dst,
                       std::optional<DType> dtype) {
  const PlanUnit& u = target.units.at(unit);
  FS_ASSIGN_OR_RETURN(FlatLayout layout, UnitLayout(target, u));
  const ElementRange range = layout.ShardRange(shard_rank);
  const int64_t item = ItemSize(dtype.value_or(u.dtype));
  auto* out = static_cast<char*>(dst);
  // Parameters in flat order: zero only the gaps between them (alignment and world-size
  // padding), not the whole shard first.
  int64_t at = range.begin;
  for (const Binding& b : bindings) {
    if (b.unit->index != unit) continue;
    const int64_t lo = std::max(range.begin, b.param->offset);
    const int64_t hi = std::min(range.end, b.param->offset + b.param->numel);
    if (lo >= hi) continue;
    if (lo > at) std::memset(out + (at - range.begin) * item, 0, (lo - at) * item);
    FS_RETURN_IF_ERROR(
        source.Read(b.source_fqn, lo - b.param->offset, hi - lo, out + (lo - range.begin) * item));
    at = std::max(at, hi);
  }
  if (range.end > at) std::memset(out + (at - range.begin) * item, 0, (range.end - at) * item);
  return absl::OkStatus();
}

absl::Status ExportSafetensors(const ParamSource& source, const Plan& plan, const std::string& path,
                               const std::map<std::string, std::string>& metadata,
                               const ProgressFn& progress, const std::vector<SharedParam>& tied) {
  FS_ASSIGN_OR_RETURN(std::vector<Binding> bindings, Bind(source, plan));
  std::vector<safetensors::Writer::Spec> specs;
  std::vector<const Binding*> order;  // one per spec
  for (const Binding& b : bindings) {
    specs.push_back({b.param->fqn, b.unit->dtype, b.param->shape});
    order.push_back(&b);
    for (const SharedParam& s : b.unit->shared) {
      if (s.same_as == b.param->fqn) {
        specs.push_back({s.fqn, b.unit->dtype, b.param->shape});
        order.push_back(&b);
      }
    }
    for (const SharedParam& s : tied) {
      if (s.same_as == b.param->fqn) {
        specs.push_back({s.fqn, b.unit->dtype, b.param->shape});
        order.push_back(&b);
      }
    }
  }
  FS_ASSIGN_OR_RETURN(std::unique_ptr<safetensors::Writer> w,
                      safetensors::Writer::Create(path, specs, metadata));
  constexpr int64_t kChunkBytes = int64_t{16} << 20;
  std::vector<char> buf;
  for (const Binding* b : order) {
    const int64_t item = ItemSize(b->unit->dtype);
    const int64_t per = std::max<int64_t>(1, kChunkBytes / item);
    for (int64_t e = 0; e < b->param->numel; e += per) {
      const int64_t n = std::min(per, b->param->numel - e);
      buf.resize(n * item);
      FS_RETURN_IF_ERROR(source.Read(b->source_fqn, e, n, buf.data()));
      FS_RETURN_IF_ERROR(w->Append(buf.data(), n * item));
      if (progress) progress(n * item);
    }
  }
  return w->Finish();
}

}  // namespace flatshard::checkpoint
