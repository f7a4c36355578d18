// Tests for common/plan: the JSON form of formats.md "Plan" (keys and order), the
// self-consistency checks of PlanFromJson, the fingerprint, SummarizeMemory and ShardRank.

#include "common/plan.h"
#include "common/plan_json_writer.h"

#include <cctype>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using OJson = nlohmann::ordered_json;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

using ::flatshard::testing::ReadFile;

std::string ExamplePath(const std::string& name) {
  return std::string(FS_SOURCE_DIR) + "/examples/models/" + name;
}

Manifest MustManifest(const std::string& text) {
  absl::StatusOr<Manifest> m = ManifestFromJson(text);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : Manifest{};
}

Policy MustPolicy(const std::string& text) {
  absl::StatusOr<Policy> p = PolicyFromJson(text);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : Policy{};
}

Plan MustPlan(const Manifest& m, const Policy& p, int32_t world, int32_t per_node = 0) {
  PlanOptions o;
  o.world_size = world;
  o.ranks_per_node = per_node;
  absl::StatusOr<Plan> plan = BuildPlan(m, p, o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : Plan{};
}

// The plan example of formats.md: GPT with wte, wpe and lm_head tied to wte.
constexpr char kGptManifest[] = R"({
  "format": "flatshard.manifest/1",
  "root": {"id": 0, "type": "GPT", "bases": ["Module"], "params": [], "children": [
    {"name": "wte", "module": {"id": 1, "type": "Embedding", "params": [
      {"name": "weight", "id": 0, "shape": [503, 48], "dtype": "float32"}]}},
    {"name": "wpe", "module": {"id": 2, "type": "Embedding", "params": [
      {"name": "weight", "id": 1, "shape": [64, 48], "dtype": "float32"}]}},
    {"name": "lm_head", "module": {"id": 3, "type": "Linear", "params": [
      {"name": "weight", "id": 0, "shape": [503, 48], "dtype": "float32"}]}}
  ]}
})";

// Three blocks of mixed sizes, a frozen-free tree with an ignored part.
constexpr char kBlocksManifest[] = R"({
  "format": "flatshard.manifest/1",
  "root": {"id": 0, "type": "Net", "params": [
      {"name": "scale", "id": 100, "shape": [], "dtype": "float32"}], "children": [
    {"name": "b0", "module": {"id": 1, "type": "Block", "params": [
      {"name": "w", "id": 0, "shape": [3, 5], "dtype": "float32"},
      {"name": "b", "id": 1, "shape": [3], "dtype": "float32"}]}},
    {"name": "b1", "module": {"id": 2, "type": "Block", "params": [
      {"name": "w", "id": 2, "shape": [7], "dtype": "float32"},
      {"name": "b", "id": 3, "shape": [1], "dtype": "float32"}], "children": [
      {"name": "inner", "module": {"id": 3, "type": "Linear", "params": [
        {"name": "w", "id": 4, "shape": [2, 2], "dtype": "float32"}]}}]}},
    {"name": "b2", "module": {"id": 4, "type": "Block", "params": [
      {"name": "w", "id": 5, "shape": [11], "dtype": "float32"}]}},
    {"name": "half", "module": {"id": 5, "type": "Half", "params": [
      {"name": "w", "id": 6, "shape": [5], "dtype": "bfloat16"},
      {"name": "v", "id": 7, "shape": [3], "dtype": "bfloat16"}]}}
  ]}
})";

constexpr char kBlocksPolicy[] = R"({
  "auto_wrap": {"kind": "module_types", "types": ["Block", "Half"]},
  "ignored_params": ["b1.inner.w"]
})";

