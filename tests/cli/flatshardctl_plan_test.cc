// Runs the built `flatshardctl` binary as a user would: `plan` on the example models, the table
// format, help, and the refusal contract of formats.md (exit 2, nothing on stdout, exactly one
// line on stderr naming the file, JSON path or module).

#include <fcntl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/manifest.h"
#include "common/plan.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cli/ctl_runner.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

const std::string kExamples = std::string(FS_SOURCE_DIR) + "/examples/models/";
const std::string kData = std::string(FS_SOURCE_DIR) + "/tests/cli/data/";

using Result = ::flatshard::testing::CtlResult;
using ::flatshard::testing::CtlPath;
using ::flatshard::testing::Lines;
using ::flatshard::testing::ReadFile;
using ::flatshard::testing::RunCtl;

// The refusal contract: exit 2, empty stdout, exactly one newline-terminated line on stderr.
void ExpectRefused(const std::vector<std::string>& args, const std::vector<std::string>& parts) {
  std::string cmd;
  for (const std::string& a : args) cmd += " " + a;
  SCOPED_TRACE("flatshardctl" + cmd);
  Result r = RunCtl(args);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_EQ(Lines(r.err).size(), 1u) << r.err;
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.back(), '\n');
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_THAT(r.err, StartsWith("flatshardctl plan: "));
  for (const std::string& part : parts) EXPECT_THAT(r.err, HasSubstr(part));
}

TEST(FlatshardctlPlanTest, BinaryExists) {
  ASSERT_EQ(access(CtlPath().c_str(), X_OK), 0) << CtlPath();
}

class ExamplePlanTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ExamplePlanTest, PrintsJsonThatPlanFromJsonAccepts) {
  const auto& [model, world] = GetParam();
  const std::string manifest = kExamples + model + ".manifest.json";
  const std::string policy = kExamples + model + ".policy.json";
  Result r = RunCtl(
      {"plan", "--manifest", manifest, "--policy", policy, "--world-size", std::to_string(world)});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, IsEmpty());
  absl::StatusOr<Plan> printed = PlanFromJson(r.out);
  ASSERT_TRUE(printed.ok()) << printed.status() << "\n" << r.out;
  EXPECT_EQ(printed->world_size, world);
  EXPECT_FALSE(printed->units.empty());
  // Same plan as the library makes in process.
  absl::StatusOr<Manifest> m = ManifestFromJson(ReadFile(manifest));
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<Policy> p = PolicyFromJson(ReadFile(policy));
  ASSERT_TRUE(p.ok()) << p.status();
  PlanOptions options;
  options.world_size = world;
  absl::StatusOr<Plan> expected = BuildPlan(*m, *p, options);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(*printed, *expected);
  // And the printed text is exactly the documented JSON form.
  EXPECT_EQ(r.out, PlanToJson(*expected).dump(2) + "\n");
}

