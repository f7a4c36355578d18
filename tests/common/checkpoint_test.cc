// Tests for common/checkpoint: the flatshard.checkpoint/1 directory (writer, reader, every kind
// of corruption refused naming the file and the check), resharding by FQN and element range
// into other world sizes and wrap policies, and the safetensors reader/writer against golden
// bytes built by hand from the published format.

#include "common/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint/param_source.h"
#include "common/checkpoint/safetensors.h"
#include "common/manifest.h"
#include "common/planner.h"
#include "common/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"

namespace flatshard::checkpoint {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

Plan MakePlan(const std::string& model, const std::string& policy_json, int32_t world) {
  absl::StatusOr<Manifest> m = ManifestFromJson(testing::ExampleModelFile(model, "manifest"));
  EXPECT_TRUE(m.ok()) << m.status();
  absl::StatusOr<Policy> p = PolicyFromJson(policy_json);
  EXPECT_TRUE(p.ok()) << p.status();
  PlanOptions o;
  o.world_size = world;
  absl::StatusOr<Plan> plan = BuildPlan(*m, *p, o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}
std::string ExamplePolicy(const std::string& model) {
  return testing::ExampleModelFile(model, "policy");
}
constexpr char kNoWrap[] = R"({"format": "flatshard.policy/1"})";

// Deterministic full values of every parameter of a plan: element e of parameter #i is
// i * 1000 + e (as float32), so a misplaced range shows.
std::map<std::string, std::vector<float>> FullValues(const Plan& plan) {
  std::map<std::string, std::vector<float>> out;
  int i = 0;
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      std::vector<float> v(p.numel);
      for (int64_t e = 0; e < p.numel; ++e) v[e] = static_cast<float>(i * 1000 + e);
      out[p.fqn] = std::move(v);
      ++i;
    }
  }
  return out;
}