std::vector<Plan> SamplePlans() {
  std::vector<Plan> plans;
  Manifest gpt = MustManifest(kGptManifest);
  Manifest blocks = MustManifest(kBlocksManifest);
  for (int32_t w : {1, 3, 4, 8}) {
    plans.push_back(MustPlan(gpt, Policy{}, w));
    Policy p = MustPolicy(kBlocksPolicy);
    plans.push_back(MustPlan(blocks, p, w));
    p.use_orig_params = true;
    plans.push_back(MustPlan(blocks, p, w));
    p.sharding_strategy = ShardingStrategy::kNoShard;
    plans.push_back(MustPlan(blocks, p, w));
    p.sharding_strategy = ShardingStrategy::kShardGradOp;
    plans.push_back(MustPlan(blocks, p, w));
  }
  Policy hybrid = MustPolicy(kBlocksPolicy);
  hybrid.sharding_strategy = ShardingStrategy::kHybridShard;
  plans.push_back(MustPlan(blocks, hybrid, 8, 4));
  hybrid.use_orig_params = true;
  plans.push_back(MustPlan(blocks, hybrid, 6, 3));
  for (const char* name : {"gpt_tied", "convnet_bn", "shared_module"}) {
    Manifest m = MustManifest(ReadFile(ExamplePath(std::string(name) + ".manifest.json")));
    Policy p = MustPolicy(ReadFile(ExamplePath(std::string(name) + ".policy.json")));
    for (int32_t w : {1, 3, 8}) plans.push_back(MustPlan(m, p, w));
  }
  return plans;
}

std::vector<std::string> Keys(const OJson& object) {
  std::vector<std::string> keys;
  for (const auto& [k, unused] : object.items()) keys.push_back(k);
  return keys;
}

// Recomputes every unit's layout and the fingerprint after a change made in code.
void Relayout(Plan& plan) {
  for (PlanUnit& u : plan.units) {
    absl::StatusOr<FlatLayout> l = UnitLayout(plan, u);
    ASSERT_TRUE(l.ok()) << l.status();
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].offset = l->offsets()[i];
    u.numel = l->numel();
    u.padded_numel = l->padded_numel();
    u.shard_numel = l->shard_numel();
  }
  plan.fingerprint = Fingerprint(plan);
}

absl::StatusOr<Plan> Reparse(const Plan& plan) { return PlanFromJson(PlanToJson(plan).dump()); }

// formats.md's plan example prints "numel": 27312 / "shard_numel": 6828 for these two params,
// but 24144 + 3072 = 27216 (a slip in the spec's example: its own numel rule is the sum); the
// documented rules give 27216 and 27216 / 4 = 6804.
TEST(PlanJsonTest, FormatsExampleContent) {
  Plan plan = MustPlan(MustManifest(kGptManifest), Policy{}, 4);
  OJson j = PlanToJson(plan);
  OJson without_fingerprint = j;
  without_fingerprint.erase("fingerprint");
  EXPECT_EQ(without_fingerprint, OJson::parse(R"({
    "format": "flatshard.plan/1",
    "world_size": 4,
    "sharding_strategy": "FULL_SHARD",
    "shard_world_size": 4,
    "use_orig_params": false,
    "units": [
      {
        "index": 0, "module": "", "module_type": "GPT",
        "dtype": "float32", "requires_grad": true,
        "params": [
          {"fqn": "wte.weight", "shape": [503, 48], "numel": 24144, "offset": 0},
          {"fqn": "wpe.weight", "shape": [64, 48], "numel": 3072, "offset": 24144}
        ],
        "shared": [{"fqn": "lm_head.weight", "same_as": "wte.weight"}],
        "numel": 27216, "padded_numel": 27216, "shard_numel": 6804
      }
    ],
    "ignored_params": [],
    "warnings": []
  })"))
      << j.dump(2);
  EXPECT_EQ(j["fingerprint"], Fingerprint(plan));
}

TEST(PlanJsonTest, KeysAreExactlyThoseOfFormatsMdInOrder) {
  for (const Plan& plan : SamplePlans()) {
    OJson j = PlanToJson(plan);
    EXPECT_THAT(Keys(j), ElementsAre("format", "world_size", "sharding_strategy",
                                     "shard_world_size", "use_orig_params", "units",
                                     "ignored_params", "warnings", "fingerprint"));
    ASSERT_FALSE(j["units"].empty());
    for (const OJson& u : j["units"]) {
      // Mixed precision's keys, where set, come right after "dtype".
      std::vector<std::string> keys = Keys(u);
      if (u.contains("compute_dtype")) {
        EXPECT_EQ(keys[4], "compute_dtype");
      }
      std::erase_if(
          keys, [](const std::string& k) { return k == "compute_dtype" || k == "reduce_dtype"; });
      EXPECT_THAT(keys, ElementsAre("index", "module", "module_type", "dtype", "requires_grad",
                                    "params", "shared", "numel", "padded_numel", "shard_numel"));
      for (const OJson& p : u["params"]) {
        EXPECT_THAT(Keys(p), ElementsAre("fqn", "shape", "numel", "offset"));
      }
      for (const OJson& s : u["shared"]) EXPECT_THAT(Keys(s), ElementsAre("fqn", "same_as"));
    }
  }
}

