// Planner throughput on a synthetic transformer-like manifest (not a timed test).
//
//   build/tests/bench/flatshard_planner_benchmark [--benchmark_filter=REGEX]
//
// The model, generated in memory: root -> wte, wpe (Embedding), h (ModuleList of B Blocks),
// ln_f, lm_head (Linear whose weight is tied to wte.weight). Each Block has 13 modules
// (ln_1, attn{c_attn, c_proj, attn_dropout, resid_dropout, rotary}, ln_2, mlp{c_fc, gelu,
// c_proj, dropout}), where `rotary` is one shared instance registered in every block (a ref).
// The argument is B: 800 blocks give 10,407 module instances, 8000 give 104,007. Each
// benchmark reports `modules` (instances) and `params` (parameter registrations) as counters.
//
// Benchmarks: ManifestFromJson (and on a flat model: root -> N Linear), ValidateManifest (the
// daemon's check of a manifest that came as protobuf), PolicyFromJson,
// BuildPlan under size_based / module_types / always, PlanToJson + dump, PlanToJsonText (the
// same bytes, written directly), PlanFromJson, and the whole pipeline (text in -> plan text
// out, with PlanToJsonText). The _Dom rows are the same run's baselines: the strict DOM readers
// the one-pass readers replaced (and that still word every error).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/json_util.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/plan_json_writer.h"
#include "common/planner.h"
#include "common/policy.h"

namespace flatshard {
namespace {

constexpr int64_t kHidden = 64;
constexpr int64_t kVocab = 512;
constexpr int64_t kContext = 128;
constexpr int32_t kWorldSize = 8;

class ManifestBuilder {
 public:
  std::string Build(int blocks) {
    Json wte = Module("Embedding", {"Module"}, {Param("weight", {kVocab, kHidden})});
    const int64_t wte_weight = next_param_ - 1;
    Json wpe = Module("Embedding", {"Module"}, {Param("weight", {kContext, kHidden})});
    Json h = Module("ModuleList", {"Module"});
    for (int b = 0; b < blocks; ++b) AddChild(h, std::to_string(b), Block());
    Json lm_head = Module("Linear", {"Module"});
    // Tied: the same tensor id as wte.weight, with its shape.
    lm_head["params"].push_back(Json{{"name", "weight"},
                                     {"id", wte_weight},
                                     {"shape", {kVocab, kHidden}},
                                     {"dtype", "float32"},
                                     {"requires_grad", true}});
    Json root = Module("GPT", {"Module"});
    AddChild(root, "wte", std::move(wte));
    AddChild(root, "wpe", std::move(wpe));
    AddChild(root, "h", std::move(h));
    AddChild(root, "ln_f", LayerNorm());
    AddChild(root, "lm_head", std::move(lm_head));
    Json doc = {{"format", std::string(kManifestFormat)}, {"root", std::move(root)}};
    return doc.dump();
  }

 private:
  Json Module(absl::string_view type, std::vector<std::string> bases,
              std::vector<Json> params = {}) {
    return Json{{"id", next_module_++},
                {"type", std::string(type)},
                {"bases", std::move(bases)},
                {"params", std::move(params)},
                {"children", Json::array()}};
  }

  Json Param(absl::string_view name, std::vector<int64_t> shape) {
    return Json{{"name", std::string(name)},
                {"id", next_param_++},
                {"shape", std::move(shape)},
                {"dtype", "float32"},
                {"requires_grad", true}};
  }

  static void AddChild(Json& parent, absl::string_view name, Json child) {
    parent["children"].push_back(Json{{"name", std::string(name)}, {"module", std::move(child)}});
  }

  Json Linear(int64_t in, int64_t out) {
    return Module("Linear", {"Module"}, {Param("weight", {out, in}), Param("bias", {out})});
  }
  Json LayerNorm() {
    return Module("LayerNorm", {"Module"}, {Param("weight", {kHidden}), Param("bias", {kHidden})});
  }
  Json Dropout() { return Module("Dropout", {"_DropoutNd", "Module"}); }
  Json Rotary() {
    if (rotary_id_ >= 0) return Json{{"ref", rotary_id_}};
    rotary_id_ = next_module_;
    return Module("RotaryEmbedding", {"Module"}, {Param("inv_freq", {kHidden / 2})});
  }

