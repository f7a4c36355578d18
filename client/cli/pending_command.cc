#include "client/cli/pending_command.h"

#include <chrono>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/flags.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

namespace flatshard::cli {
namespace {

const std::vector<FlagSpec>& PendingFlags() {
  static const auto* specs = new std::vector<FlagSpec>{
      {"socket", "PATH", "the daemon's Unix socket (default /run/flatshard/flatshardd.sock)"},
      {"address", "HOST:PORT", "the daemon's TCP address instead of its socket"},
      {"timeout-ms", "N", "how long to wait for the daemon's answer (default 5000)"},
      {"json", "", "print JSON instead of a table"},
      {"help", "", "show this help"},
  };
  return *specs;
}

std::string Usage() {
  return absl::StrCat(
      "Usage: flatshardctl pending [GROUP] [--socket PATH | --address HOST:PORT] [--json]\n\n"
      "Lists each group's collectives that have not completed on this daemon: op sequence,\n"
      "kind, unit, bytes, the ranks that arrived and those still missing, and the age. A group\n"
      "whose collectives failed shows its sticky error.\n\n"
      "Flags:\n",
      FlagsHelp(PendingFlags()),
      "\nExit status: 0 on success; 1 when the daemon cannot be reached or refuses; 2 for bad "
      "flags.\n");
}

std::string Ranks(const google::protobuf::RepeatedField<int32_t>& ranks) {
  return ranks.empty() ? "-" : absl::StrJoin(ranks, ",");
}

void PrintTable(const v1::ListPendingCollectivesResponse& response) {
  if (response.groups().empty()) {
    std::cout << "no groups\n";
    return;
  }
  for (const v1::GroupCollectives& g : response.groups()) {
    std::cout << absl::StrFormat("group %s  world_size %d  epoch %d  local ranks %s  status %s\n",
                                 g.group(), g.world_size(), g.epoch(), Ranks(g.local_ranks()),
                                 g.status());
    if (g.pending().empty()) {
      std::cout << "  no pending collectives\n";
      continue;
    }
    std::cout << absl::StrFormat("  %8s  %-13s  %6s  %12s  %-10s  %-12s  %-12s  %8s\n", "OP_SEQ",
                                 "KIND", "UNIT", "BYTES", "NAME", "ARRIVED", "MISSING", "AGE");
    for (const v1::PendingCollective& p : g.pending()) {
      std::cout << absl::StrFormat(
          "  %8d  %-13s  %6s  %12d  %-10s  %-12s  %-12s  %7.1fs%s\n", p.op_seq(), p.kind(),
          p.unit() < 0 ? "-" : absl::StrCat(p.unit()), p.bytes(), p.name(),
          Ranks(p.arrived_ranks()), Ranks(p.missing_ranks()), p.age_seconds(),
          p.running() ? "  (moving data)" : "");
    }
  }
}

void PrintJson(const v1::ListPendingCollectivesResponse& response) {
  nlohmann::json groups = nlohmann::json::array();
  for (const v1::GroupCollectives& g : response.groups()) {
    nlohmann::json pending = nlohmann::json::array();
    for (const v1::PendingCollective& p : g.pending()) {
      pending.push_back({{"op_seq", p.op_seq()},
                         {"kind", p.kind()},
                         {"unit", p.unit()},
                         {"bytes", p.bytes()},
                         {"name", p.name()},
                         {"arrived_ranks", std::vector<int>(p.arrived_ranks().begin(),
                                                            p.arrived_ranks().end())},
                         {"missing_ranks", std::vector<int>(p.missing_ranks().begin(),
                                                            p.missing_ranks().end())},
                         {"age_seconds", p.age_seconds()},
                         {"running", p.running()}});
    }
    groups.push_back({{"group", g.group()},
                      {"world_size", g.world_size()},
                      {"epoch", g.epoch()},
                      {"local_ranks", std::vector<int>(g.local_ranks().begin(),
                                                       g.local_ranks().end())},
                      {"status", g.status()},
                      {"pending", pending}});
  }
  std::cout << nlohmann::json{{"groups", groups}}.dump(2) << "\n";
}

}  // namespace

int RunPendingCommand(const std::vector<std::string>& args) {
  // One optional positional GROUP among the flags; a flag that takes a value keeps its next
  // argument.
  std::vector<std::string> flag_args;
  std::string group;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      if (!group.empty()) {
        std::cerr << "flatshardctl pending: more than one GROUP given ('" << group << "', '" << a
                  << "')\n";
        return 2;
      }
      group = a;
      continue;
    }
    flag_args.push_back(a);
    const std::string name = a.substr(2, a.find('=') == std::string::npos ? std::string::npos
                                                                           : a.find('=') - 2);
    for (const FlagSpec& spec : PendingFlags()) {
      if (spec.name == name && !spec.value_name.empty() && a.find('=') == std::string::npos &&
          i + 1 < args.size()) {
        flag_args.push_back(args[++i]);
      }
    }
  }
  absl::StatusOr<ParsedFlags> flags = ParseFlags(PendingFlags(), flag_args);
  if (!flags.ok()) {
    std::cerr << "flatshardctl pending: " << flags.status().message() << "\n";
    return 2;
  }
  if (flags->Has("help")) {
    std::cout << Usage();
    return 0;
  }
  absl::StatusOr<int64_t> timeout_ms =
      flags->Has("timeout-ms") ? flags->GetInt("timeout-ms", 1, 3600000) : 5000;
  if (!timeout_ms.ok()) {
    std::cerr << "flatshardctl pending: " << timeout_ms.status().message() << "\n";
    return 2;
  }
  if (flags->Has("socket") && flags->Has("address")) {
    std::cerr << "flatshardctl pending: give --socket or --address, not both\n";
    return 2;
  }
  const std::string target =
      flags->Has("address") ? *flags->Get("address")
                            : "unix:" + flags->Get("socket").value_or("/run/flatshard/flatshardd.sock");
  auto stub = v1::AdminService::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(*timeout_ms));
  v1::ListPendingCollectivesRequest request;
  request.set_group(group);
  v1::ListPendingCollectivesResponse response;
  const grpc::Status status = stub->ListPendingCollectives(&ctx, request, &response);
  if (!status.ok()) {
    const bool down = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    std::cerr << "flatshardctl pending: "
              << (down ? absl::StrCat("no daemon answering at ", target, " (is flatshardd running?)")
                       : status.error_message())
              << "\n";
    return 1;
  }
  if (flags->Has("json")) {
    PrintJson(response);
  } else {
    PrintTable(response);
  }
  return 0;
}

}  // namespace flatshard::cli