// compute_dtype / reduce_dtype appear after "dtype" only when set, round-trip, and change the
// fingerprint; a wrong name is refused naming the key.
TEST(PlanJsonTest, MixedPrecisionDTypesRoundTripAndCountInTheFingerprint) {
  Plan plan = MustPlan(MustManifest(kGptManifest), Policy{}, 4);
  const std::string plain = plan.fingerprint;
  plan.units[0].compute_dtype = DType::kBFloat16;
  plan.units[0].reduce_dtype = DType::kFloat16;
  plan.fingerprint = Fingerprint(plan);
  EXPECT_NE(plan.fingerprint, plain);
  OJson j = PlanToJson(plan);
  EXPECT_THAT(
      Keys(j["units"][0]),
      ElementsAre("index", "module", "module_type", "dtype", "compute_dtype", "reduce_dtype",
                  "requires_grad", "params", "shared", "numel", "padded_numel", "shard_numel"));
  absl::StatusOr<Plan> back = Reparse(plan);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
  j["units"][0]["compute_dtype"] = "int8";
  absl::StatusOr<Plan> bad = PlanFromJson(j.dump());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("compute_dtype"));
  EXPECT_THAT(bad.status().message(), HasSubstr("unknown floating dtype \"int8\""));
}

TEST(PlanJsonTest, RoundTripsPlansMadeByBuildPlan) {
  std::vector<Plan> plans = SamplePlans();
  ASSERT_GE(plans.size(), 30u);
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE(i);
    const Plan& plan = plans[i];
    EXPECT_EQ(plan.fingerprint, Fingerprint(plan));
    absl::StatusOr<Plan> back = Reparse(plan);
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << PlanToJson(plan).dump(2);
    EXPECT_EQ(*back, plan);
    absl::StatusOr<Plan> from_value = PlanFromJsonValue(Json::parse(PlanToJson(plan).dump()));
    ASSERT_TRUE(from_value.ok()) << from_value.status();
    EXPECT_EQ(*from_value, plan);
  }
}

// The direct writer is byte for byte PlanToJson(plan).dump(): every sample plan, mixed
// precision, and strings that need escapes or are not ASCII.
TEST(PlanJsonTest, DirectWriterEqualsTheDumpedDocument) {
  for (const Plan& plan : SamplePlans()) {
    EXPECT_EQ(PlanToJsonText(plan), PlanToJson(plan).dump()) << PlanToJson(plan).dump(2);
  }
  Plan plan = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 2);
  plan.warnings = {"", "second \"quoted\"\nline\t\\", "caf\xc3\xa9 \x7f \x01"};
  plan.units[0].compute_dtype = DType::kBFloat16;
  plan.units[0].reduce_dtype = DType::kFloat32;
  plan.units[0].module_type = "Ty/pe\"";
  EXPECT_EQ(PlanToJsonText(plan), PlanToJson(plan).dump());
  // Invalid UTF-8: U+FFFD with `replace` (proto_convert's FromProto), as dump() writes it.
  plan.warnings.push_back("bad \xff\xfe byte");
  EXPECT_EQ(PlanToJsonText(plan, Json::error_handler_t::replace),
            PlanToJson(plan).dump(-1, ' ', false, Json::error_handler_t::replace));
  plan.warnings = {};
  plan.ignored_params = {};
  EXPECT_EQ(PlanToJsonText(plan), PlanToJson(plan).dump());
}

TEST(PlanJsonTest, RoundTripKeepsWarningsAndIgnoredParams) {
  Plan plan = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 2);
  EXPECT_THAT(plan.ignored_params, ElementsAre("b1.inner.w"));
  plan.warnings = {"first warning", "second \"quoted\"\nline"};
  absl::StatusOr<Plan> back = Reparse(plan);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->warnings, plan.warnings);
  EXPECT_EQ(back->ignored_params, plan.ignored_params);
}