 public:
  // A flat model: the root holds `n` Linear children directly (one long JSON array).
  std::string BuildFlat(int n) {
    Json root = Module("FlatNet", {"Module"});
    for (int i = 0; i < n; ++i) AddChild(root, std::to_string(i), Linear(kHidden, kHidden));
    return Json{{"format", std::string(kManifestFormat)}, {"root", std::move(root)}}.dump();
  }

 private:
  Json Block() {
    Json block = Module("Block", {"Module"});
    AddChild(block, "ln_1", LayerNorm());
    Json attn = Module("CausalSelfAttention", {"Module"});
    AddChild(attn, "c_attn", Linear(kHidden, 3 * kHidden));
    AddChild(attn, "c_proj", Linear(kHidden, kHidden));
    AddChild(attn, "attn_dropout", Dropout());
    AddChild(attn, "resid_dropout", Dropout());
    AddChild(attn, "rotary", Rotary());
    AddChild(block, "attn", std::move(attn));
    AddChild(block, "ln_2", LayerNorm());
    Json mlp = Module("MLP", {"Module"});
    AddChild(mlp, "c_fc", Linear(kHidden, 4 * kHidden));
    AddChild(mlp, "gelu", Module("GELU", {"Module"}));
    AddChild(mlp, "c_proj", Linear(4 * kHidden, kHidden));
    AddChild(mlp, "dropout", Dropout());
    AddChild(block, "mlp", std::move(mlp));
    return block;
  }

  int64_t next_module_ = 0;
  int64_t next_param_ = 0;
  int64_t rotary_id_ = -1;
};

// One block holds ~50k parameters, so 40k wraps each block and none of its leaves.
const char* const kSizeBasedPolicy =
    R"({"format": "flatshard.policy/1",
        "auto_wrap": {"kind": "size_based", "min_num_params": 40000},
        "mixed_precision": {"param_dtype": "bfloat16"}})";
const char* const kModuleTypesPolicy =
    R"({"format": "flatshard.policy/1",
        "auto_wrap": {"kind": "module_types", "types": ["Block"]}})";
const char* const kAlwaysPolicy =
    R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "always"},
        "use_orig_params": true})";

struct Model {
  std::string text;
  Manifest manifest;
  size_t params = 0;
};

// Generated once per size, outside the timed loops.
const Model& GetModel(int blocks) {
  static auto* models = new std::map<int, std::unique_ptr<Model>>;
  auto& slot = (*models)[blocks];
  if (!slot) {
    slot = std::make_unique<Model>();
    slot->text = ManifestBuilder().Build(blocks);
    absl::StatusOr<Manifest> m = ManifestFromJson(slot->text);
    if (!m.ok()) {
      std::fprintf(stderr, "synthetic manifest refused: %s\n", m.status().ToString().c_str());
      std::abort();
    }
    slot->manifest = *std::move(m);
    for (const ModuleDecl& mod : slot->manifest.modules) slot->params += mod.params.size();
  }
  return *slot;
}

void SetCounters(benchmark::State& state, const Model& model) {
  state.counters["modules"] = static_cast<double>(model.manifest.modules.size());
  state.counters["params"] = static_cast<double>(model.params);
  state.SetLabel(absl::StrCat(model.manifest.modules.size(), " modules"));
}

PlanOptions Options() {
  PlanOptions options;
  options.world_size = kWorldSize;
  return options;
}

void BM_ManifestFromJson(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::StatusOr<Manifest> m = ManifestFromJson(model.text);
    benchmark::DoNotOptimize(m);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * model.text.size()));
  SetCounters(state, model);
}

// The strict DOM reader ManifestFromJson used before its one-pass reader (ParseJson +
// ManifestFromJsonValue), and still uses for an invalid manifest's message: the baseline of
// the same run.
absl::StatusOr<Manifest> ManifestFromJsonViaDom(absl::string_view text) {
  absl::StatusOr<Json> doc = ParseJson(text, "manifest");
  if (!doc.ok()) return doc.status();
  return ManifestFromJsonValue(*doc);
}

