#pragma once
// The layout of a registered module as plain C++17 values: the plan every rank agreed on
// (spec/formats.md "Plan") seen from one rank. Public header of the client library (installed
// as <flatshard/plan.h>); Client::Register fills it (RegisteredModule::layout).
//
// A unit is one flat buffer (FSDP's FlatParameter): its parameters lie back to back at
// `offset` elements from its start (with 16-byte alignment when use_orig_params), padded to
// `padded_numel`, and split into `shard_world_size` equal shards of `shard_numel` elements.
// A rank holds the shard `shard_ranges[shard_rank]` of every unit; with HYBRID_SHARD the
// shards repeat on every node (shard_rank = rank % shard_world_size), with NO_SHARD every
// rank holds the whole buffer.
//
//   const flatshard::client::PlanLayout& plan = *model.layout;
//   for (const PlanLayout::Unit& unit : plan.units) {
//     for (const PlanLayout::Param& p : unit.params) {
//       PlanLayout::Range mine = p.range().Intersect(unit.local_shard);  // may be empty
//       // elements [mine.begin, mine.end) of the unit's buffer are this rank's shard's
//       // [mine.begin - unit.local_shard.begin, ...) and p's [mine.begin - p.offset, ...)
//     }
//   }
//
// Thread safety: plain values; const methods may run concurrently.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "flatshard/dtype.h"

namespace flatshard {
namespace client {

struct PlanLayout {
  // Half-open range [begin, end) of elements of a unit's padded flat buffer.
  struct Range {
    int64_t begin = 0;
    int64_t end = 0;
    int64_t size() const { return end > begin ? end - begin : 0; }
    bool empty() const { return end <= begin; }
    // The elements both ranges hold; empty (begin == end) when they are disjoint.
    Range Intersect(const Range& other) const {
      Range r{begin > other.begin ? begin : other.begin, end < other.end ? end : other.end};
      if (r.end < r.begin) r.end = r.begin;
      return r;
    }
    friend bool operator==(const Range& a, const Range& b) {
      return a.begin == b.begin && a.end == b.end;
    }
    friend bool operator!=(const Range& a, const Range& b) { return !(a == b); }
  };

  // One parameter of a unit, in flat order.
  struct Param {
    std::string fqn;                // as in the manifest (the unwrapped module's state_dict key)
    std::vector<int64_t> shape;     // empty for a scalar
    DType dtype = DType::kFloat32;  // the unit's
    int64_t offset = 0;             // elements from the start of the unit's unsharded flat buffer
    int64_t numel = 0;
    // Where the parameter lies in the unit's flat buffer.
    Range range() const { return Range{offset, offset + numel}; }
  };

  // A later FQN of a parameter that occurs more than once in a unit (tied weights): it
  // aliases the parameter `same_as` of the same unit and has no elements of its own.
  struct Alias {
    std::string fqn;
    std::string same_as;
  };

  struct Unit {
    int32_t index = 0;        // the plan's unit index (what views and shards call `unit`)
    std::string module;       // FQN of the wrapped module; "" for the root
    std::string module_type;  // its class name, e.g. "Linear"
    DType dtype = DType::kFloat32;
    bool requires_grad = true;
    std::vector<Param> params;  // flat order
    std::vector<Alias> shared;
    int64_t numel = 0;         // the parameters' elements, no padding
    int64_t padded_numel = 0;  // the unsharded flat buffer with all padding
    int64_t shard_numel = 0;   // one shard: padded_numel / shard_world_size
    // The slice of the padded buffer each shard rank holds, indexed by shard rank
    // (shard_world_size entries; they cover [0, padded_numel) exactly once).
    std::vector<Range> shard_ranges;
    // This rank's: shard_ranges[shard_rank].
    Range local_shard;

    // The parameter called `fqn` in this unit (an alias resolves to its target); nullptr if
    // none.
    const Param* FindParam(absl::string_view fqn) const {
      for (const Alias& a : shared) {
        if (a.fqn == fqn) {
          fqn = a.same_as;
          break;
        }
      }
      for (const Param& p : params) {
        if (p.fqn == fqn) return &p;
      }
      return nullptr;
    }
  };

  int32_t world_size = 1;
  // "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD" or "_HYBRID_SHARD_ZERO2"
  // (spec/formats.md "Policy"; the last is HYBRID_SHARD for the daemon).
  std::string sharding_strategy;
  // Ranks a unit is sharded over: world_size, 1 for NO_SHARD, ranks per node for HYBRID_SHARD.
  int32_t shard_world_size = 1;
  bool use_orig_params = false;
  int32_t rank = 0;                         // the rank this layout was made for (the session's)
  int32_t shard_rank = 0;                   // its rank among the shard_world_size ranks of a unit
  std::vector<Unit> units;                  // pre-order of their wrapped modules
  std::vector<std::string> ignored_params;  // FQNs the plan leaves out (policy ignored_params)
  std::vector<std::string> warnings;        // the planner's, as `flatshardctl plan` prints them
  std::string fingerprint;                  // equal on every rank of the group

  // The unit with index `index`; nullptr if none.
  const Unit* FindUnit(int32_t index) const {
    for (const Unit& u : units) {
      if (u.index == index) return &u;
    }
    return nullptr;
  }
  // The unit holding parameter (or alias) `fqn`; nullptr if none.
  const Unit* FindUnitOf(absl::string_view fqn) const {
    for (const Unit& u : units) {
      if (u.FindParam(fqn) != nullptr) return &u;
    }
    return nullptr;
  }
};

}  // namespace client
}  // namespace flatshard
