// flatshard_example_trainer: one rank of a small "training job" that drives flatshardd through
// the C++ client library and checks every result. README command 1 (scripts/run_demo.sh) runs
// it as several processes against one local daemon.
//
//   flatshard_example_trainer --address unix:/tmp/fs/flatshardd.sock --group demo
//       --world_size 3 --rank 0 --token secret --model examples/models/gpt_tied
//
// Steps (all collective: every rank runs them in the same order):
//   join      Join the group (waits for every rank).
//   register  Register the model; initial values f(fqn, i) come from every rank
//             (INIT_MODE_FROM_EVERY_RANK), or, where the daemon does not serve that yet, from a
//             summon with writeback on zero-initialized shards. Each rank keeps only its range.
//   check     Read-only summon: every element equals f(fqn, i), so the all-gather reassembled
//             the ranges every rank wrote back. Tied FQNs alias one view.
//   edit      rank0_only summon with writeback: only rank 0 gets views; it doubles every
//             parameter; at the end every rank writes back its range of rank 0's buffer.
//   check     Every rank sees 2*f(fqn, i).
//   grads     Reduce-scatter (SUM) a gradient for every unit; rank r writes r+1 everywhere.
//   check     with_grads summon: every gradient element equals world*(world+1)/2.
//   leave     Leave the group; the shards stay with the daemon.
// Exit status 0 only when every step and check passed; 1 otherwise; 2 for bad flags.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/plan.h"
#include "common/status_macros.h"
#include "flatshard/client.h"

ABSL_FLAG(std::string, address, "", "the daemon's address: unix:/path/to.sock or host:port");
ABSL_FLAG(std::string, group, "demo", "group (training job) id");
ABSL_FLAG(int32_t, world_size, 1, "ranks in the group");
ABSL_FLAG(int32_t, rank, 0, "this process's rank, 0 <= rank < world_size");
ABSL_FLAG(std::string, token, "", "the group's access token");
ABSL_FLAG(std::string, model, "examples/models/gpt_tied",
          "model path prefix: reads PREFIX.manifest.json and PREFIX.policy.json");
ABSL_FLAG(std::string, init, "auto",
          "how initial values arrive: every_rank (INIT_MODE_FROM_EVERY_RANK), summon (zeros, then "
          "a summon with writeback) or auto (every_rank where the daemon serves it, else summon)");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(30),
          "how long Join waits for every rank of the group");
ABSL_FLAG(absl::Duration, call_timeout, absl::Seconds(30),
          "deadline of every other call (collective calls wait for the slowest rank)");
ABSL_FLAG(bool, verbose, false, "also print the client library's INFO log lines (stderr)");

namespace flatshard::examples {
namespace {

using client::Client;
using client::ParamView;
using client::SummonedParams;
using client::SummonOptions;

constexpr char kModule[] = "";  // the whole model is registered at the root

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The deterministic initial value of element `i` of parameter `fqn`. Small multiples of 1/4,
// so doubling and comparing are exact in float32.
float InitialValue(const std::string& fqn, int64_t i) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char c : fqn) h = (h ^ c) * 16777619u;
  return static_cast<float>(1 + h % 61) + static_cast<float>(i % 64) * 0.25f;
}

// Every parameter of a plan (each distinct tensor once) and the tied FQNs aliasing them.
struct ModelIndex {
  struct Param {
    std::string fqn;
    int64_t numel = 0;
  };
  std::vector<Param> params;
  std::vector<std::pair<std::string, std::string>> aliases;  // (fqn, same_as)
  int64_t elements = 0;
};

absl::StatusOr<ModelIndex> IndexPlan(const Plan& plan) {
  ModelIndex index;
  for (const PlanUnit& unit : plan.units) {
    if (unit.dtype != DType::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit ", unit.index, " has dtype ", DTypeName(unit.dtype),
                       ": this example trainer handles float32 models only"));
    }
    for (const PlanParam& p : unit.params) {
      index.params.push_back({p.fqn, p.numel});
      index.elements += p.numel;
    }
    for (const SharedParam& s : unit.shared) index.aliases.emplace_back(s.fqn, s.same_as);
  }
  return index;
}

absl::StatusOr<float*> Data(const ParamView* view, const std::string& fqn, int64_t numel,
                            absl::string_view what) {
  if (view == nullptr) {
    return absl::InternalError(absl::StrCat("no ", what, " view of ", fqn));
  }
  if (view->numel != numel || view->dtype != DType::kFloat32) {
    return absl::InternalError(absl::StrCat(what, " view of ", fqn, " has ", view->numel,
                                            " elements of ", DTypeName(view->dtype), ", want ",
                                            numel, " float32"));
  }
  return static_cast<float*>(view->data);
}

