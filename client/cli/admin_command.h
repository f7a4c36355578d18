#pragma once
// What flatshardctl's daemon commands (status, groups, units, pending, drain, undrain,
// log-level, delete-group) share:
// the common flags (--socket, --address, --timeout-ms, --json, --help), positional arguments,
// the help text, the channel to the daemon, and errors as one line on stderr:
//
//   flatshardctl status: no daemon answering at unix:/run/flatshard/flatshardd.sock (is
//   flatshardd running?)
//
// Exit status of every such command: 0 success; 1 the daemon cannot be reached, refuses, or
// (drain) did not finish; 2 bad flags or arguments. Thread-compatible.

#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
#include "absl/time/time.h"
#include "client/cli/flags.h"
#include "flatshard/v1/admin_service.grpc.pb.h"

namespace flatshard::cli {

struct AdminCommandSpec {
  std::string name;             // "units"
  std::string synopsis;         // after "flatshardctl units" in the usage line, e.g. "GROUP"
  std::string description;      // paragraphs after the usage line
  std::vector<FlagSpec> flags;  // the command's own; the common ones are added after them
  int min_args = 0;             // positional arguments
  int max_args = 0;
  std::string args_name;  // "GROUP", for errors
  int64_t default_timeout_ms = 5000;
  std::string timeout_help;  // replaces the --timeout-ms help when not empty
  std::string exit_help;     // replaces the exit status paragraph when not empty
};

// A parsed invocation and its connection to the daemon.
class AdminCall {
 public:
  const std::string& command() const { return command_; }
  const ParsedFlags& flags() const { return flags_; }
  const std::vector<std::string>& args() const { return args_; }
  bool json() const { return flags_.Has("json"); }
  // "unix:/path" or "host:port".
  const std::string& target() const { return target_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  v1::AdminService::Stub& stub() { return *stub_; }
  // The channel behind stub(), for commands of other services (weights).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  // Sets the deadline of a call: now + --timeout-ms + `extra`.
  void SetDeadline(grpc::ClientContext& ctx, absl::Duration extra = absl::ZeroDuration()) const;
  // Prints the failed call as one line on stderr ("no daemon answering at ..." when nothing
  // answered) and returns 1.
  int Fail(const grpc::Status& status) const;
  // "flatshardctl <command>: " + `message` (newlines flattened) on stderr; returns `exit_code`.
  int Error(const std::string& message, int exit_code) const;

 private:
  friend int RunAdminCommand(const AdminCommandSpec&, const std::vector<std::string>&,
                             const std::function<int(AdminCall&)>&,
                             const std::function<std::string(const AdminCall&)>&);
  std::string command_;
  ParsedFlags flags_;
  std::vector<std::string> args_;
  std::string target_;
  int64_t timeout_ms_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AdminService::Stub> stub_;
};

// Parses `args` (the arguments after the command name) against `spec`, answers --help, checks
// the arguments with `validate` (an error message: exit 2), connects and runs `body`, whose
// result is the exit status.
int RunAdminCommand(const AdminCommandSpec& spec, const std::vector<std::string>& args,
                    const std::function<int(AdminCall&)>& body,
                    const std::function<std::string(const AdminCall&)>& validate = nullptr);

// A unary AdminService method, e.g. &v1::AdminService::Stub::GetStatus.
template <typename Request, typename Response>
using AdminRpc = grpc::Status (v1::AdminService::Stub::*)(grpc::ClientContext*, const Request&,
                                                          Response*);

// Calls `rpc` with the command's deadline; prints to_json(response) under --json, else
// print_table(response). Returns the exit status.
template <typename Request, typename Response>
int CallAndPrint(
    AdminCall& call, AdminRpc<Request, Response> rpc, const Request& request,
    const std::function<nlohmann::json(const std::type_identity_t<Response>&)>& to_json,
    const std::function<void(const std::type_identity_t<Response>&)>& print_table) {
  grpc::ClientContext ctx;
  call.SetDeadline(ctx);
  Response response;
  const grpc::Status status = (call.stub().*rpc)(&ctx, request, &response);
  if (!status.ok()) return call.Fail(status);
  if (call.json()) {
    std::cout << to_json(response).dump(2) << "\n";
  } else {
    print_table(response);
  }
  return 0;
}

// Rows as aligned columns (two spaces apart), each line prefixed with `indent`; a column whose
// cells (header row aside) are all numbers is right-aligned.
std::string FormatTable(const std::vector<std::vector<std::string>>& rows,
                        const std::string& indent = "");

// "1536 B" / "1.5 KiB" / "2.0 GiB".
std::string HumanBytes(int64_t bytes);
// A comma-separated list, "-" when empty.
std::string JoinOrDash(const std::vector<int32_t>& values);
// A registered module path as tables show it: "(root)" for "".
std::string ModuleName(const std::string& module);

}  // namespace flatshard::cli
