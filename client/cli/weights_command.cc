// `flatshardctl weights list|inspect|drop`: published weights on a daemon (README
// "Publishing weights"), over WeightsService.

#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"
#include "flatshard/v1/weights_service.grpc.pb.h"

namespace flatshard::cli {
namespace {

constexpr char kUsage[] =
    "Usage: flatshardctl weights list [NAME] | inspect NAME [--version V] [--owner UID] |\n"
    "                            drop NAME [--version V] [--owner UID]   [common flags]\n"
    "\n"
    "Published weights: versions of a training group's committed step, read by inference\n"
    "engines (README \"Publishing weights\").\n"
    "  list     the versions this caller may read (all of them for root or the daemon's uid)\n"
    "  inspect  one version (the latest without --version): its tensors, dtypes, shapes\n"
    "  drop     remove a version (every version of NAME without --version); its memory goes\n"
    "           once no reader holds it. The owner, root or the daemon's uid only.\n"
    "Run 'flatshardctl weights SUBCOMMAND --help' for the flags.\n";

// "host" (shared memory) or "gpu:N" (device memory of the daemon's GPU N).
std::string Placement(const v1::PublishedVersion& v) {
  return v.has_device() ? absl::StrCat("gpu:", v.device()) : "host";
}

nlohmann::json VersionJson(const v1::PublishedVersion& v) {
  return {{"name", v.name()},       {"owner_uid", v.owner_uid()},
          {"version", v.version()}, {"generation", v.generation()},
          {"bytes", v.bytes()},     {"tensors", v.tensors()},
          {"readers", v.readers()}, {"group", v.group()},
          {"module", v.module()},   {"placement", Placement(v)}};
}

std::vector<std::string> Row(const v1::PublishedVersion& v) {
  return {v.name(),
          std::to_string(v.owner_uid()),
          std::to_string(v.version()),
          std::to_string(v.generation()),
          HumanBytes(v.bytes()),
          std::to_string(v.tensors()),
          std::to_string(v.readers()),
          absl::StrCat(v.group(), "/", ModuleName(v.module())),
          Placement(v)};
}

const std::vector<std::string> kHeader = {"NAME",    "OWNER",   "VERSION", "GENERATION", "BYTES",
                                          "TENSORS", "READERS", "FROM",    "PLACEMENT"};

const char* DTypeText(v1::DType d) {
  static const char* kNames[] = {"?",    "float32", "float16", "bfloat16", "float64",
                                 "int8", "int32",   "int64",   "uint8",    "bool"};
  const int i = static_cast<int>(d);
  return i >= 0 && i < 10 ? kNames[i] : "?";
}

// --version and --owner into `selector`; an error message (exit 2) or "".
std::string Selector(const AdminCall& call, v1::WeightsSelector* selector) {
  selector->set_name(call.args()[0]);
  selector->set_owner_uid(-2);
  if (call.flags().Has("version")) {
    absl::StatusOr<int64_t> v = call.flags().GetInt("version", 1, INT64_MAX);
    if (!v.ok()) return std::string(v.status().message());
    selector->set_version(static_cast<uint64_t>(*v));
  }
  if (call.flags().Has("owner")) {
    absl::StatusOr<int64_t> v = call.flags().GetInt("owner", -1, INT32_MAX);
    if (!v.ok()) return std::string(v.status().message());
    selector->set_owner_uid(*v);
  }
  return "";
}

const std::vector<FlagSpec> kSelectFlags = {
    {"version", "V", "a version number (default: the latest; drop: every version)"},
    {"owner", "UID", "the publisher's uid (default: the caller's own)"}};

int List(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "weights list";
  spec.synopsis = "[NAME]";
  spec.description =
      "The published versions this caller may read (every version for root or the daemon's\n"
      "uid), of NAME or of every name: owner uid, version, committed generation, bytes,\n"
      "tensors, open readers, the group/module it came from and its placement (host shared\n"
      "memory, or gpu:N: device memory of the daemon's GPU N).\n";
  spec.max_args = 1;
  spec.args_name = "NAME";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    auto stub = v1::WeightsService::NewStub(call.channel());
    grpc::ClientContext ctx;
    call.SetDeadline(ctx);
    v1::ListWeightsRequest request;
    if (!call.args().empty()) request.set_name(call.args()[0]);
    v1::ListWeightsResponse response;
    if (grpc::Status s = stub->ListWeights(&ctx, request, &response); !s.ok()) {
      return call.Fail(s);
    }
    if (call.json()) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& v : response.versions()) out.push_back(VersionJson(v));
      std::cout << out.dump(2) << "\n";
      return 0;
    }
    if (response.versions().empty()) {
      std::cout << "no published weights\n";
      return 0;
    }
    std::vector<std::vector<std::string>> rows = {kHeader};
    for (const auto& v : response.versions()) rows.push_back(Row(v));
    std::cout << FormatTable(rows);
    return 0;
  });
}