// The shard of `rank` of `unit` under `plan` holding `values`.
std::vector<float> ShardOf(const Plan& plan, const PlanUnit& u, int32_t rank,
                           const std::map<std::string, std::vector<float>>& values) {
  absl::StatusOr<FlatLayout> layout = UnitLayout(plan, u);
  EXPECT_TRUE(layout.ok());
  const ElementRange r = layout->ShardRange(plan.ShardRank(rank));
  std::vector<float> out(u.shard_numel, 0.0f);
  for (const PlanParam& p : u.params) {
    const std::vector<float>& v = values.at(p.fqn);
    for (int64_t e = 0; e < p.numel; ++e) {
      const int64_t flat = p.offset + e;
      if (flat >= r.begin && flat < r.end) out[flat - r.begin] = v[e];
    }
  }
  return out;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat("ckpt_test_", ::getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves `values` under `plan` as the checkpoint a group would write, with an extra named
  // tensor per (rank, unit) ("exp_avg", as optimizer state will be) when `extra`.
  void Save(const Plan& plan, const std::map<std::string, std::vector<float>>& values,
            const std::string& dir, bool extra = false, uint64_t generation = 7) {
    ASSERT_TRUE(MakeDirs(dir).ok());
    Metadata meta;
    meta.module = "";
    meta.group = "job";
    meta.world_size = plan.world_size;
    meta.generation = generation;
    meta.created = internal::NowText();
    meta.plan = plan;
    std::vector<std::vector<std::vector<float>>> keep(plan.world_size);
    for (int32_t r = 0; r < plan.world_size; ++r) {
      std::vector<TensorToWrite> tensors;
      for (const PlanUnit& u : plan.units) keep[r].push_back(ShardOf(plan, u, r, values));
      for (const PlanUnit& u : plan.units) {
        const auto& shard = keep[r][u.index];
        tensors.push_back({u.index, kShardTensor, u.dtype, shard.data(),
                           static_cast<int64_t>(shard.size() * sizeof(float))});
        if (extra) {
          tensors.push_back({u.index, "exp_avg", u.dtype, shard.data(),
                             static_cast<int64_t>(shard.size() * sizeof(float))});
        }
      }
      int64_t progressed = 0;
      absl::StatusOr<WrittenFile> w =
          WriteRankFile(dir, r, plan.world_size, tensors, [&](int64_t n) { progressed += n; });
      ASSERT_TRUE(w.ok()) << w.status();
      int64_t payload = 0;
      for (const auto& t : tensors) payload += t.bytes;
      EXPECT_EQ(progressed, payload);
      meta.files.push_back(w->file);
      meta.tensors.insert(meta.tensors.end(), w->tensors.begin(), w->tensors.end());
    }
    ASSERT_TRUE(WriteMetadata(dir, meta).ok());
  }

  // Loads `source` into `plan`'s shards and checks each equals ShardOf(values).
  void ExpectLoads(const ParamSource& source, const Plan& plan,
                   const std::map<std::string, std::vector<float>>& values) {
    absl::StatusOr<std::vector<Binding>> b = Bind(source, plan);
    ASSERT_TRUE(b.ok()) << b.status();
    for (int32_t r = 0; r < plan.world_size; ++r) {
      for (const PlanUnit& u : plan.units) {
        std::vector<float> got(u.shard_numel, -1.0f);
        ASSERT_TRUE(FillShard(source, *b, plan, u.index, plan.ShardRank(r), got.data()).ok());
        EXPECT_EQ(got, ShardOf(plan, u, r, values)) << "rank " << r << " unit " << u.index;
      }
    }
  }

  fs::path dir_;
};

TEST(Crc32cTest, KnownValues) {
  // The CRC-32C check value (RFC 3720 appendix B.4 and the Castagnoli catalogue).
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
  // 32 bytes of zeros (RFC 3720 B.4).
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  // Chunked == whole, at odd split points.
  std::string data(10007, '\0');
  std::mt19937 rng(1);
  for (char& c : data) c = static_cast<char>(rng());
  const uint32_t whole = Crc32c(0, data.data(), data.size());
  EXPECT_EQ(Crc32c(Crc32c(0, data.data(), 13), data.data() + 13, data.size() - 13), whole);
  // The fast path (three interleaved lanes, combined) against the portable table-driven one,
  // at sizes around its lane boundaries.
  std::string big(5 << 20, '\0');
  for (char& c : big) c = static_cast<char>(rng());
  for (size_t n : {size_t{0}, size_t{7}, size_t{12287}, size_t{12288}, size_t{12289},
                   size_t{3 << 20}, size_t{(3 << 20) + 5}, big.size()}) {
    EXPECT_EQ(Crc32c(0, big.data(), n), internal::Crc32cPortable(0, big.data(), n)) << n;
    EXPECT_EQ(Crc32c(0x1234, big.data() + 3, n - (n > 3 ? 3 : n)),
              internal::Crc32cPortable(0x1234, big.data() + 3, n - (n > 3 ? 3 : n)))
        << n;
  }
}

TEST(CheckpointNamesTest, RankFileName) {
  EXPECT_EQ(RankFileName(3, 8), "rank-00003-of-00008.bin");
}

TEST_F(CheckpointTest, RoundTripSameAndOtherWorldSizes) {
  const Plan saved = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 4);
  const auto values = FullValues(saved);
  Save(saved, values, dir_.string(), /*extra=*/true);
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->meta.generation, 7u);
  EXPECT_EQ(c->meta.world_size, 4);
  EXPECT_EQ(c->meta.plan, saved);
  ASSERT_NE(c->meta.FindTensor(2, 1, "exp_avg"), nullptr);
  for (const TensorEntry& t : c->meta.tensors) EXPECT_EQ(t.offset % kTensorAlignment, 0);
  ASSERT_TRUE(VerifyFiles(*c, {}).ok());
  auto source = CheckpointSource(*c);
  // Same plan, fewer and more ranks, another wrap policy, no wrapping at all.
  ExpectLoads(*source, saved, values);
  ExpectLoads(*source, MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 3), values);
  ExpectLoads(*source, MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 8), values);
  ExpectLoads(*source, MakePlan("gpt_tied", kNoWrap, 2), values);
  ExpectLoads(*source,
              MakePlan("gpt_tied", R"({"format": "flatshard.policy/1",
      "auto_wrap": {"kind": "always"}})",
                       5),
              values);
  // The tied alias is a parameter of the source too.
  bool has_alias = false;
  for (const PlanUnit& u : saved.units) {
    for (const SharedParam& s : u.shared) has_alias |= source->params().contains(s.fqn);
  }
  EXPECT_TRUE(has_alias);
}

