#include "client/shard_views_builder.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan.h"
#include "common/proto_convert.h"
#include "common/status_macros.h"

namespace flatshard::client::internal {

SegmentRange ToRange(const v1::MemoryHandle& proto) {
  const flatshard::MemoryHandle h = flatshard::FromProto(proto);
  SegmentRange r;
  r.segment = h.segment;
  r.segment_bytes = h.segment_bytes;
  r.offset = h.offset;
  r.bytes = h.bytes;
  if (h.cuda) {
    r.cuda = true;
    r.cuda_ipc_handle = h.cuda_ipc_handle;
    r.device_uuid = h.device_uuid;
  }
  return r;
}

absl::StatusOr<ShardViews> ShardViewsBuilder::Build(
    const ModuleLayout& layout, int32_t rank,
    const google::protobuf::RepeatedPtrField<v1::UnitShard>& shards,
    const google::protobuf::RepeatedPtrField<v1::StateSpec>& state_specs, SegmentCache& cache) {
  const Plan& plan = layout.plan();
  if (rank < 0 || rank >= plan.world_size || plan.shard_world_size < 1) {
    return absl::InternalError(absl::StrCat("the plan (world_size=", plan.world_size,
                                            " shard_world_size=", plan.shard_world_size,
                                            ") does not fit rank ", rank));
  }
  const int64_t shard_rank = plan.ShardRank(rank);
  ShardViews out;
  absl::StatusOr<std::vector<flatshard::StateSpec>> specs = flatshard::FromProto(state_specs);
  if (!specs.ok()) {
    return absl::InternalError(
        absl::StrCat("the daemon sent an unusable state spec: ", specs.status().message()));
  }
  for (const flatshard::StateSpec& spec : *specs) {
    out.state_specs_.push_back(
        StateSpec{spec.name, spec.dtype, static_cast<StateShape>(spec.shape)});
  }
  out.units_.reserve(shards.size());
  for (const v1::UnitShard& s : shards) {
    const UnitTemplate* unit = layout.FindUnit(s.unit());
    if (unit == nullptr) {
      return absl::InternalError(absl::StrCat("the daemon's reply names unit ", s.unit(),
                                              ", which the plan does not have"));
    }
    UnitShardView view;
    view.unit = unit->index;
    view.dtype = unit->dtype;
    view.shard_numel = unit->shard_numel;
    view.shard_offset = shard_rank * unit->shard_numel;
    FS_ASSIGN_OR_RETURN(MappedRange shard, cache.Map(ToRange(s.shard()), /*writable=*/true));
    FS_RETURN_IF_ERROR(CheckRangeHolds(shard, unit->shard_numel, unit->dtype,
                                       absl::StrCat("unit ", unit->index, " shard")));
    view.data = shard.data;
    view.device = shard.device;
    out.keepalive_.push_back(std::move(shard.mapping));
    if (s.has_grad()) {
      FS_ASSIGN_OR_RETURN(MappedRange grad, cache.Map(ToRange(s.grad()), /*writable=*/true));
      FS_RETURN_IF_ERROR(CheckRangeHolds(grad, unit->shard_numel, unit->dtype,
                                         absl::StrCat("unit ", unit->index, " grad shard")));
      view.grad = grad.data;
      out.keepalive_.push_back(std::move(grad.mapping));
    }
    if (s.state_size() != 0 && s.state_size() != static_cast<int>(specs->size())) {
      return absl::InternalError(absl::StrCat("the daemon's reply has ", s.state_size(),
                                              " state buffers for unit ", unit->index,
                                              ", its spec ", specs->size()));
    }
    for (int i = 0; i < s.state_size(); ++i) {
      const flatshard::StateSpec& spec = (*specs)[i];
      const int64_t numel = spec.Numel(unit->shard_numel);
      FS_ASSIGN_OR_RETURN(MappedRange range, cache.Map(ToRange(s.state(i)), /*writable=*/true));
      FS_RETURN_IF_ERROR(
          CheckRangeHolds(range, numel, spec.dtype,
                          absl::StrCat("unit ", unit->index, " state \"", spec.name, "\"")));
      view.states.push_back(StateView{spec.name, spec.dtype, static_cast<StateShape>(spec.shape),
                                      numel, range.data, range.device});
      out.keepalive_.push_back(std::move(range.mapping));
    }
    out.units_.push_back(std::move(view));
  }
  std::sort(out.units_.begin(), out.units_.end(),
            [](const UnitShardView& a, const UnitShardView& b) { return a.unit < b.unit; });
  for (size_t i = 1; i < out.units_.size(); ++i) {
    if (out.units_[i].unit == out.units_[i - 1].unit) {
      return absl::InternalError(
          absl::StrCat("the daemon's reply names unit ", out.units_[i].unit, " twice"));
    }
  }
  return out;
}

}  // namespace flatshard::client::internal