int Inspect(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "weights inspect";
  spec.synopsis = "NAME [--version V] [--owner UID]";
  spec.description =
      "One published version (the latest without --version): its summary, segment, and every\n"
      "tensor (state_dict key, dtype, shape, offset, bytes; tied keys share an offset).\n";
  spec.flags = kSelectFlags;
  spec.min_args = 1;
  spec.max_args = 1;
  spec.args_name = "NAME";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    v1::InspectWeightsRequest request;
    if (std::string e = Selector(call, request.mutable_selector()); !e.empty()) {
      return call.Error(e, 2);
    }
    auto stub = v1::WeightsService::NewStub(call.channel());
    grpc::ClientContext ctx;
    call.SetDeadline(ctx);
    v1::InspectWeightsResponse response;
    if (grpc::Status s = stub->InspectWeights(&ctx, request, &response); !s.ok()) {
      return call.Fail(s);
    }
    const v1::OpenWeightsResponse& w = response.weights();
    if (call.json()) {
      nlohmann::json tensors = nlohmann::json::array();
      for (const auto& t : w.tensors()) {
        tensors.push_back({{"name", t.name()},
                           {"dtype", DTypeText(t.dtype())},
                           {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())},
                           {"offset", t.offset()},
                           {"bytes", t.bytes()}});
      }
      nlohmann::json out = VersionJson(w.version());
      out["segment"] = w.segment();
      if (w.version().has_device()) {
        out["device_uuid"] = w.device_uuid();
        out["offset"] = w.offset();
      }
      out["tensor_list"] = tensors;
      std::cout << out.dump(2) << "\n";
      return 0;
    }
    std::cout << FormatTable({kHeader, Row(w.version())}) << "segment " << w.segment() << " ("
              << HumanBytes(static_cast<int64_t>(w.segment_bytes())) << ")";
    if (w.version().has_device()) {
      std::cout << " on GPU " << w.version().device() << " " << w.device_uuid() << " at offset "
                << w.offset();
    }
    std::cout << "\n";
    std::vector<std::vector<std::string>> rows = {{"TENSOR", "DTYPE", "SHAPE", "OFFSET", "BYTES"}};
    for (const auto& t : w.tensors()) {
      rows.push_back({t.name(), DTypeText(t.dtype()),
                      absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"),
                      std::to_string(t.offset()), std::to_string(t.bytes())});
    }
    std::cout << FormatTable(rows);
    return 0;
  });
}

int Drop(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "weights drop";
  spec.synopsis = "NAME [--version V] [--owner UID]";
  spec.description =
      "Removes a published version of NAME (every version without --version) from the daemon:\n"
      "readers can no longer open it; its memory is freed once no reader holds it. The owner\n"
      "uid, root or the daemon's uid only.\n";
  spec.flags = kSelectFlags;
  spec.min_args = 1;
  spec.max_args = 1;
  spec.args_name = "NAME";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    v1::DropWeightsRequest request;
    if (std::string e = Selector(call, request.mutable_selector()); !e.empty()) {
      return call.Error(e, 2);
    }
    auto stub = v1::WeightsService::NewStub(call.channel());
    grpc::ClientContext ctx;
    call.SetDeadline(ctx);
    v1::DropWeightsResponse response;
    if (grpc::Status s = stub->DropWeights(&ctx, request, &response); !s.ok()) {
      return call.Fail(s);
    }
    if (call.json()) {
      std::cout << nlohmann::json{{"name", call.args()[0]}, {"dropped", response.dropped()}}.dump(2)
                << "\n";
    } else {
      std::cout << "dropped " << response.dropped() << " version(s) of " << call.args()[0] << "\n";
    }
    return 0;
  });
}

}  // namespace

int RunWeightsCommand(const std::vector<std::string>& args) {
  if (args.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return 0;
  }
  if (args[0] == "list") return List(rest);
  if (args[0] == "inspect") return Inspect(rest);
  if (args[0] == "drop") return Drop(rest);
  std::cerr << "flatshardctl weights: unknown subcommand '" << args[0]
            << "' (list, inspect or drop)\n";
  return 2;
}

}  // namespace flatshard::cli