TEST_F(CheckpointTest, MetadataMissingIsIncomplete) {
  const Plan plan = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 2);
  Save(plan, FullValues(plan), dir_.string());
  fs::remove(dir_ / kMetadataFile);
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("metadata.json: missing (an incomplete checkpoint"));
}

TEST_F(CheckpointTest, MissingShortLongAndCorruptFilesRefused) {
  const Plan plan = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 2);
  Save(plan, FullValues(plan), dir_.string());
  const fs::path f1 = dir_ / RankFileName(1, 2);
  const std::string good = testing::ReadFile(f1);

  fs::remove(f1);
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(absl::StrCat(f1.string(), ": missing")));

  std::ofstream(f1, std::ios::binary) << good.substr(0, good.size() - 1);
  c = OpenCheckpoint(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(f1.string()));
  EXPECT_THAT(c.status().message(), HasSubstr("(truncated)"));

  std::ofstream(f1, std::ios::binary) << good << "x";
  c = OpenCheckpoint(dir_.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("(longer than written)"));

  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;
  std::ofstream(f1, std::ios::binary | std::ios::trunc) << flipped;
  c = OpenCheckpoint(dir_.string());
  ASSERT_TRUE(c.ok()) << c.status();  // sizes agree: only the checksum can tell
  absl::Status v = VerifyFiles(*c, {});
  EXPECT_EQ(v.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(v.message(), HasSubstr(f1.string()));
  EXPECT_THAT(v.message(), HasSubstr("CRC-32C"));
  EXPECT_THAT(v.message(), HasSubstr("(corrupt)"));
  // Only the files asked for are read.
  EXPECT_TRUE(VerifyFiles(*c, {0}).ok());
}

TEST_F(CheckpointTest, BadMetadataRefusedNamingTheField) {
  const Plan plan = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 2);
  Save(plan, FullValues(plan), dir_.string());
  const fs::path meta = dir_ / kMetadataFile;
  const std::string good = testing::ReadFile(meta);
  auto expect_refused = [&](const std::string& text, const std::string& what) {
    std::ofstream(meta, std::ios::binary | std::ios::trunc) << text;
    absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
    ASSERT_FALSE(c.ok()) << what;
    EXPECT_THAT(c.status().message(), HasSubstr(meta.string())) << what;
    EXPECT_THAT(c.status().message(), HasSubstr(what));
  };
  Json doc = Json::parse(good);
  expect_refused(good.substr(0, good.size() / 2), "metadata.json");  // torn JSON
  {
    Json d = doc;
    d["format"] = "flatshard.checkpoint/9";
    expect_refused(d.dump(), "$.format: unsupported format");
  }
  {
    Json d = doc;
    d["files"][1]["crc32c"] = "xyz";
    expect_refused(d.dump(), "$.files[1].crc32c");
  }
  {
    Json d = doc;
    d["tensors"][0]["bytes"] = 8;
    expect_refused(d.dump(), "$.tensors[0]");
  }
  {
    Json d = doc;
    d["plan"]["fingerprint"] = std::string(64, '0');
    expect_refused(d.dump(), "$.plan");
  }
  {
    Json d = doc;
    d["world_size"] = 3;
    expect_refused(d.dump(), "$.world_size");
  }
  {
    Json d = doc;
    d["tensors"][1]["offset"] = d["tensors"][0]["offset"];
    expect_refused(d.dump(), "overlap");
  }
}

