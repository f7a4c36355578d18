#include "server/publish/weights_layout.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/checkpoint/checkpoint.h"
#include "server/collective/reduce.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

int64_t AlignUp(int64_t n) {
  return (n + kWeightsAlignment - 1) / kWeightsAlignment * kWeightsAlignment;
}

double Load(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kFloat64:
      return static_cast<const double*>(p)[i];
    case DType::kFloat16:
      return collective::HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    default:  // kBFloat16
      return collective::BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

void Store(DType t, void* p, int64_t i, double v) {
  switch (t) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = collective::FloatToHalf(static_cast<float>(v));
      break;
    default:
      static_cast<uint16_t*>(p)[i] = collective::FloatToBFloat16(static_cast<float>(v));
  }
}

}  // namespace

void ConvertElements(DType from, const void* src, DType to, void* dst, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n * ItemSize(from)));
    return;
  }
  for (int64_t i = 0; i < n; ++i) Store(to, dst, i, Load(from, src, i));
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
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next++; k < layout.entries.size(); k = next++) {
      const WeightsEntry& e = layout.entries[k];
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
        ConvertElements(u.dtype, src, e.dtype, out + (el - e.flat_offset) * out_item, n);
        el += n;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  return absl::OkStatus();
}

}  // namespace flatshard::server
