#pragma once
// Resharding: parameters by FQN and element range, whatever plan they were saved under.
//
// A ParamSource holds whole parameters by FQN: a checkpoint (each parameter's elements lie in
// its saved unit's flat buffer, split over the saved ranks' files) or a safetensors file (each
// tensor whole). Loading one into a plan (another world size, another wrap policy) fills, for
// each rank's shard of each unit, the element ranges of the parameters that shard covers, read
// from wherever the source holds them; padding is zero. The FQNs are those of the unwrapped
// module's state_dict: tied parameters appear once in a plan unit's params (the first FQN) and
// as `shared` aliases; a source is looked up by the param's FQN first, then by its aliases.
// Thread-safe: sources are immutable after creation; Read may run on many threads.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/checkpoint/checkpoint.h"
#include "common/checkpoint/safetensors.h"
#include "common/plan.h"
#include "common/state_spec.h"

namespace flatshard::checkpoint {

struct SourceParam {
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
};

class ParamSource {
 public:
  virtual ~ParamSource() = default;
  // Every parameter the source holds, by FQN.
  virtual const std::map<std::string, SourceParam>& params() const = 0;
  // Reads elements [begin, begin + count) of parameter `fqn` (flattened, C order) into `dst`.
  virtual absl::Status Read(const std::string& fqn, int64_t begin, int64_t count,
                            void* dst) const = 0;
  // "checkpoint /path" or "safetensors file /path", for messages.
  virtual std::string Describe() const = 0;
};

// A checkpoint's parameters (FQNs and aliases of its plan).
std::unique_ptr<ParamSource> CheckpointSource(const Checkpoint& ckpt);
// A SHARD-shaped optimizer state of a checkpoint (Metadata::state_specs) as a ParamSource: per
// parameter FQN, the state's elements over that parameter's element range (the state tensor
// of each (rank, unit) has the layout of the rank's flat shard), of the state's dtype. Load it
// with Bind/FillShard given `dtype` = the state's dtype.
std::unique_ptr<ParamSource> CheckpointStateSource(const Checkpoint& ckpt, const StateSpec& spec);
// A safetensors file's tensors (its header checked; tensors whose dtype flatshard has no type
// for are listed under their names and refused if a plan needs them).
absl::StatusOr<std::unique_ptr<ParamSource>> SafetensorsSource(const std::string& path);

// For one parameter of `target`, where the source holds it.
struct Binding {
  const PlanUnit* unit = nullptr;
  const PlanParam* param = nullptr;
  std::string source_fqn;  // the FQN the source has it under (the param's or an alias)
};

// Checks that `source` can fill every parameter of `target`: each is present (by FQN or an
// alias), with the same shape and dtype. FAILED_PRECONDITION naming the FQN and what differs
// ("parameter \"h.0.w\": shape [4, 8] in checkpoint /c, [8, 8] in the module"). Parameters the
// source has beyond the target's are allowed (e.g. buffers in a full state dict) and counted
// in `*unused` (when given).
// `tied`: the target's aliases across units (TiedAliases), looked up and counted as used too.
absl::StatusOr<std::vector<Binding>> Bind(const ParamSource& source, const Plan& target,
                                          int64_t* unused = nullptr,
                                          const std::vector<SharedParam>& tied = {},
                                          std::optional<DType> dtype = std::nullopt);

// Fills shard `shard_rank` of `unit` of `target` (unit.shard_numel elements of unit.dtype at
// `dst`) from `source`: padding zero, every covered element range read. REQUIRES: Bind OK.
// `dtype` (Bind's too): the elements' type when not the unit's (an optimizer state's; the
// element layout stays the unit's).
absl::Status FillShard(const ParamSource& source, const std::vector<Binding>& bindings,
                       const Plan& target, int32_t unit, int32_t shard_rank, void* dst,
                       std::optional<DType> dtype = std::nullopt);

// Writes every parameter of `source` that `plan` names, under every FQN the unwrapped module's
// state_dict has for it (aliases included, each a copy), as a safetensors file. `metadata` goes
// to __metadata__. `progress` gets bytes written.
// `tied`: aliases across units the plan does not name (Metadata::tied), written after the
// parameter they alias.
absl::Status ExportSafetensors(const ParamSource& source, const Plan& plan, const std::string& path,
                               const std::map<std::string, std::string>& metadata,
                               const ProgressFn& progress = nullptr,
                               const std::vector<SharedParam>& tied = {});

}  // namespace flatshard::checkpoint