void BM_ManifestFromJson_Dom(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::StatusOr<Manifest> m = ManifestFromJsonViaDom(model.text);
    benchmark::DoNotOptimize(m);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * model.text.size()));
  SetCounters(state, model);
}

// The daemon's check of a manifest that came as protobuf (FromProto): the JSON rules applied to
// the module tree, by writing it as JSON and reading it back.
void BM_ValidateManifest(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::Status s = ValidateManifest(model.manifest);
    benchmark::DoNotOptimize(s);
  }
  SetCounters(state, model);
}

// The baseline: the DOM round trip ValidateManifest ran in full before (and still runs for an
// invalid manifest's message).
void BM_ValidateManifest_Dom(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::StatusOr<Manifest> m = ManifestFromJsonValue(ManifestToJson(model.manifest));
    benchmark::DoNotOptimize(m);
  }
  SetCounters(state, model);
}

// The same parse on one wide array of modules (10,000 and 40,000 children of the root):
// linear JSON reading takes 4x as long for 4x the children.
void BM_ManifestFromJson_Flat(benchmark::State& state) {
  static auto* texts = new std::map<int64_t, std::string>;
  std::string& text = (*texts)[state.range(0)];
  if (text.empty()) text = ManifestBuilder().BuildFlat(static_cast<int>(state.range(0)));
  size_t modules = 0;
  for (auto _ : state) {
    absl::StatusOr<Manifest> m = ManifestFromJson(text);
    if (!m.ok()) {
      state.SkipWithError(m.status().ToString().c_str());
      break;
    }
    modules = m->modules.size();
    benchmark::DoNotOptimize(m);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["modules"] = static_cast<double>(modules);
}

void BM_PolicyFromJson(benchmark::State& state) {
  for (auto _ : state) {
    absl::StatusOr<Policy> p = PolicyFromJson(kSizeBasedPolicy);
    benchmark::DoNotOptimize(p);
  }
}

void BuildPlanWith(benchmark::State& state, const char* policy_text) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  const Policy policy = *PolicyFromJson(policy_text);
  size_t units = 0;
  for (auto _ : state) {
    absl::StatusOr<Plan> plan = BuildPlan(model.manifest, policy, Options());
    if (!plan.ok()) {
      state.SkipWithError(plan.status().ToString().c_str());
      break;
    }
    units = plan->units.size();
    benchmark::DoNotOptimize(plan);
  }
  SetCounters(state, model);
  state.counters["units"] = static_cast<double>(units);
}

void BM_BuildPlan_SizeBased(benchmark::State& state) { BuildPlanWith(state, kSizeBasedPolicy); }
void BM_BuildPlan_ModuleTypes(benchmark::State& state) { BuildPlanWith(state, kModuleTypesPolicy); }
void BM_BuildPlan_Always(benchmark::State& state) { BuildPlanWith(state, kAlwaysPolicy); }

void BM_PlanToJson(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  const Plan plan = *BuildPlan(model.manifest, *PolicyFromJson(kAlwaysPolicy), Options());
  for (auto _ : state) {
    std::string text = PlanToJson(plan).dump();
    benchmark::DoNotOptimize(text);
  }
  SetCounters(state, model);
}

// The direct writer (what the pipeline below, the daemon's records and the Python package use).
void BM_PlanToJsonText(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  const Plan plan = *BuildPlan(model.manifest, *PolicyFromJson(kAlwaysPolicy), Options());
  for (auto _ : state) {
    std::string text = PlanToJsonText(plan);
    benchmark::DoNotOptimize(text);
  }
  SetCounters(state, model);
}

