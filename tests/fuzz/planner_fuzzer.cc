// libFuzzer target for the JSON readers and the planner (formats.md: manifest, policy, plan).
//
// Input layout:
//   byte 0          options: world_size = 1 + (b & 7), ranks_per_node = (b >> 3) & 7
//                   (0 = one node). A JSON whitespace byte (' ', '\n', '\t', '\r') keeps the
//                   whole input a valid JSON text, so plan documents work as seeds unchanged.
//   bytes 1..       "<manifest JSON>\0<policy JSON>"; without a 0 byte the policy is "{}".
//
// Every reader must refuse bad input with a Status, never crash, hang or throw. When an
// input is accepted, the invariants below must hold; a violation traps (__builtin_trap) so
// libFuzzer, and the gcc replay driver, report it:
//   - manifest, policy and plan survive a write/read round trip unchanged;
//   - planning is deterministic and the fingerprint matches the plan's content;
//   - every unit's params are laid out in increasing, non-overlapping offsets inside
//     padded_numel, and shard_numel * shard_world_size == padded_numel;
//   - UnitLayout agrees with the plan, shard ranges tile the buffer, ShardRank stays in the
//     shard group and SummarizeMemory neither overflows nor goes negative.
//   - the one-pass readers (ManifestFromJson, PlanFromJson) answer exactly as the strict DOM
//     readers (ParseJson + ManifestFromJsonValue / PlanFromJsonValue), message included.
// The whole raw input is also fed to PlanFromJson (with its fingerprint corrected, so that
// mutated plans can be accepted and checked too).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "common/flat_layout.h"
#include "common/json_util.h"
#include "common/limits.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/plan_json_writer.h"
#include "common/planner.h"
#include "common/policy.h"