TEST(PlanJsonTest, OptionalKeysDefaultFromTheStrategy) {
  Plan plan = MustPlan(MustManifest(kGptManifest), Policy{}, 4);
  Json j = Json::parse(PlanToJson(plan).dump());
  j.erase("sharding_strategy");
  j.erase("shard_world_size");
  j.erase("use_orig_params");
  j.erase("ignored_params");
  j.erase("warnings");
  absl::StatusOr<Plan> back = PlanFromJsonValue(j);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);

  Policy no_shard;
  no_shard.sharding_strategy = ShardingStrategy::kNoShard;
  plan = MustPlan(MustManifest(kGptManifest), no_shard, 4);
  EXPECT_EQ(plan.shard_world_size, 1);
  EXPECT_EQ(plan.units[0].shard_numel, plan.units[0].padded_numel);
  j = Json::parse(PlanToJson(plan).dump());
  j.erase("shard_world_size");
  back = PlanFromJsonValue(j);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
}

class PlanTamperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    plan_ = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 4);
    ASSERT_GE(plan_.units.size(), 3u);
    json_ = Json::parse(PlanToJson(plan_).dump());
  }
  void ExpectRefused(const Json& j, const std::string& message) {
    absl::StatusOr<Plan> p = PlanFromJsonValue(j);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(Msg(p.status()), message);
    absl::StatusOr<Plan> from_text = PlanFromJson(j.dump());
    ASSERT_FALSE(from_text.ok());
    EXPECT_EQ(Msg(from_text.status()), message);
  }
  Plan plan_;
  Json json_;
};

TEST_F(PlanTamperTest, UntouchedPlanIsAccepted) {
  absl::StatusOr<Plan> p = PlanFromJsonValue(json_);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, plan_);
}

TEST_F(PlanTamperTest, OffsetIsRefused) {
  // Unit 1 is b0 (w [3,5], b [3]): b sits at 15.
  ASSERT_EQ(json_["units"][1]["module"], "b0");
  ASSERT_EQ(json_["units"][1]["params"][1]["offset"], 15);
  json_["units"][1]["params"][1]["offset"] = 16;
  ExpectRefused(json_,
                "plan: $.units[1].params[1].offset: offset 16 does not match the layout rules "
                "(want 15)");
}

TEST_F(PlanTamperTest, OffsetIsRefusedEvenWithARecomputedFingerprint) {
  Plan p = plan_;
  p.units[1].params[1].offset = 16;
  p.fingerprint = Fingerprint(p);
  absl::StatusOr<Plan> back = Reparse(p);
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(Msg(back.status()),
            "plan: $.units[1].params[1].offset: offset 16 does not match the layout rules (want "
            "15)");
}

TEST_F(PlanTamperTest, ParamNumelIsRefused) {
  json_["units"][1]["params"][0]["numel"] = 16;
  ExpectRefused(json_, "plan: $.units[1].params[0].numel: numel 16 does not match shape [3, 5]");
  json_ = Json::parse(PlanToJson(plan_).dump());
  json_["units"][1]["params"][0]["shape"] = Json::array({5, 3, 1});
  json_["units"][1]["params"][0]["numel"] = 16;
  ExpectRefused(json_, "plan: $.units[1].params[0].numel: numel 16 does not match shape [5, 3, 1]");
}

TEST_F(PlanTamperTest, UnitSizesAreRefused) {
  // b0: numel 18, padded 20, shard 5.
  ASSERT_EQ(json_["units"][1]["numel"], 18);
  ASSERT_EQ(json_["units"][1]["padded_numel"], 20);
  ASSERT_EQ(json_["units"][1]["shard_numel"], 5);
  Json j = json_;
  j["units"][1]["numel"] = 17;
  ExpectRefused(j,
                "plan: $.units[1]: numel/padded_numel/shard_numel 17/20/5 do not match the "
                "layout rules (want 18/20/5)");
  j = json_;
  j["units"][1]["padded_numel"] = 24;
  ExpectRefused(j,
                "plan: $.units[1]: numel/padded_numel/shard_numel 18/24/5 do not match the "
                "layout rules (want 18/20/5)");
  j = json_;
  j["units"][1]["shard_numel"] = 6;
  ExpectRefused(j,
                "plan: $.units[1]: numel/padded_numel/shard_numel 18/20/6 do not match the "
                "layout rules (want 18/20/5)");
  j = json_;
  j["units"][1]["shard_numel"] = -5;
  ExpectRefused(j, "plan: $.units[1].shard_numel: must be at least 0, got -5");
}