TEST_F(CheckpointTest, BindRefusesMissingAndMismatchedParamsNamingTheFqn) {
  const Plan plan = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 2);
  Save(plan, FullValues(plan), dir_.string());
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
  ASSERT_TRUE(c.ok());
  auto source = CheckpointSource(*c);
  // Another model: the convnet's parameters are not in the GPT's checkpoint.
  const Plan other = MakePlan("convnet_bn", ExamplePolicy("convnet_bn"), 2);
  absl::StatusOr<std::vector<Binding>> b = Bind(*source, other);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(b.status().message(), HasSubstr("is not in checkpoint"));
  EXPECT_THAT(b.status().message(),
              HasSubstr(other.units[0].params.empty() ? other.units[1].params[0].fqn
                                                      : other.units[0].params[0].fqn));
  // A shape change of one parameter: named with both shapes.
  Plan changed = plan;
  PlanParam& p = changed.units.back().params.back();
  p.shape.push_back(1);
  b = Bind(*source, changed);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr(absl::StrCat("parameter \"", p.fqn, "\": shape")));
}

TEST(TiedAliasesTest, CrossUnitTiesTheplanDoesNotName) {
  absl::StatusOr<Manifest> m = ManifestFromJson(testing::ExampleModelFile("gpt_tied", "manifest"));
  ASSERT_TRUE(m.ok());
  // Blocks wrapped: wte and lm_head share the root unit, the plan names the alias itself.
  const Plan block = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 2);
  EXPECT_TRUE(TiedAliases(*m, block).empty());
  // Every module wrapped: lm_head's weight lives in wte's unit; only the manifest knows.
  const Plan always = MakePlan(
      "gpt_tied", R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "always"}})", 2);
  const std::vector<SharedParam> tied = TiedAliases(*m, always);
  ASSERT_EQ(tied.size(), 1u);
  EXPECT_EQ(tied[0].fqn, "lm_head.weight");
  EXPECT_EQ(tied[0].same_as, "wte.weight");
}

// ---- safetensors ----

std::string Le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

TEST_F(CheckpointTest, SafetensorsWriterMatchesGoldenBytes) {
  // Built by hand from the format: u64 LE header size, the JSON, spaces to align the byte
  // buffer to 8, then the tensors back to back.
  const float a[2] = {1.0f, -2.0f};
  const int64_t b[1] = {42};
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]}})";
  std::string padded = json;
  while ((8 + padded.size()) % 8 != 0) padded.push_back(' ');
  std::string golden = Le64(padded.size()) + padded;
  golden.append(reinterpret_cast<const char*>(a), 8);
  golden.append(reinterpret_cast<const char*>(b), 8);

  const std::string path = (dir_ / "t.safetensors").string();
  auto w = safetensors::Writer::Create(
      path, {{"a", DType::kFloat32, {2}}, {"b", DType::kInt64, {1, 1}}}, {{"format", "pt"}});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append(a, 4).ok());  // any chunking
  ASSERT_TRUE((*w)->Append(reinterpret_cast<const char*>(a) + 4, 4).ok());
  ASSERT_TRUE((*w)->Append(b, 8).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ(testing::ReadFile(path), golden);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  absl::StatusOr<safetensors::Header> h = safetensors::ReadHeader(path);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  EXPECT_EQ(h->Find("b")->shape, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(h->data_start, static_cast<int64_t>(8 + padded.size()));
}

TEST_F(CheckpointTest, SafetensorsReaderRefusesBrokenFiles) {
  const std::string path = (dir_ / "bad.safetensors").string();
  auto refused = [&](const std::string& bytes, const std::string& what) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    absl::StatusOr<safetensors::Header> h = safetensors::ReadHeader(path);
    ASSERT_FALSE(h.ok()) << what;
    EXPECT_THAT(h.status().message(), HasSubstr(path)) << what;
    EXPECT_THAT(h.status().message(), HasSubstr(what));
  };
  auto file = [](const std::string& json, size_t data_bytes) {
    return Le64(json.size()) + json + std::string(data_bytes, '\0');
  };
  refused("abc", "no header size");
  refused(Le64(1000) + "{}", "runs past the end");
  refused(Le64(uint64_t{200} << 20) + "{}", "over the limit");
  refused(file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "outside");
  refused(file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "need 12");
  refused(file(R"({"a":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype");
  refused(file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "(a hole)");
  refused(file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               8),
          "(overlap)");
  refused(file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8), "trailing");
  refused(file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
               R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               8),
          "duplicate");
  refused(file(R"({"__metadata__":{"k":1}})", 0), "__metadata__.k must be a string");
  // Empty (no tensors) and space-padded headers are fine.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << file("{}      ", 0);
  EXPECT_TRUE(safetensors::ReadHeader(path).ok());
}