TEST_P(ExamplePlanTest, TableHasARowPerUnitTotalsAndPeak) {
  const auto& [model, world] = GetParam();
  const std::string manifest = kExamples + model + ".manifest.json";
  const std::string policy = kExamples + model + ".policy.json";
  Result r = RunCtl({"plan", "--manifest", manifest, "--policy", policy, "--world-size",
                     std::to_string(world), "--format", "table"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, IsEmpty());
  absl::StatusOr<Manifest> m = ManifestFromJson(ReadFile(manifest));
  absl::StatusOr<Policy> p = PolicyFromJson(ReadFile(policy));
  ASSERT_TRUE(m.ok() && p.ok());
  PlanOptions options;
  options.world_size = world;
  absl::StatusOr<Plan> plan = BuildPlan(*m, *p, options);
  ASSERT_TRUE(plan.ok()) << plan.status();

  const std::vector<std::string> lines = Lines(r.out);
  // Unit rows start with the right-aligned unit index.
  const std::regex unit_row(R"(^\s*(\d+)  (\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s.*$)");
  std::vector<std::string> rows;
  int64_t params = 0, numel = 0, padding = 0;
  for (const std::string& line : lines) {
    std::smatch match;
    if (!std::regex_match(line, match, unit_row)) continue;
    const size_t i = rows.size();
    rows.push_back(line);
    ASSERT_LT(i, plan->units.size()) << r.out;
    const PlanUnit& u = plan->units[i];
    EXPECT_EQ(match[1].str(), std::to_string(i));
    EXPECT_EQ(match[2].str(), u.module.empty() ? "(root)" : u.module);
    EXPECT_EQ(match[4].str(), std::string(DTypeName(u.dtype)));
    EXPECT_EQ(match[5].str(), std::to_string(u.params.size()));
    EXPECT_EQ(match[6].str(), std::to_string(u.numel));
    EXPECT_EQ(match[7].str(), std::to_string(u.padding_numel()));
    params += static_cast<int64_t>(u.params.size());
    numel += u.numel;
    padding += u.padding_numel();
  }
  EXPECT_EQ(rows.size(), plan->units.size()) << r.out;
  // One totals row with the sums.
  int totals = 0;
  for (const std::string& line : lines) {
    if (!std::regex_search(line, std::regex(R"(^\s*total\s)"))) continue;
    ++totals;
    EXPECT_THAT(line, HasSubstr(std::to_string(plan->units.size()) + " units"));
    std::smatch match;
    ASSERT_TRUE(std::regex_search(line, match, std::regex(R"(units\s+(\d+)\s+(\d+)\s+(\d+)\s)")))
        << line;
    EXPECT_EQ(match[1].str(), std::to_string(params));
    EXPECT_EQ(match[2].str(), std::to_string(numel));
    EXPECT_EQ(match[3].str(), std::to_string(padding));
  }
  EXPECT_EQ(totals, 1) << r.out;
  int peak = 0;
  for (const std::string& line : lines) peak += line.find("peak") != std::string::npos;
  EXPECT_EQ(peak, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("world_size " + std::to_string(world)));
  EXPECT_THAT(r.out, HasSubstr(plan->fingerprint.substr(0, 16)));
}

INSTANTIATE_TEST_SUITE_P(Examples, ExamplePlanTest,
                         ::testing::Combine(::testing::Values("gpt_tied", "convnet_bn",
                                                              "shared_module"),
                                            ::testing::Values(1, 3, 8)),
                         [](const ::testing::TestParamInfo<ExamplePlanTest::ParamType>& info) {
                           return std::get<0>(info.param) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(FlatshardctlPlanTest, FlagFormsAreEquivalent) {
  const std::string manifest = kExamples + "gpt_tied.manifest.json";
  const std::string policy = kExamples + "gpt_tied.policy.json";
  Result a = RunCtl({"plan", "--manifest", manifest, "--policy", policy, "--world-size", "4"});
  Result b =
      RunCtl({"plan", "--manifest=" + manifest, "--policy=" + policy, "--world-size=4", "--json"});
  Result c = RunCtl({"plan", "--world-size", "4", "--format", "json", "--policy", policy,
                     "--manifest", manifest});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_EQ(b.exit_code, 0) << b.err;
  EXPECT_EQ(c.exit_code, 0) << c.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out, c.out);
}

TEST(FlatshardctlPlanTest, PolicyIsOptional) {
  Result r =
      RunCtl({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--world-size", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  absl::StatusOr<Plan> plan = PlanFromJson(r.out);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // No auto-wrap: one unit at the root.
  ASSERT_EQ(plan->units.size(), 1u);
  EXPECT_EQ(plan->units[0].module, "");
}

TEST(FlatshardctlPlanTest, HybridShardUsesRanksPerNode) {
  const std::string policy =
      ::testing::TempDir() + "/hybrid_" + std::to_string(getpid()) + ".policy.json";
  std::ofstream(policy) << R"({"auto_wrap": {"kind": "module_types", "types": ["Block"]},
                              "sharding_strategy": "HYBRID_SHARD"})";
  Result r = RunCtl({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--policy", policy,
                     "--world-size", "8", "--ranks-per-node", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  absl::StatusOr<Plan> plan = PlanFromJson(r.out);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->sharding_strategy, ShardingStrategy::kHybridShard);
  EXPECT_EQ(plan->world_size, 8);
  EXPECT_EQ(plan->shard_world_size, 4);
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--policy", policy,
                 "--world-size", "8", "--ranks-per-node", "3"},
                {"HYBRID_SHARD", "ranks per node 3"});
  unlink(policy.c_str());
}

TEST(FlatshardctlRefusalTest, MissingManifestFile) {
  const std::string path = kData + "does_not_exist.manifest.json";
  ExpectRefused({"plan", "--manifest", path, "--world-size", "2"},
                {"cannot read manifest file '" + path + "'", "No such file or directory"});
}

TEST(FlatshardctlRefusalTest, MissingPolicyFile) {
  const std::string path = kData + "does_not_exist.policy.json";
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--policy", path,
                 "--world-size", "2"},
                {"cannot read policy file '" + path + "'"});
}