TEST_F(PlanTamperTest, FingerprintIsRefused) {
  const std::string good = json_["fingerprint"];
  std::string bad = good;
  bad[0] = bad[0] == '0' ? '1' : '0';
  json_["fingerprint"] = bad;
  ExpectRefused(json_, "plan: $.fingerprint: fingerprint \"" + bad +
                           "\" does not match the plan's content (" + good + ")");
  json_.erase("fingerprint");
  ExpectRefused(json_, "plan: $: missing required key \"fingerprint\"");
}

TEST_F(PlanTamperTest, ContentChangeUnderTheOldFingerprintIsRefused) {
  const std::string good = json_["fingerprint"];
  Json j = json_;
  j["ignored_params"] = Json::array({"b1.inner.x"});
  absl::StatusOr<Plan> p = PlanFromJsonValue(j);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.fingerprint: fingerprint \"" + good + "\""));
  j = json_;
  j["units"][1]["params"][0]["fqn"] = "b0.W";
  p = PlanFromJsonValue(j);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.fingerprint: "));
  j = json_;
  j["units"][1]["module_type"] = "Other";
  p = PlanFromJsonValue(j);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.fingerprint: "));
  // Warnings are not part of the fingerprint.
  j = json_;
  j["warnings"] = Json::array({"anything"});
  p = PlanFromJsonValue(j);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->warnings, ElementsAre("anything"));
}

TEST_F(PlanTamperTest, StructuralErrorsNameThePath) {
  Json j = json_;
  j["units"][2]["index"] = 1;
  ExpectRefused(j, "plan: $.units[2].index: must be 2, got 1");
  j = json_;
  j["format"] = "flatshard.plan/2";
  ExpectRefused(
      j, "plan: $.format: unknown format \"flatshard.plan/2\", expected \"flatshard.plan/1\"");
  j = json_;
  j["world_size"] = 0;
  ExpectRefused(j, "plan: $.world_size: must be in [1, 2147483647], got 0");
  j = json_;
  j["shard_world_size"] = 3;
  ExpectRefused(j, "plan: $.shard_world_size: must equal world_size 4 for FULL_SHARD");
  j = json_;
  j["shard_world_size"] = 5;
  ExpectRefused(j, "plan: $.shard_world_size: must be in [1, 4], got 5");
  j = json_;
  j["sharding_strategy"] = "ZERO3";
  ExpectRefused(j, "plan: $.sharding_strategy: unknown sharding strategy \"ZERO3\"");
  j = json_;
  j["units"][0]["dtype"] = "int64";
  ExpectRefused(j, "plan: $.units[0].dtype: unknown floating dtype \"int64\"");
  j = json_;
  j["units"][0]["extra"] = 1;
  ExpectRefused(j,
                "plan: $.units[0]: unknown key \"extra\" (allowed: index, module, module_type, "
                "dtype, compute_dtype, reduce_dtype, requires_grad, params, shared, numel, "
                "padded_numel, shard_numel)");
  j = json_;
  j["units"][1]["params"][0]["stride"] = 1;
  ExpectRefused(j,
                "plan: $.units[1].params[0]: unknown key \"stride\" (allowed: fqn, shape, numel, "
                "offset)");
  j = json_;
  j["units"][1]["shared"] = Json::array({Json{{"fqn", "x"}}});
  ExpectRefused(j, "plan: $.units[1].shared[0]: missing required key \"same_as\"");
  j = json_;
  j["units"][1]["params"][0]["shape"][0] = -3;
  ExpectRefused(j, "plan: $.units[1].params[0].shape[0]: must be at least 0, got -3");
  j = json_;
  j["unit"] = j["units"];
  ExpectRefused(j,
                "plan: $: unknown key \"unit\" (allowed: format, world_size, sharding_strategy, "
                "shard_world_size, use_orig_params, units, ignored_params, warnings, fingerprint)");
  absl::StatusOr<Plan> p = PlanFromJson("{\"format\": ");
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: malformed JSON: "));
}

