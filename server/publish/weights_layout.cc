#include "server/publish/weights_layout.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/checkpoint/checkpoint.h"
#include "server/publish/segment_copier.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

int64_t AlignUp(int64_t n) {
  return (n + kWeightsAlignment - 1) / kWeightsAlignment * kWeightsAlignment;
}

}  // namespace

void ConvertElements(DType from, const void* src, DType to, void* dst, int64_t n) {
  ConvertRange(from, src, to, dst, n);
}

absl::StatusOr<WeightsLayout> LayOutWeights(const Plan& plan, const Manifest& manifest,
                                            std::optional<DType> dtype) {
  if (dtype.has_value() && !IsFloatingPoint(*dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.dtype ", DTypeName(*dtype),
                     " is not a floating type (float32, float16, bfloat16)"));
  }
  WeightsLayout out;
  std::map<std::string, size_t> by_name;  // FQN -> entry, for the aliases
  for (const PlanUnit& u : plan.units) {
    if (dtype.has_value() && !IsFloatingPoint(u.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", u.index, " (\"", u.module, "\") is ",
                                                     DTypeName(u.dtype), ": cannot cast it to ",
                                                     DTypeName(*dtype)));
    }
    const DType t = dtype.value_or(u.dtype);
    for (const PlanParam& p : u.params) {
      WeightsEntry e;
      e.name = p.fqn;
      e.dtype = t;
      e.shape = p.shape;
      e.offset = out.bytes;
      e.bytes = p.numel * ItemSize(t);
      e.unit = u.index;
      e.flat_offset = p.offset;
      e.numel = p.numel;
      out.bytes = AlignUp(out.bytes + e.bytes);
      by_name[e.name] = out.entries.size();
      out.entries.push_back(std::move(e));
    }
  }
  auto alias = [&](const std::string& fqn, const std::string& same_as) {
    auto it = by_name.find(same_as);
    if (it == by_name.end() || by_name.contains(fqn)) return;
    WeightsEntry e = out.entries[it->second];
    e.name = fqn;
    e.unit = -1;  // the bytes are its target's
    by_name[fqn] = out.entries.size();
    out.entries.push_back(std::move(e));
  };
  for (const PlanUnit& u : plan.units) {
    for (const SharedParam& s : u.shared) alias(s.fqn, s.same_as);
  }
  for (const SharedParam& s : checkpoint::TiedAliases(manifest, plan)) alias(s.fqn, s.same_as);
  return out;
}

absl::Status FillWeights(const Plan& plan, const WeightsLayout& layout,
                         const std::vector<int32_t>& ranks,
                         const std::vector<std::vector<std::shared_ptr<Buffer>>>& by_rank,
                         void* dst, int threads) {
  // Per unit and shard rank: the first local rank holding that shard (HYBRID_SHARD and
  // NO_SHARD replicate shards; any copy is the committed value).
  std::vector<std::vector<const Buffer*>> source(plan.units.size());
  for (const PlanUnit& u : plan.units) {
    source[u.index].assign(plan.shard_world_size, nullptr);
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int32_t s = plan.ShardRank(ranks[i]);
      if (s < 0 || s >= plan.shard_world_size || source[u.index][s] != nullptr) continue;
      if (u.index < static_cast<int32_t>(by_rank[i].size()) && by_rank[i][u.index] != nullptr) {
        source[u.index][s] = by_rank[i][u.index].get();
      }
    }
    for (int32_t s = 0; s < plan.shard_world_size; ++s) {
      if (source[u.index][s] == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("unit ", u.index, " (\"", u.module,
                         "\"): no rank on this daemon holds shard ", s, " of its committed copy"));
      }
    }
  }
  // Each entry's pieces (one per shard it spans), and the alignment padding after it zeroed:
  // a reused segment holds an older version's bytes there.
  std::vector<CopyRange> ranges;
  for (const WeightsEntry& e : layout.entries) {
    if (e.unit < 0) continue;
    const PlanUnit& u = plan.units[e.unit];
    const int64_t item = ItemSize(u.dtype);
    const int64_t out_item = ItemSize(e.dtype);
    char* out = static_cast<char*>(dst) + e.offset;
    for (int64_t el = e.flat_offset, end = e.flat_offset + e.numel; el < end;) {
      const int64_t s = el / u.shard_numel;
      const int64_t within = el % u.shard_numel;
      const int64_t n = std::min(end - el, u.shard_numel - within);
      const char* src = static_cast<const char*>(source[e.unit][s]->data()) + within * item;
      ranges.push_back(CopyRange{src, u.dtype, out + (el - e.flat_offset) * out_item, e.dtype, n});
      el += n;
    }
    const int64_t tail = std::min(AlignUp(e.offset + e.bytes), layout.bytes) - e.offset - e.bytes;
    if (tail > 0) std::memset(out + e.bytes, 0, static_cast<size_t>(tail));
  }
  CopyRanges(ranges, threads);
  return absl::OkStatus();
}

}  // namespace flatshard::server