void BM_PlanFromJson(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  const Plan plan = *BuildPlan(model.manifest, *PolicyFromJson(kAlwaysPolicy), Options());
  const std::string text = PlanToJson(plan).dump();
  for (auto _ : state) {
    absl::StatusOr<Plan> p = PlanFromJson(text);
    benchmark::DoNotOptimize(p);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  SetCounters(state, model);
}

// The DOM path PlanFromJson used before its one-pass reader (and still uses for an invalid
// plan's message): the baseline of the same run.
void BM_PlanFromJson_Dom(benchmark::State& state) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  const Plan plan = *BuildPlan(model.manifest, *PolicyFromJson(kAlwaysPolicy), Options());
  const std::string text = PlanToJson(plan).dump();
  for (auto _ : state) {
    absl::StatusOr<Json> doc = ParseJson(text, "plan");
    absl::StatusOr<Plan> p = PlanFromJsonValue(*doc);
    benchmark::DoNotOptimize(p);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  SetCounters(state, model);
}

// flatshardctl plan's work: manifest and policy text in, plan text out.
void EndToEnd(benchmark::State& state, const char* policy_text, bool dom = false) {
  const Model& model = GetModel(static_cast<int>(state.range(0)));
  size_t out_bytes = 0;
  for (auto _ : state) {
    absl::StatusOr<Manifest> manifest =
        dom ? ManifestFromJsonViaDom(model.text) : ManifestFromJson(model.text);
    absl::StatusOr<Policy> policy = PolicyFromJson(policy_text);
    if (!manifest.ok() || !policy.ok()) {
      state.SkipWithError("input refused");
      break;
    }
    absl::StatusOr<Plan> plan = BuildPlan(*manifest, *policy, Options());
    if (!plan.ok()) {
      state.SkipWithError(plan.status().ToString().c_str());
      break;
    }
    std::string text = PlanToJsonText(*plan);
    out_bytes = text.size();
    benchmark::DoNotOptimize(text);
  }
  SetCounters(state, model);
  state.counters["plan_bytes"] = static_cast<double>(out_bytes);
}

void BM_EndToEnd_ModuleTypes(benchmark::State& state) { EndToEnd(state, kModuleTypesPolicy); }
void BM_EndToEnd_Always(benchmark::State& state) { EndToEnd(state, kAlwaysPolicy); }
// The baseline: the same pipeline reading the manifest with the DOM reader.
void BM_EndToEnd_Always_Dom(benchmark::State& state) { EndToEnd(state, kAlwaysPolicy, true); }

// 800 blocks: 10,407 modules; 8000 blocks: 104,007 modules.
#define FS_MODEL_SIZES(b) \
  b->ArgName("blocks")->Arg(800)->Arg(8000)->Unit(benchmark::kMillisecond)->UseRealTime()

FS_MODEL_SIZES(BENCHMARK(BM_ManifestFromJson));
FS_MODEL_SIZES(BENCHMARK(BM_ManifestFromJson_Dom));
FS_MODEL_SIZES(BENCHMARK(BM_ValidateManifest));
FS_MODEL_SIZES(BENCHMARK(BM_ValidateManifest_Dom));
BENCHMARK(BM_ManifestFromJson_Flat)
    ->ArgName("children")
    ->Arg(10000)
    ->Arg(40000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_PolicyFromJson)->Unit(benchmark::kMicrosecond);
FS_MODEL_SIZES(BENCHMARK(BM_BuildPlan_SizeBased));
FS_MODEL_SIZES(BENCHMARK(BM_BuildPlan_ModuleTypes));
FS_MODEL_SIZES(BENCHMARK(BM_BuildPlan_Always));
FS_MODEL_SIZES(BENCHMARK(BM_PlanToJson));
FS_MODEL_SIZES(BENCHMARK(BM_PlanToJsonText));
FS_MODEL_SIZES(BENCHMARK(BM_PlanFromJson));
FS_MODEL_SIZES(BENCHMARK(BM_PlanFromJson_Dom));
FS_MODEL_SIZES(BENCHMARK(BM_EndToEnd_ModuleTypes));
FS_MODEL_SIZES(BENCHMARK(BM_EndToEnd_Always));
FS_MODEL_SIZES(BENCHMARK(BM_EndToEnd_Always_Dom));

}  // namespace
}  // namespace flatshard

BENCHMARK_MAIN();