TEST_F(PlanTamperTest, ShardWorldSizeMustMatchTheStrategy) {
  // A self-consistent plan (sizes recomputed, fingerprint matching) whose shard_world_size
  // contradicts its strategy: Plan::shard_world_size is "world_size, 1 for NO_SHARD, ranks per
  // node for HYBRID_SHARD". BuildPlan never makes one; ranks reading it would disagree about
  // who owns which range.
  Plan full = plan_;
  full.shard_world_size = 2;  // FULL_SHARD over 4 ranks
  Relayout(full);
  Plan none = plan_;
  none.sharding_strategy = ShardingStrategy::kNoShard;
  none.shard_world_size = 4;  // NO_SHARD must be 1
  Relayout(none);
  absl::StatusOr<Plan> full_back = Reparse(full);
  absl::StatusOr<Plan> none_back = Reparse(none);
  ASSERT_FALSE(full_back.ok());
  ASSERT_FALSE(none_back.ok());
  EXPECT_THAT(Msg(full_back.status()), StartsWith("plan: $.shard_world_size: "));
  EXPECT_THAT(Msg(none_back.status()), StartsWith("plan: $.shard_world_size: "));
}

TEST(PlanFromJsonTest, OverflowingUnitIsRefusedNamingThePath) {
  const std::string text = R"({"format": "flatshard.plan/1", "world_size": 1, "units": [
    {"index": 0, "module": "", "module_type": "Net", "dtype": "float32", "requires_grad": true,
     "params": [
       {"fqn": "a", "shape": [9223372036854775807], "numel": 9223372036854775807, "offset": 0},
       {"fqn": "b", "shape": [9223372036854775807], "numel": 9223372036854775807, "offset": 0}],
     "numel": 0, "padded_numel": 0, "shard_numel": 0}],
    "fingerprint": "0"})";
  absl::StatusOr<Plan> p = PlanFromJson(text);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(p.status()), HasSubstr("exceed 2^63 elements"));
  EXPECT_THAT(Msg(p.status()), StartsWith("plan: $.units[0]: "));
}

TEST(PlanFingerprintTest, IsSixtyFourHexDigitsAndStable) {
  std::vector<Plan> a = SamplePlans();
  std::vector<Plan> b = SamplePlans();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].fingerprint.size(), 64u);
    for (char c : a[i].fingerprint) EXPECT_TRUE(std::isxdigit(c) && !std::isupper(c));
    EXPECT_EQ(a[i].fingerprint, b[i].fingerprint);
    EXPECT_EQ(Fingerprint(a[i]), a[i].fingerprint);
  }
  // Plans that differ in more than warnings have different fingerprints.
  for (Plan& p : a) p.warnings.clear();
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t k = i + 1; k < a.size(); ++k) {
      if (a[i] == a[k]) {
        EXPECT_EQ(a[i].fingerprint, a[k].fingerprint);
      } else {
        EXPECT_NE(a[i].fingerprint, a[k].fingerprint) << i << " " << k;
      }
    }
  }
}

TEST(PlanFingerprintTest, IgnoresWarningsAndTheStoredFingerprint) {
  Plan p = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 4);
  const std::string fp = Fingerprint(p);
  Plan q = p;
  q.warnings = {"a warning"};
  EXPECT_EQ(Fingerprint(q), fp);
  q.fingerprint = "something else";
  EXPECT_EQ(Fingerprint(q), fp);
}

TEST(PlanFingerprintTest, ChangesWithEveryFact) {
  const Plan base = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 4);
  ASSERT_GE(base.units.size(), 2u);
  const std::string fp = Fingerprint(base);
  std::vector<std::pair<std::string, std::function<void(Plan&)>>> changes = {
      {"world_size", [](Plan& p) { p.world_size = 8; }},
      {"sharding_strategy", [](Plan& p) { p.sharding_strategy = ShardingStrategy::kShardGradOp; }},
      {"shard_world_size", [](Plan& p) { p.shard_world_size = 2; }},
      {"use_orig_params", [](Plan& p) { p.use_orig_params = true; }},
      {"unit index", [](Plan& p) { p.units[1].index = 7; }},
      {"unit module", [](Plan& p) { p.units[1].module = "b9"; }},
      {"unit module_type", [](Plan& p) { p.units[1].module_type = "Blok"; }},
      {"unit dtype", [](Plan& p) { p.units[1].dtype = DType::kFloat16; }},
      {"unit requires_grad", [](Plan& p) { p.units[1].requires_grad = false; }},
      {"unit numel", [](Plan& p) { p.units[1].numel += 1; }},
      {"unit padded_numel", [](Plan& p) { p.units[1].padded_numel += 4; }},
      {"unit shard_numel", [](Plan& p) { p.units[1].shard_numel += 1; }},
      {"param fqn", [](Plan& p) { p.units[1].params[0].fqn = "b0.v"; }},
      {"param shape",
       [](Plan& p) {
         p.units[1].params[0].shape = {5, 3};
       }},
      {"param numel", [](Plan& p) { p.units[1].params[0].numel += 1; }},
      {"param offset", [](Plan& p) { p.units[1].params[1].offset += 1; }},
      {"param order", [](Plan& p) { std::swap(p.units[1].params[0], p.units[1].params[1]); }},
      {"shared added",
       [](Plan& p) {
         p.units[1].shared.push_back({"x.w", "b0.w"});
       }},
      {"unit order", [](Plan& p) { std::swap(p.units[0], p.units[1]); }},
      {"unit removed", [](Plan& p) { p.units.pop_back(); }},
      {"ignored param", [](Plan& p) { p.ignored_params.push_back("b2.w"); }},
      {"ignored removed", [](Plan& p) { p.ignored_params.clear(); }},
  };
  for (const auto& [what, change] : changes) {
    Plan p = base;
    change(p);
    EXPECT_NE(Fingerprint(p), fp) << what;
  }
}

