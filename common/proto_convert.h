#pragma once
// Conversions between domain types (common/) and their protobuf messages (types.proto).
// The only place that sees both. From-proto conversions validate like the JSON readers do:
// a message that would be refused as JSON is refused here, with INVALID_ARGUMENT.
// Thread-safe: pure functions.

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "flatshard/v1/types.pb.h"

namespace flatshard {

v1::Manifest ToProto(const Manifest& manifest);
absl::StatusOr<Manifest> FromProto(const v1::Manifest& proto);

v1::Policy ToProto(const Policy& policy);
absl::StatusOr<Policy> FromProto(const v1::Policy& proto);

v1::Plan ToProto(const Plan& plan);
// Checks offsets, sizes and the fingerprint, as PlanFromJson does.
absl::StatusOr<Plan> FromProto(const v1::Plan& proto);

}  // namespace flatshard