TEST(FlatshardctlRefusalTest, MalformedJson) {
  const std::string path = kData + "malformed.manifest.json";
  ExpectRefused({"plan", "--manifest", path, "--world-size", "2"},
                {path + ": manifest: malformed JSON: "});
}

TEST(FlatshardctlRefusalTest, UnknownKeyInManifest) {
  const std::string path = kData + "unknown_key.manifest.json";
  ExpectRefused({"plan", "--manifest", path, "--world-size", "2"},
                {path + ": manifest: $.root.children[0].module.params[0]: unknown key "
                        "\"trainable\""});
}

TEST(FlatshardctlRefusalTest, UnknownKeyInPolicy) {
  const std::string path = kData + "unknown_key.policy.json";
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--policy", path,
                 "--world-size", "2"},
                {path + ": policy: $.auto_wrap: unknown key \"min_num_params\" (allowed: kind)"});
}

TEST(FlatshardctlRefusalTest, DanglingRef) {
  const std::string path = kData + "dangling_ref.manifest.json";
  ExpectRefused({"plan", "--manifest", path, "--world-size", "2"},
                {path + ": manifest: $.root.children[1].module.ref: dangling ref: no module "
                        "with id 9"});
}

TEST(FlatshardctlRefusalTest, BadWorldSize) {
  const std::string manifest = kExamples + "gpt_tied.manifest.json";
  ExpectRefused({"plan", "--manifest", manifest, "--world-size", "0"},
                {"--world-size must be an integer in [1, 1048576], got '0'"});
  ExpectRefused({"plan", "--manifest", manifest, "--world-size", "-4"},
                {"--world-size must be an integer in [1, 1048576], got '-4'"});
  ExpectRefused({"plan", "--manifest", manifest, "--world-size", "two"},
                {"--world-size must be an integer in [1, 1048576], got 'two'"});
  ExpectRefused({"plan", "--manifest", manifest, "--world-size", "2.5"},
                {"--world-size must be an integer in [1, 1048576], got '2.5'"});
  ExpectRefused({"plan", "--manifest", manifest}, {"--world-size N is required"});
  ExpectRefused({"plan", "--manifest", manifest, "--world-size"},
                {"flag --world-size needs a value (N)"});
}

TEST(FlatshardctlRefusalTest, UnknownFlag) {
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--world-size", "2",
                 "--shard-size", "4"},
                {"unknown flag --shard-size"});
  ExpectRefused({"plan", "-m", kExamples + "gpt_tied.manifest.json"}, {"unexpected argument '-m'"});
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--world-size", "2",
                 "--world-size", "3"},
                {"flag --world-size given twice"});
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--world-size", "2",
                 "--json=yes"},
                {"flag --json takes no value"});
}