TEST(PlanFingerprintTest, DistinguishesFieldBoundaries) {
  // Names may hold any character but '.', including the separator byte the canonical text
  // uses (0x1f). Moving it from one field to the next must change the fingerprint.
  Plan a = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 4);
  Plan b = a;
  a.units[1].module =
      "b0\x1f"
      "Block";
  a.units[1].module_type = "X";
  b.units[1].module = "b0";
  b.units[1].module_type =
      "Block\x1f"
      "X";
  ASSERT_FALSE(a == b);
  // Fields are length-prefixed, so no content can imitate a field boundary.
  EXPECT_NE(Fingerprint(a), Fingerprint(b));
}

TEST(PlanMemoryTest, SumsShardAndUnshardedBytes) {
  Plan plan;
  plan.world_size = 4;
  plan.shard_world_size = 4;
  PlanUnit u0;
  u0.dtype = DType::kFloat32;
  u0.numel = 10;
  u0.padded_numel = 12;
  u0.shard_numel = 3;
  PlanUnit u1;
  u1.dtype = DType::kBFloat16;
  u1.numel = 5;
  u1.padded_numel = 8;
  u1.shard_numel = 2;
  PlanUnit u2;
  u2.dtype = DType::kFloat64;
  u2.numel = 1;
  u2.padded_numel = 4;
  u2.shard_numel = 1;
  plan.units = {u0, u1, u2};
  PlanMemory m = SummarizeMemory(plan);
  EXPECT_EQ(m.shard_bytes, 3 * 4 + 2 * 2 + 1 * 8);
  EXPECT_EQ(m.unsharded_bytes, 12 * 4 + 8 * 2 + 4 * 8);
  EXPECT_EQ(m.peak_summon_bytes, 24 + 96);
  EXPECT_EQ(u0.padding_numel(), 2);

  plan.sharding_strategy = ShardingStrategy::kShardGradOp;
  EXPECT_EQ(SummarizeMemory(plan).peak_summon_bytes, 120);
  plan.sharding_strategy = ShardingStrategy::kHybridShard;
  EXPECT_EQ(SummarizeMemory(plan).peak_summon_bytes, 120);

  EXPECT_EQ(SummarizeMemory(Plan{}).shard_bytes, 0);
  EXPECT_EQ(SummarizeMemory(Plan{}).peak_summon_bytes, 0);
}

TEST(PlanMemoryTest, NoShardSummonsInPlace) {
  Policy p = MustPolicy(kBlocksPolicy);
  p.sharding_strategy = ShardingStrategy::kNoShard;
  Plan plan = MustPlan(MustManifest(kBlocksManifest), p, 4);
  PlanMemory m = SummarizeMemory(plan);
  EXPECT_EQ(m.shard_bytes, m.unsharded_bytes);
  EXPECT_EQ(m.peak_summon_bytes, m.shard_bytes);
  int64_t bytes = 0;
  for (const PlanUnit& u : plan.units) bytes += u.padded_numel * ItemSize(u.dtype);
  EXPECT_EQ(m.shard_bytes, bytes);
}

TEST(PlanMemoryTest, MatchesTheGptExample) {
  Plan plan = MustPlan(MustManifest(kGptManifest), Policy{}, 4);
  PlanMemory m = SummarizeMemory(plan);
  EXPECT_EQ(m.shard_bytes, 6804 * 4);
  EXPECT_EQ(m.unsharded_bytes, 27216 * 4);
  EXPECT_EQ(m.peak_summon_bytes, (6804 + 27216) * 4);
}