namespace flatshard {
namespace {

// Keeps each input cheap: refs can blow the expanded module tree up exponentially.
constexpr int64_t kMaxModulePaths = 20000;
// Plans read from JSON may claim up to 2^31 ranks; per-rank checks look at the first few.
constexpr int kMaxRanksChecked = 64;

#define FS_FUZZ_CHECK(cond)        \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (false)

void CheckPlanInvariants(const Plan& plan) {
  FS_FUZZ_CHECK(plan.world_size >= 1);
  FS_FUZZ_CHECK(plan.shard_world_size >= 1);
  FS_FUZZ_CHECK(plan.world_size % plan.shard_world_size == 0);
  FS_FUZZ_CHECK(plan.fingerprint == Fingerprint(plan));
  for (size_t i = 0; i < plan.units.size(); ++i) {
    const PlanUnit& u = plan.units[i];
    FS_FUZZ_CHECK(u.index == static_cast<int32_t>(i));
    FS_FUZZ_CHECK(IsFloatingPoint(u.dtype));
    int64_t end = 0;  // end of the previous param
    int64_t sum = 0;
    for (const PlanParam& p : u.params) {
      FS_FUZZ_CHECK(p.numel >= 0);
      FS_FUZZ_CHECK(p.offset >= end);
      int64_t p_end = 0;
      FS_FUZZ_CHECK(!__builtin_add_overflow(p.offset, p.numel, &p_end));
      FS_FUZZ_CHECK(p_end <= u.padded_numel);
      end = p_end;
      FS_FUZZ_CHECK(!__builtin_add_overflow(sum, p.numel, &sum));
    }
    FS_FUZZ_CHECK(sum == u.numel);
    FS_FUZZ_CHECK(u.numel <= u.padded_numel);
    int64_t padded = 0;
    FS_FUZZ_CHECK(!__builtin_mul_overflow(u.shard_numel, int64_t{plan.shard_world_size}, &padded));
    FS_FUZZ_CHECK(padded == u.padded_numel);

    // The layout the plan was built from, and every shard's slice of it.
    absl::StatusOr<FlatLayout> layout = UnitLayout(plan, u);
    FS_FUZZ_CHECK(layout.ok());
    FS_FUZZ_CHECK(layout->numel() == u.numel && layout->padded_numel() == u.padded_numel &&
                  layout->shard_numel() == u.shard_numel);
    FS_FUZZ_CHECK(layout->data_end() >= end && layout->data_end() <= u.padded_numel);
    const int shards = std::min(layout->shard_world_size(), kMaxRanksChecked);
    for (int r = 0; r < shards; ++r) {
      const ElementRange range = layout->ShardRange(r);
      FS_FUZZ_CHECK(range.begin == r * u.shard_numel && range.size() == u.shard_numel);
      const ElementRange unpadded = layout->UnpaddedShardRange(r);
      // Empty (clamped to data_end) for ranks whose slice is all padding.
      FS_FUZZ_CHECK(unpadded.size() >= 0 && unpadded.end <= layout->data_end());
      FS_FUZZ_CHECK(unpadded.empty() ||
                    (unpadded.begin == range.begin && unpadded.end <= range.end));
    }
  }
  const int ranks = std::min(plan.world_size, kMaxRanksChecked);
  for (int32_t r = 0; r < ranks; ++r) {
    const int32_t shard_rank = plan.ShardRank(r);
    FS_FUZZ_CHECK(shard_rank >= 0 && shard_rank < plan.shard_world_size);
  }
  const PlanMemory memory = SummarizeMemory(plan);
  FS_FUZZ_CHECK(memory.shard_bytes >= 0 && memory.unsharded_bytes >= memory.shard_bytes);
  FS_FUZZ_CHECK(memory.peak_summon_bytes >= memory.shard_bytes);
}

// A plan that was accepted must be written and read back unchanged; the direct writer must
// give the same bytes as the document.
void CheckPlanRoundTrip(const Plan& plan) {
  const std::string text = PlanToJson(plan).dump();
  FS_FUZZ_CHECK(PlanToJsonText(plan) == text);
  absl::StatusOr<Plan> reparsed = PlanFromJson(text);
  FS_FUZZ_CHECK(reparsed.ok());
  FS_FUZZ_CHECK(*reparsed == plan);
}

// `fast` (a one-pass reader's answer) equals what the DOM reader answers for `text`.
template <typename T, typename FromValue>
void CheckSameAsDom(const absl::StatusOr<T>& fast, absl::string_view text, absl::string_view doc,
                    FromValue from_value) {
  absl::StatusOr<Json> value = ParseJson(text, doc);
  const absl::StatusOr<T> dom = value.ok() ? from_value(*value) : value.status();
  FS_FUZZ_CHECK(fast.status() == dom.status());
  FS_FUZZ_CHECK(!fast.ok() || *fast == *dom);
}

void FuzzPlanner(absl::string_view manifest_text, absl::string_view policy_text,
                 const PlanOptions& options) {
  absl::StatusOr<Manifest> manifest = ManifestFromJson(manifest_text);
  if (manifest_text.size() <= kMaxManifestJsonBytes) {  // beyond it refused before reading
    CheckSameAsDom(manifest, manifest_text, "manifest",
                   [](const Json& v) { return ManifestFromJsonValue(v); });
  }
  absl::StatusOr<Policy> policy = PolicyFromJson(policy_text);
  if (manifest.ok()) {
    FS_FUZZ_CHECK(!manifest->modules.empty());
    absl::StatusOr<Manifest> again = ManifestFromJsonValue(ManifestToJson(*manifest));
    FS_FUZZ_CHECK(again.ok());
    FS_FUZZ_CHECK(*again == *manifest);
    FS_FUZZ_CHECK(ValidateManifest(*manifest).ok());
  }
  if (policy.ok()) {
    absl::StatusOr<Policy> again = PolicyFromJsonValue(PolicyToJson(*policy));
    FS_FUZZ_CHECK(again.ok());
    FS_FUZZ_CHECK(*again == *policy);
  }
  if (!manifest.ok() || !policy.ok()) return;

  absl::StatusOr<Plan> plan = BuildPlan(*manifest, *policy, options);
  if (!plan.ok()) return;
  FS_FUZZ_CHECK(plan->world_size == options.world_size);
  // formats.md: a module with no parameters left to flatten gets no unit.
  for (const PlanUnit& u : plan->units) FS_FUZZ_CHECK(!u.params.empty());
  CheckPlanInvariants(*plan);
  CheckPlanRoundTrip(*plan);
  absl::StatusOr<Plan> again = BuildPlan(*manifest, *policy, options);
  FS_FUZZ_CHECK(again.ok());
  FS_FUZZ_CHECK(*again == *plan);
}

// A mutated plan almost never carries a matching SHA-256 fingerprint, which would hide every
// plan the reader accepts from the invariants. So when the fingerprint is the only complaint,
// take the wanted value from the error ("... does not match the plan's content (HEX)") and
// read the document again.
absl::StatusOr<Plan> ReadPlanFixingFingerprint(absl::string_view text) {
  absl::StatusOr<Plan> plan = PlanFromJson(text);
  if (plan.ok()) return plan;
  const absl::string_view message = plan.status().message();
  const absl::string_view marker = "does not match the plan's content (";
  const size_t at = message.find(marker);
  if (at == absl::string_view::npos || message.size() < at + marker.size() + 64) return plan;
  absl::StatusOr<Json> doc = ParseJson(text, "plan");
  if (!doc.ok() || !doc->is_object()) return plan;
  (*doc)["fingerprint"] = std::string(message.substr(at + marker.size(), 64));
  return PlanFromJsonValue(*doc);
}

void FuzzPlanReader(absl::string_view text) {
  CheckSameAsDom(PlanFromJson(text), text, "plan",
                 [](const Json& v) { return PlanFromJsonValue(v); });
  absl::StatusOr<Plan> plan = ReadPlanFixingFingerprint(text);
  if (!plan.ok()) return;
  CheckPlanInvariants(*plan);
  CheckPlanRoundTrip(*plan);
}

}  // namespace
}  // namespace flatshard

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view raw(reinterpret_cast<const char*>(data), size);
  flatshard::FuzzPlanReader(raw);

  flatshard::PlanOptions options;
  options.world_size = 1 + (data[0] & 7);
  options.ranks_per_node = (data[0] >> 3) & 7;
  options.max_module_paths = flatshard::kMaxModulePaths;
  options.max_name_bytes = int64_t{4} << 20;  // keeps inputs with long names and many paths fast
  absl::string_view rest = raw.substr(1);
  absl::string_view manifest = rest;
  absl::string_view policy = "{}";
  if (size_t zero = rest.find('\0'); zero != absl::string_view::npos) {
    manifest = rest.substr(0, zero);
    policy = rest.substr(zero + 1);
  }
  flatshard::FuzzPlanner(manifest, policy, options);
  return 0;
}