TEST_F(CheckpointTest, ExportThenImportSafetensorsIntoOtherPlans) {
  const Plan saved = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 3);
  const auto values = FullValues(saved);
  Save(saved, values, dir_.string());
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
  ASSERT_TRUE(c.ok());
  const std::string st = (dir_ / "model.safetensors").string();
  int64_t progressed = 0;
  ASSERT_TRUE(
      ExportSafetensors(*CheckpointSource(*c), saved, st, {{"format", "pt"}}, [&](int64_t n) {
        progressed += n;
      }).ok());
  absl::StatusOr<safetensors::Header> h = safetensors::ReadHeader(st);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(progressed, testing::ReadFile(st).size() - h->data_start);
  // Every FQN of the state dict, tied aliases included, each whole and equal.
  size_t keys = 0;
  for (const PlanUnit& u : saved.units) keys += u.params.size() + u.shared.size();
  EXPECT_EQ(h->tensors.size(), keys);
  absl::StatusOr<std::unique_ptr<ParamSource>> src = SafetensorsSource(st);
  ASSERT_TRUE(src.ok()) << src.status();
  for (const PlanUnit& u : saved.units) {
    for (const SharedParam& s : u.shared) {
      std::vector<float> alias(values.at(s.same_as).size());
      ASSERT_TRUE((*src)->Read(s.fqn, 0, alias.size(), alias.data()).ok());
      EXPECT_EQ(alias, values.at(s.same_as)) << s.fqn;
    }
  }
  ExpectLoads(**src, MakePlan("gpt_tied", kNoWrap, 1), values);
  ExpectLoads(**src, MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 4), values);
}