TEST(PlanShardRankTest, HybridShardsWithinANode) {
  Policy p = MustPolicy(kBlocksPolicy);
  p.sharding_strategy = ShardingStrategy::kHybridShard;
  Plan plan = MustPlan(MustManifest(kBlocksManifest), p, 8, 4);
  EXPECT_EQ(plan.world_size, 8);
  EXPECT_EQ(plan.shard_world_size, 4);
  std::vector<int32_t> ranks;
  for (int32_t r = 0; r < 8; ++r) ranks.push_back(plan.ShardRank(r));
  EXPECT_THAT(ranks, ElementsAre(0, 1, 2, 3, 0, 1, 2, 3));
  // Units are sharded over the node: ceil(numel / 4).
  for (const PlanUnit& u : plan.units) {
    EXPECT_EQ(u.shard_numel, (u.numel + 3) / 4) << u.module;
    EXPECT_EQ(u.padded_numel, u.shard_numel * 4) << u.module;
  }
}

TEST(PlanShardRankTest, FullShardAndNoShard) {
  Plan full = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 3);
  std::vector<int32_t> ranks;
  for (int32_t r = 0; r < 3; ++r) ranks.push_back(full.ShardRank(r));
  EXPECT_THAT(ranks, ElementsAre(0, 1, 2));
  Policy p = MustPolicy(kBlocksPolicy);
  p.sharding_strategy = ShardingStrategy::kNoShard;
  Plan none = MustPlan(MustManifest(kBlocksManifest), p, 3);
  ranks.clear();
  for (int32_t r = 0; r < 3; ++r) ranks.push_back(none.ShardRank(r));
  EXPECT_THAT(ranks, ElementsAre(0, 0, 0));
}

TEST(PlanShardRankTest, OutOfRangeRankIsAProgrammerError) {
  Plan plan = MustPlan(MustManifest(kBlocksManifest), MustPolicy(kBlocksPolicy), 2);
  EXPECT_DEATH(plan.ShardRank(2), "rank 2 of 2");
  EXPECT_DEATH(plan.ShardRank(-1), "rank -1 of 2");
}

TEST(UnitLayoutTest, ReproducesTheUnitsOfBuiltPlans) {
  for (const Plan& plan : SamplePlans()) {
    for (const PlanUnit& u : plan.units) {
      absl::StatusOr<FlatLayout> l = UnitLayout(plan, u);
      ASSERT_TRUE(l.ok()) << l.status();
      ASSERT_EQ(l->offsets().size(), u.params.size());
      for (size_t i = 0; i < u.params.size(); ++i) EXPECT_EQ(l->offsets()[i], u.params[i].offset);
      EXPECT_EQ(l->numel(), u.numel);
      EXPECT_EQ(l->padded_numel(), u.padded_numel);
      EXPECT_EQ(l->shard_numel(), u.shard_numel);
      EXPECT_EQ(l->shard_world_size(), plan.shard_world_size);
    }
  }
}

TEST(UnitLayoutTest, UseOrigParamsAlignsOffsets) {
  Policy p = MustPolicy(kBlocksPolicy);
  p.use_orig_params = true;
  Plan plan = MustPlan(MustManifest(kBlocksManifest), p, 3);
  // b0: w [3,5] at 0, b [3] at 16 (float32: 4-element alignment); 19 padded to 21.
  const PlanUnit* b0 = nullptr;
  const PlanUnit* half = nullptr;
  for (const PlanUnit& u : plan.units) {
    if (u.module == "b0") b0 = &u;
    if (u.module == "half") half = &u;
  }
  ASSERT_NE(b0, nullptr);
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(b0->params[1].offset, 16);
  EXPECT_EQ(b0->numel, 18);
  EXPECT_EQ(b0->padded_numel, 21);
  EXPECT_EQ(b0->shard_numel, 7);
  // half: bfloat16 w [5] at 0, v [3] at 8; 11 padded to 12.
  EXPECT_EQ(half->dtype, DType::kBFloat16);
  EXPECT_EQ(half->params[1].offset, 8);
  EXPECT_EQ(half->padded_numel, 12);
  EXPECT_EQ(half->shard_numel, 4);
}

}  // namespace
}  // namespace flatshard