TEST(FlatshardctlRefusalTest, BadFormat) {
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--world-size", "2",
                 "--format", "yaml"},
                {"--format must be json or table, got 'yaml'"});
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--world-size", "2",
                 "--format", "table", "--json"},
                {"--json conflicts with --format table"});
}

TEST(FlatshardctlRefusalTest, MissingManifestFlag) {
  ExpectRefused({"plan", "--world-size", "2"}, {"--manifest FILE is required"});
}

TEST(FlatshardctlRefusalTest, UnknownPathInIgnoredModules) {
  ExpectRefused({"plan", "--manifest", kExamples + "gpt_tied.manifest.json", "--policy",
                 kData + "unknown_ignored_module.policy.json", "--world-size", "2"},
                {"policy: $.ignored_modules[0]: no module at path \"h.7\""});
}

TEST(FlatshardctlRefusalTest, IntegerParamInAUnit) {
  ExpectRefused(
      {"plan", "--manifest", kData + "int_param.manifest.json", "--policy",
       kData + "always.policy.json", "--world-size", "2"},
      {"module \"table\"", "Cannot flatten integer dtype tensors", "table.index has dtype int64"});
}

TEST(FlatshardctlRefusalTest, ErrorsWithNewlinesStayOnOneLine) {
  // Values echoed in errors may hold newlines; the contract is still one stderr line.
  const std::string manifest = kExamples + "gpt_tied.manifest.json";
  Result r = RunCtl({"plan", "--manifest", manifest, "--world-size", "2", "--format", "ta\nble"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, IsEmpty());
  const size_t format_lines = Lines(r.err).size();
  r = RunCtl({"plan", "--manifest", manifest, "--world-size", "2\n3"});
  EXPECT_EQ(r.exit_code, 2);
  const size_t world_lines = Lines(r.err).size();
  r = RunCtl({"plan", "--manifest", manifest, "--world-size", "2", "--bad\nflag"});
  EXPECT_EQ(r.exit_code, 2);
  const size_t flag_lines = Lines(r.err).size();
  // A missing file whose name holds a newline goes through the plan error path.
  r = RunCtl({"plan", "--manifest", kData + "no\nsuch", "--world-size", "2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(Lines(r.err).size(), 1u) << r.err;
  EXPECT_EQ(format_lines, 1u);
  EXPECT_EQ(world_lines, 1u);
  EXPECT_EQ(flag_lines, 1u);
}

TEST(FlatshardctlHelpTest, TopLevelHelp) {
  for (const char* flag : {"--help", "-h", "help"}) {
    Result r = RunCtl({flag});
    EXPECT_EQ(r.exit_code, 0) << flag;
    EXPECT_THAT(r.err, IsEmpty());
    EXPECT_THAT(r.out, AllOf(StartsWith("Usage: flatshardctl"), HasSubstr("--help"),
                             HasSubstr("--version"), HasSubstr("plan")));
  }
}

TEST(FlatshardctlHelpTest, PlanHelpMentionsEveryFlag) {
  Result r = RunCtl({"plan", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.err, IsEmpty());
  EXPECT_THAT(r.out, StartsWith("Usage: flatshardctl plan "));
  for (const char* flag : {"--manifest FILE", "--policy FILE", "--world-size N",
                           "--ranks-per-node N", "--format json|table", "--json", "--help"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
  EXPECT_THAT(r.out, HasSubstr("Exit status"));
  // --help wins over missing required flags.
  Result with_others = RunCtl({"plan", "--world-size", "3", "--help"});
  EXPECT_EQ(with_others.exit_code, 0);
  EXPECT_EQ(with_others.out, r.out);
}

TEST(FlatshardctlHelpTest, VersionAndBadCommands) {
  Result r = RunCtl({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, StartsWith("flatshardctl "));
  r = RunCtl({});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_THAT(r.err, StartsWith("Usage: flatshardctl"));
  r = RunCtl({"plna"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_EQ(r.err, "flatshardctl: unknown command 'plna' (see flatshardctl --help)\n");
}

}  // namespace
}  // namespace flatshard