// Writes f(fqn, i) into every parameter of the views.
absl::Status FillInitialValues(const ModelIndex& index, const SummonedParams& summoned) {
  for (const ModelIndex::Param& p : index.params) {
    const ParamView* view = summoned.Find(p.fqn);
    FS_ASSIGN_OR_RETURN(float* data, Data(view, p.fqn, p.numel, "parameter"));
    if (!view->writable) return absl::InternalError(absl::StrCat(p.fqn, ": view is read-only"));
    for (int64_t i = 0; i < p.numel; ++i) data[i] = InitialValue(p.fqn, i);
  }
  return absl::OkStatus();
}

// Checks that every parameter element equals scale * f(fqn, i) and that tied FQNs alias.
absl::Status CheckParams(const ModelIndex& index, const SummonedParams& summoned, float scale) {
  for (const ModelIndex::Param& p : index.params) {
    FS_ASSIGN_OR_RETURN(const float* data, Data(summoned.Find(p.fqn), p.fqn, p.numel, "parameter"));
    for (int64_t i = 0; i < p.numel; ++i) {
      const float want = scale * InitialValue(p.fqn, i);
      if (data[i] != want) {
        return absl::InternalError(
            absl::StrFormat("%s[%d] is %g, want %g", p.fqn, i, data[i], want));
      }
    }
  }
  for (const auto& [fqn, same_as] : index.aliases) {
    const ParamView* tied = summoned.Find(fqn);
    const ParamView* first = summoned.Find(same_as);
    if (tied == nullptr || first == nullptr || tied->data != first->data) {
      return absl::InternalError(absl::StrCat("tied ", fqn, " does not alias ", same_as));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGrads(const ModelIndex& index, const SummonedParams& summoned, float want) {
  for (const ModelIndex::Param& p : index.params) {
    FS_ASSIGN_OR_RETURN(const float* data,
                        Data(summoned.FindGrad(p.fqn), p.fqn, p.numel, "gradient"));
    for (int64_t i = 0; i < p.numel; ++i) {
      if (data[i] != want) {
        return absl::InternalError(
            absl::StrFormat("gradient %s[%d] is %g, want %g", p.fqn, i, data[i], want));
      }
    }
  }
  for (const auto& [fqn, same_as] : index.aliases) {
    const ParamView* tied = summoned.FindGrad(fqn);
    const ParamView* first = summoned.FindGrad(same_as);
    if (tied == nullptr || first == nullptr || tied->data != first->data) {
      return absl::InternalError(absl::StrCat("tied gradient ", fqn, " does not alias ", same_as));
    }
  }
  return absl::OkStatus();
}

class Trainer {
 public:
  Trainer(std::unique_ptr<Client> client, int32_t world, int32_t rank)
      : client_(std::move(client)), world_(world), rank_(rank) {}

  // Runs every step; the first failure ends the run.
  absl::Status Run(const std::string& group, const std::string& token, const std::string& model,
                   const std::string& init) {
    FS_RETURN_IF_ERROR(Step("join", [&]() -> absl::StatusOr<std::string> {
      FS_RETURN_IF_ERROR(client_->Join(group, world_, rank_, token));
      return absl::StrCat("group ", group, ", ", world_, " ranks");
    }));
    FS_RETURN_IF_ERROR(Step("register", [&] { return Register(model, init); }));
    FS_RETURN_IF_ERROR(Step("check", [&]() -> absl::StatusOr<std::string> {
      FS_RETURN_IF_ERROR(SummonAndCheck(1.0f));
      return absl::StrCat("read-only summon: ", index_.elements, " elements == f(fqn,i)",
                          TiedNote());
    }));
    FS_RETURN_IF_ERROR(Step("edit", [&] { return EditOnRank0(); }));
    FS_RETURN_IF_ERROR(Step("check", [&]() -> absl::StatusOr<std::string> {
      FS_RETURN_IF_ERROR(SummonAndCheck(2.0f));
      return absl::StrCat("every rank sees 2*f(fqn,i) on ", index_.elements, " elements");
    }));
    FS_RETURN_IF_ERROR(Step("grads", [&] { return ReduceScatterGrads(); }));
    FS_RETURN_IF_ERROR(Step("check", [&] { return CheckGradients(); }));
    FS_RETURN_IF_ERROR(Step("leave", [&]() -> absl::StatusOr<std::string> {
      FS_RETURN_IF_ERROR(client_->Leave());
      return absl::StrCat("left; the client mapped ", client_->segment_map_calls(),
                          " segments in all, ", repeat_maps_, " of them in ", repeat_summons_,
                          " repeated summon(s) (steady state: 0)");
    }));
    return absl::OkStatus();
  }

 private:
  // Runs one step, prints one line with its duration, and names the step in its error.
  template <typename F>
  absl::Status Step(absl::string_view name, F&& body) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::string> what = body();
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (!what.ok()) {
      return absl::Status(what.status().code(),
                          absl::StrCat(name, " failed after ", absl::StrFormat("%.1f", ms),
                                       " ms: ", what.status().message()));
    }
    std::printf("rank %d/%d  %-8s %7.1f ms  %s\n", rank_, world_, std::string(name).c_str(), ms,
                what->c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  }

  std::string TiedNote() const {
    if (index_.aliases.empty()) return "";
    return absl::StrCat("; ", index_.aliases[0].first, " aliases ", index_.aliases[0].second);
  }

  // Summons the whole model; counts the segments that summons repeating earlier options map.
  absl::StatusOr<std::unique_ptr<SummonedParams>> Summon(const SummonOptions& options) {
    const int64_t before = client_->segment_map_calls();
    absl::StatusOr<std::unique_ptr<SummonedParams>> summoned =
        client_->Summon(kModule, "", options);
    const std::string kind =
        absl::StrCat(options.writeback, options.rank0_only, options.with_grads, options.recurse);
    if (!summon_kinds_.insert(kind).second) {
      ++repeat_summons_;
      repeat_maps_ += client_->segment_map_calls() - before;
    }
    return summoned;
  }

  absl::StatusOr<std::string> Register(const std::string& model, const std::string& init) {
    FS_ASSIGN_OR_RETURN(const std::string manifest, ReadFile(model + ".manifest.json"));
    FS_ASSIGN_OR_RETURN(const std::string policy, ReadFile(model + ".policy.json"));
    absl::StatusOr<client::RegisteredModule> registered =
        init == "summon"
            ? absl::StatusOr<client::RegisteredModule>(absl::UnimplementedError("--init=summon"))
            : client_->Register(kModule, manifest, policy, client::InitMode::kFromEveryRank);
    // A daemon without FROM_EVERY_RANK refuses it on every rank at once (before any rank's
    // registration counts), so every rank falls back together and the group stays in step.
    if (init == "summon" || (init == "auto" &&
                             (absl::IsInvalidArgument(registered.status()) ||
                              absl::IsUnimplemented(registered.status())) &&
                             absl::StrContains(registered.status().message(), "INIT_MODE_ZEROS"))) {
      registered = client_->Register(kModule, manifest, policy, client::InitMode::kZeros);
    }
    FS_RETURN_IF_ERROR(registered.status());
    FS_ASSIGN_OR_RETURN(index_, IndexPlan(*registered->plan));
    const bool init_summon = registered->init_summon != nullptr;
    if (init_summon) {
      FS_RETURN_IF_ERROR(FillInitialValues(index_, *registered->init_summon));
      FS_RETURN_IF_ERROR(registered->init_summon->End());
    } else {
      // Every rank writes the full values; at End each rank keeps only its own range.
      SummonOptions options;
      options.writeback = true;
      FS_ASSIGN_OR_RETURN(std::unique_ptr<SummonedParams> full, Summon(options));
      FS_RETURN_IF_ERROR(FillInitialValues(index_, *full));
      FS_RETURN_IF_ERROR(full->End());
    }
    units_ = static_cast<int32_t>(registered->plan->units.size());
    return absl::StrCat(
        model, ": ", units_, " units, ", index_.params.size(), " params (", index_.aliases.size(),
        " tied), ", index_.elements, " elements; every rank wrote f(fqn,i) into ",
        init_summon ? "the FROM_EVERY_RANK init summon" : "a writeback summon over zero shards");
  }

  absl::Status SummonAndCheck(float scale) {
    SummonOptions options;
    options.writeback = false;
    FS_ASSIGN_OR_RETURN(std::unique_ptr<SummonedParams> full, Summon(options));
    FS_RETURN_IF_ERROR(CheckParams(index_, *full, scale));
    return full->End();
  }

  absl::StatusOr<std::string> EditOnRank0() {
    SummonOptions options;
    options.writeback = true;
    options.rank0_only = true;
    FS_ASSIGN_OR_RETURN(std::unique_ptr<SummonedParams> full, Summon(options));
    if (full->has_views() != (rank_ == 0)) {
      return absl::InternalError(absl::StrCat("rank0_only summon: rank ", rank_,
                                              (rank_ == 0 ? " got no views" : " got views")));
    }
    if (static_cast<int32_t>(full->units().size()) != units_) {
      return absl::InternalError(
          absl::StrCat("rank0_only summon names ", full->units().size(), " units, want ", units_));
    }
    if (rank_ == 0) {
      FS_RETURN_IF_ERROR(CheckParams(index_, *full, 1.0f));
      for (const ModelIndex::Param& p : index_.params) {  // tied aliases are not visited twice
        float* data = static_cast<float*>(full->Find(p.fqn)->data);
        for (int64_t i = 0; i < p.numel; ++i) data[i] *= 2.0f;
      }
    }
    FS_RETURN_IF_ERROR(full->End());
    return std::string(rank_ == 0 ? "rank0_only summon with writeback: doubled every parameter"
                                  : "rank0_only summon with writeback: no views here, as expected");
  }

  absl::StatusOr<std::string> ReduceScatterGrads() {
    const float mine = static_cast<float>(rank_ + 1);
    for (int32_t unit = 0; unit < units_; ++unit) {
      FS_RETURN_IF_ERROR(
          client_->ReduceScatterGrads(kModule, unit, client::ReduceOp::kSum, /*accumulate=*/false,
                                      [&](client::PendingReduceScatter& pending) -> absl::Status {
                                        float* data = static_cast<float*>(pending.data());
                                        for (int64_t i = 0; i < pending.numel(); ++i)
                                          data[i] = mine;
                                        return absl::OkStatus();
                                      }));
    }
    return absl::StrFormat("SUM over %d units; this rank wrote %g everywhere", units_, mine);
  }

  absl::StatusOr<std::string> CheckGradients() {
    SummonOptions options;
    options.writeback = false;
    options.with_grads = true;
    FS_ASSIGN_OR_RETURN(std::unique_ptr<SummonedParams> full, Summon(options));
    const float want = static_cast<float>(world_ * (world_ + 1) / 2);
    FS_RETURN_IF_ERROR(CheckGrads(index_, *full, want));
    FS_RETURN_IF_ERROR(CheckParams(index_, *full, 2.0f));
    FS_RETURN_IF_ERROR(full->End());
    return absl::StrFormat("with_grads summon: %d gradient elements == %g (1+...+%d)",
                           index_.elements, want, world_);
  }

  std::unique_ptr<Client> client_;
  const int32_t world_;
  const int32_t rank_;
  ModelIndex index_;
  int32_t units_ = 0;
  std::set<std::string> summon_kinds_;  // option sets summoned so far
  int repeat_summons_ = 0;              // summons with options summoned before
  int64_t repeat_maps_ = 0;             // segments those mapped (steady state: none)
};

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "flatshard_example_trainer: one rank of an example job that registers a model with "
      "flatshardd, summons, edits, writes back and reduce-scatters gradients, and checks every "
      "result.\nUsage: flatshard_example_trainer --address unix:/path.sock --world_size N "
      "--rank R [--group G] [--token T] [--model examples/models/gpt_tied]");
  absl::ParseCommandLine(argc, argv);
  const std::string address = absl::GetFlag(FLAGS_address);
  const int32_t world = absl::GetFlag(FLAGS_world_size);
  const int32_t rank = absl::GetFlag(FLAGS_rank);
  const std::string init = absl::GetFlag(FLAGS_init);
  if (address.empty() || world < 1 || rank < 0 || rank >= world ||
      (init != "auto" && init != "every_rank" && init != "summon")) {
    std::fprintf(stderr,
                 "flatshard_example_trainer: need --address, --world_size >= 1, "
                 "0 <= --rank < world_size and --init auto|every_rank|summon (see --help)\n");
    return 2;
  }
  if (!absl::GetFlag(FLAGS_verbose)) SetMinLogSeverity(LogSeverity::kWarning);

  client::ClientOptions options;
  options.address = address;
  options.call_timeout = absl::GetFlag(FLAGS_call_timeout);
  options.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) {
    std::printf("rank %d/%d  FAIL     connect: %s\n", rank, world,
                client.status().ToString().c_str());
    return 1;
  }
  const absl::Time start = absl::Now();
  Trainer trainer(*std::move(client), world, rank);
  const absl::Status status = trainer.Run(absl::GetFlag(FLAGS_group), absl::GetFlag(FLAGS_token),
                                          absl::GetFlag(FLAGS_model), init);
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (!status.ok()) {
    std::printf("rank %d/%d  FAIL     %7.1f ms  %s\n", rank, world, ms, status.ToString().c_str());
    return 1;
  }
  std::printf("rank %d/%d  PASS     %7.1f ms  all checks passed\n", rank, world, ms);
  return 0;
}

}  // namespace
}  // namespace flatshard::examples

int main(int argc, char** argv) { return flatshard::examples::Main(argc, argv); }
