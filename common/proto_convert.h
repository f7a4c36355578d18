#pragma once
// Conversions between domain types (common/) and their protobuf messages (types.proto).
// The only place that sees both. From-proto conversions validate like the JSON readers do:
// a message that would be refused as JSON is refused here, with INVALID_ARGUMENT.
// Thread-safe: pure functions.

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "common/rpc_types.h"
#include "common/state_spec.h"
#include "flatshard/v1/shard_service.pb.h"
#include "flatshard/v1/types.pb.h"

namespace flatshard {

v1::Manifest ToProto(const Manifest& manifest);
absl::StatusOr<Manifest> FromProto(const v1::Manifest& proto);

v1::Policy ToProto(const Policy& policy);
absl::StatusOr<Policy> FromProto(const v1::Policy& proto);

v1::Plan ToProto(const Plan& plan);
// Checks offsets, sizes and the fingerprint, as PlanFromJson does.
absl::StatusOr<Plan> FromProto(const v1::Plan& proto);

// ---- ShardService's values (common/rpc_types.h) ----

v1::InitMode ToProto(InitMode mode);
// INVALID_ARGUMENT "init mode is unspecified or unknown" for INIT_MODE_UNSPECIFIED or a value
// outside the enum.
absl::StatusOr<InitMode> FromProto(v1::InitMode mode);

v1::ReduceOp ToProto(ReduceOp op);
// INVALID_ARGUMENT "op must be REDUCE_OP_SUM (1) or REDUCE_OP_AVG (2), got N" for
// REDUCE_OP_UNSPECIFIED or a value outside the enum.
absl::StatusOr<ReduceOp> FromProto(v1::ReduceOp op);

v1::SummonOptions ToProto(const SummonOptions& options);
SummonOptions FromProto(const v1::SummonOptions& proto);

// The uid is not on the wire: FromProto leaves it -1 (the daemon fills it in).
v1::Caller ToProto(const Caller& caller);
Caller FromProto(const v1::Caller& proto);

v1::CudaEvent ToProto(const IpcEvent& event);
IpcEvent FromProto(const v1::CudaEvent& proto);

v1::MemoryHandle ToProto(const MemoryHandle& handle);
MemoryHandle FromProto(const v1::MemoryHandle& proto);

// Optimizer state specs (RegisterState). FromProto: INVALID_ARGUMENT naming the spec's field
// ("specs[2].dtype", "specs[0].shape") for an unspecified or unknown enum; the names are
// checked by ValidateStateSpecs, not here.
v1::StateSpec ToProto(const StateSpec& spec);
absl::StatusOr<std::vector<StateSpec>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::StateSpec>& specs);

}  // namespace flatshard