// Optimizer state in a checkpoint: the metadata's specs round trip and are checked against
// the tensors; a SHARD state of another dtype than the parameters (float64 over float32
// shards) reshards by FQN and element range into other plans like the parameters.
TEST_F(CheckpointTest, OptimizerStateSpecsAndReshardingOfAnotherDtype) {
  const Plan saved = MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 4);
  const auto values = FullValues(saved);
  const std::vector<StateSpec> specs = {{"exp_avg_sq", DType::kFloat64, StateShape::kShard},
                                        {"step", DType::kFloat64, StateShape::kScalar}};
  auto write = [&](const std::string& dir, bool drop_one) {
    ASSERT_TRUE(MakeDirs(dir).ok());
    Metadata meta;
    meta.group = "job";
    meta.world_size = saved.world_size;
    meta.generation = 3;
    meta.plan = saved;
    meta.state_specs = specs;
    for (int32_t r = 0; r < saved.world_size; ++r) {
      std::vector<std::vector<float>> shards;
      std::vector<std::vector<double>> states;
      std::vector<double> steps;
      for (const PlanUnit& u : saved.units) {
        shards.push_back(ShardOf(saved, u, r, values));
        states.emplace_back(shards.back().begin(), shards.back().end());
        for (double& x : states.back()) x = x * 2 + 0.5;
        steps.push_back(10.0 + u.index);
      }
      std::vector<TensorToWrite> tensors;
      for (const PlanUnit& u : saved.units) {
        tensors.push_back({u.index, kShardTensor, u.dtype, shards[u.index].data(),
                           static_cast<int64_t>(shards[u.index].size() * sizeof(float))});
        tensors.push_back({u.index, "exp_avg_sq", DType::kFloat64, states[u.index].data(),
                           static_cast<int64_t>(states[u.index].size() * sizeof(double))});
        if (!(drop_one && r == 1 && u.index == 0)) {
          tensors.push_back({u.index, "step", DType::kFloat64, &steps[u.index], 8});
        }
      }
      absl::StatusOr<WrittenFile> w = WriteRankFile(dir, r, saved.world_size, tensors);
      ASSERT_TRUE(w.ok()) << w.status();
      meta.files.push_back(w->file);
      meta.tensors.insert(meta.tensors.end(), w->tensors.begin(), w->tensors.end());
    }
    ASSERT_TRUE(WriteMetadata(dir, meta).ok());
  };
  write(dir_.string(), /*drop_one=*/false);
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(dir_.string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->meta.state_specs, specs);
  ASSERT_TRUE(VerifyFiles(*c, {}).ok());
  // A parameters-only metadata document has no "optimizer_state" key.
  Metadata plain = c->meta;
  plain.state_specs.clear();
  EXPECT_FALSE(MetadataToJson(plain).contains("optimizer_state"));

  // The state as a ParamSource (float64): every plan's shards hold 2 * value + 0.5 at the
  // parameters' elements, zero in the padding.
  auto state = CheckpointStateSource(*c, specs[0]);
  std::map<std::string, std::vector<double>> want;
  for (const auto& [fqn, v] : values) {
    for (float x : v) want[fqn].push_back(static_cast<double>(x) * 2 + 0.5);
  }
  for (const Plan& target :
       {saved, MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 3), MakePlan("gpt_tied", kNoWrap, 2),
        MakePlan("gpt_tied", ExamplePolicy("gpt_tied"), 1)}) {
    // float32 is refused (the parameters' dtype), naming the state.
    absl::StatusOr<std::vector<Binding>> wrong = Bind(*state, target);
    ASSERT_FALSE(wrong.ok());
    EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("optimizer state \"exp_avg_sq\""));
    absl::StatusOr<std::vector<Binding>> b = Bind(*state, target, nullptr, {}, DType::kFloat64);
    ASSERT_TRUE(b.ok()) << b.status();
    for (int32_t r = 0; r < target.world_size; ++r) {
      for (const PlanUnit& u : target.units) {
        std::vector<double> got(u.shard_numel, -1.0);
        ASSERT_TRUE(
            FillShard(*state, *b, target, u.index, target.ShardRank(r), got.data(), DType::kFloat64)
                .ok());
        absl::StatusOr<FlatLayout> layout = UnitLayout(target, u);
        ASSERT_TRUE(layout.ok());
        const ElementRange range = layout->ShardRange(target.ShardRank(r));
        std::vector<double> expect(u.shard_numel, 0.0);
        for (const PlanParam& p : u.params) {
          for (int64_t e = 0; e < p.numel; ++e) {
            const int64_t flat = p.offset + e;
            if (flat >= range.begin && flat < range.end) {
              expect[flat - range.begin] = want.at(p.fqn)[e];
            }
          }
        }
        ASSERT_EQ(got, expect) << "world " << target.world_size << " rank " << r << " unit "
                               << u.index;
      }
    }
  }

  // A state tensor missing from one (rank, unit): the metadata is refused naming it.
  const std::string broken = (dir_ / "broken").string();
  write(broken, /*drop_one=*/true);
  absl::StatusOr<Checkpoint> bad = OpenCheckpoint(broken);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("has no optimizer state \"step\" of rank 1 unit 0"));
  // A spec with the parameters' tensor name is refused naming the field.
  Metadata clash = c->meta;
  clash.state_specs[1].name = kShardTensor;
  absl::StatusOr<Metadata> parsed = MetadataFromJson(MetadataToJson(clash).dump(), "m.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("optimizer_state[1].name"));
}

}  // namespace
}  // namespace flatshard::checkpoint
