// Tests for common/plan_reader: PlanFromJson's one-pass path accepts exactly the plan documents
// the DOM path (ParseJson + PlanFromJsonValue) accepts, with an equal Plan, and leaves every
// error to it, so PlanFromJson's messages are the DOM path's, byte for byte. The mutation
// corpus is generated from a fixed seed: the same cases on every run.

#include "common/plan_reader.h"

#include <random>
#include <string>
#include <vector>

#include "common/json_util.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/plan_json_writer.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

// The old PlanFromJson: the reference for results and messages.
absl::StatusOr<Plan> ReadWithDom(const std::string& text) {
  absl::StatusOr<Json> doc = ParseJson(text, "plan");
  if (!doc.ok()) return doc.status();
  return PlanFromJsonValue(*doc);
}

void ExpectSameAsDom(const std::string& text) {
  absl::StatusOr<Plan> dom = ReadWithDom(text);
  absl::StatusOr<Plan> got = PlanFromJson(text);
  ASSERT_EQ(got.status(), dom.status()) << text;
  if (got.ok()) {
    EXPECT_TRUE(*got == *dom) << text;
  }
}

// Plans of the gpt_tied example under policies that use every field: mixed precision,
// use_orig_params, ignored parameters, NO_SHARD and HYBRID_SHARD (shard_world_size < world).
std::vector<Plan> ExamplePlans() {
  absl::StatusOr<Manifest> manifest =
      ManifestFromJson(testing::ExampleModelFile("gpt_tied", "manifest"));
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  struct Case {
    const char* policy;
    int32_t world, per_node;
  };
  const Case cases[] = {
      {R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Block"]},
           "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}})",
       4, 0},
      {R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "always"}, "use_orig_params": true})",
       3, 0},
      {R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "always"},
           "sharding_strategy": "NO_SHARD"})",
       2, 0},
      {R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Block"]},
           "sharding_strategy": "HYBRID_SHARD"})",
       4, 2},
  };
  std::vector<Plan> plans;
  for (const Case& c : cases) {
    absl::StatusOr<Policy> policy = PolicyFromJson(c.policy);
    EXPECT_TRUE(policy.ok()) << policy.status();
    PlanOptions options;
    options.world_size = c.world;
    options.ranks_per_node = c.per_node;
    absl::StatusOr<Plan> plan = BuildPlan(*manifest, *policy, options);
    EXPECT_TRUE(plan.ok()) << plan.status();
    plan->warnings.push_back("a warning (not in the fingerprint)");
    plans.push_back(*std::move(plan));
  }
  return plans;
}

TEST(PlanReaderTest, ReadsEverySpellingOfAValidPlanAsTheDomPathDoes) {
  for (const Plan& plan : ExamplePlans()) {
    const std::string text = PlanToJsonText(plan);
    for (const std::string& spelling :
         {text, Json::parse(text).dump(), Json::parse(text).dump(2)}) {
      ASSERT_TRUE(ScanPlan(spelling).has_value()) << spelling;
      absl::StatusOr<Plan> got = PlanFromJson(spelling);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == plan);
      ExpectSameAsDom(spelling);
    }
  }
}

TEST(PlanReaderTest, OptionalKeysDefaultAsInTheDomPath) {
  Plan plan = ExamplePlans()[1];  // FULL_SHARD over 3 ranks
  Json j = Json::parse(PlanToJsonText(plan));
  j.erase("sharding_strategy");
  j.erase("shard_world_size");
  j.erase("ignored_params");
  j.erase("warnings");
  for (Json& u : j["units"]) u.erase("shared");
  ASSERT_TRUE(ScanPlan(j.dump()).has_value());
  ExpectSameAsDom(j.dump());
  EXPECT_TRUE(PlanFromJson(j.dump()).ok());
}

// Byte-level mutations (deleted, replaced, inserted bytes, changed digits, repeated spans):
// PlanFromJson answers as the DOM path, message included.
TEST(PlanReaderTest, MutatedDocumentsGetTheDomPathsAnswer) {
  std::mt19937 rng(27);  // fixed: the same corpus on every run
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  const std::string snippets[] = {"{",
                                  "}",
                                  "[",
                                  "]",
                                  "\"",
                                  ":",
                                  ",",
                                  "0",
                                  "-",
                                  ".",
                                  "e",
                                  "\\",
                                  " ",
                                  "true",
                                  "false",
                                  "\"index\":1,",
                                  "\"shared\":[],"};
  int scanned = 0, total = 0;
  for (const Plan& plan : ExamplePlans()) {
    const std::string base = PlanToJsonText(plan);
    for (int round = 0; round < 600; ++round) {
      std::string text = base;
      const size_t at = pick(text.size());
      switch (pick(5)) {
        case 0:
          text.erase(at, 1 + pick(3));
          break;
        case 1:
          text.insert(at, snippets[pick(std::size(snippets))]);
          break;
        case 2: {
          const size_t digit = text.find_first_of("0123456789", at);
          if (digit != std::string::npos) text[digit] = static_cast<char>('0' + pick(10));
          break;
        }
        case 3:
          text.insert(at, text.substr(at, 1 + pick(40)));
          break;
        default:
          text[at] = snippets[pick(std::size(snippets))][0];
      }
      ++total;
      if (ScanPlan(text).has_value()) ++scanned;
      ExpectSameAsDom(text);
      if (HasFatalFailure()) return;
    }
  }
  RecordProperty("scanned", scanned);
  RecordProperty("mutants", total);
  EXPECT_GT(scanned, 0);
}

TEST(PlanReaderTest, EscapesAreLeftToTheDomPath) {
  Plan plan = ExamplePlans()[0];
  std::string text = PlanToJsonText(plan);
  const size_t at = text.find("\"warnings\":[\"a");
  ASSERT_NE(at, std::string::npos);
  text.replace(at + 13, 1, "\\u0061");  // the same "a", escaped
  EXPECT_FALSE(ScanPlan(text).has_value());
  absl::StatusOr<Plan> got = PlanFromJson(text);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == plan);
}

}  // namespace
}  // namespace flatshard
