#include "client/cli/admin_command.h"

#include <algorithm>
#include <chrono>
#include <iostream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"

namespace flatshard::cli {
namespace {

constexpr char kDefaultSocket[] = "/run/flatshard/flatshardd.sock";

// --tls-ca/--tls-cert/--tls-key: mutual TLS to a daemon's --tcp_address (started with
// --tls_cert/--tls_key/--tls_ca). None given: plaintext. Errors name the flag.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ParsedFlags& flags) {
  const bool any = flags.Has("tls-ca") || flags.Has("tls-cert") || flags.Has("tls-key");
  if (!any) return grpc::InsecureChannelCredentials();
  if (!flags.Has("address")) {
    return absl::InvalidArgumentError("--tls-ca/--tls-cert/--tls-key go with --address");
  }
  grpc::SslCredentialsOptions ssl;
  for (auto [flag, pem] : {std::pair<const char*, std::string*>{"tls-ca", &ssl.pem_root_certs},
                           {"tls-cert", &ssl.pem_cert_chain},
                           {"tls-key", &ssl.pem_private_key}}) {
    const std::optional<std::string> path = flags.Get(flag);
    if (!path) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mutual TLS needs --tls-ca, --tls-cert and --tls-key; --", flag, " is missing"));
    }
    absl::StatusOr<std::string> text = ReadWholeFile(*path);
    if (!text.ok() || text->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": cannot read '", *path, "'",
                       text.ok() ? " (empty)" : absl::StrCat(" (", text.status().message(), ")")));
    }
    *pem = *std::move(text);
  }
  return grpc::SslCredentials(ssl);
}

std::string OneLine(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

std::vector<FlagSpec> AllFlags(const AdminCommandSpec& spec) {
  std::vector<FlagSpec> flags = spec.flags;
  flags.push_back(
      {"socket", "PATH", absl::StrCat("the daemon's Unix socket (default ", kDefaultSocket, ")")});
  flags.push_back({"address", "HOST:PORT", "the daemon's TCP address instead of its socket"});
  flags.push_back({"tls-ca", "PEM", "with --address: the CA that signed the daemon's certificate"});
  flags.push_back({"tls-cert", "PEM", "with --address: this client's certificate (mutual TLS)"});
  flags.push_back({"tls-key", "PEM", "with --address: this client's private key"});
  flags.push_back({"timeout-ms", "N",
                   spec.timeout_help.empty()
                       ? absl::StrCat("how long to wait for the daemon's answer (default ",
                                      spec.default_timeout_ms, ")")
                       : spec.timeout_help});
  flags.push_back({"json", "", "print JSON (stable keys) instead of a table"});
  flags.push_back({"help", "", "show this help"});
  return flags;
}

std::string Usage(const AdminCommandSpec& spec, const std::vector<FlagSpec>& flags) {
  return absl::StrCat(
      "Usage: flatshardctl ", spec.name, spec.synopsis.empty() ? "" : " ", spec.synopsis,
      " [--socket PATH | --address HOST:PORT] [--timeout-ms N] [--json]\n\n", spec.description,
      "\nFlags:\n", FlagsHelp(flags), "\n",
      spec.exit_help.empty() ? "Exit status: 0 on success; 1 when the daemon cannot be reached "
                               "or refuses; 2 for bad flags.\n"
                             : spec.exit_help);
}

}  // namespace

void AdminCall::SetDeadline(grpc::ClientContext& ctx, absl::Duration extra) const {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms_) +
                   absl::ToChronoMilliseconds(extra));
}

int AdminCall::Error(const std::string& message, int exit_code) const {
  std::cerr << "flatshardctl " << command_ << ": " << OneLine(message) << "\n";
  return exit_code;
}

int AdminCall::Fail(const grpc::Status& status) const {
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return Error(absl::StrCat("no daemon answering at ", target_, " (is flatshardd running?)"),
                   1);
    case grpc::StatusCode::UNIMPLEMENTED:
      return Error(absl::StrCat("the daemon at ", target_, " does not serve '", command_,
                                "' (an older flatshardd?)"),
                   1);
    default:
      return Error(status.error_message(), 1);
  }
}

int RunAdminCommand(const AdminCommandSpec& spec, const std::vector<std::string>& args,
                    const std::function<int(AdminCall&)>& body,
                    const std::function<std::string(const AdminCall&)>& validate) {
  AdminCall call;
  call.command_ = spec.name;
  const std::vector<FlagSpec> specs = AllFlags(spec);
  // Positional arguments among the flags; a flag that takes a value keeps its next argument.
  std::vector<std::string> flag_args;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() < 2 || a[0] != '-') {
      call.args_.push_back(a);
      continue;
    }
    flag_args.push_back(a);
    if (a.find('=') != std::string::npos || a.rfind("--", 0) != 0) continue;
    for (const FlagSpec& s : specs) {
      if (s.name == a.substr(2) && !s.value_name.empty() && i + 1 < args.size()) {
        flag_args.push_back(args[++i]);
      }
    }
  }
  absl::StatusOr<ParsedFlags> flags = ParseFlags(specs, flag_args);
  if (!flags.ok()) return call.Error(std::string(flags.status().message()), 2);
  call.flags_ = *std::move(flags);
  if (call.flags_.Has("help")) {
    std::cout << Usage(spec, specs);
    return 0;
  }
  if (static_cast<int>(call.args_.size()) > spec.max_args) {
    return call.Error(absl::StrCat("unexpected argument '", call.args_[spec.max_args], "'"), 2);
  }
  if (static_cast<int>(call.args_.size()) < spec.min_args) {
    return call.Error(
        absl::StrCat(spec.args_name, " is required (see flatshardctl ", spec.name, " --help)"), 2);
  }
  absl::StatusOr<int64_t> timeout_ms = call.flags_.Has("timeout-ms")
                                           ? call.flags_.GetInt("timeout-ms", 0, 86400000)
                                           : spec.default_timeout_ms;
  if (!timeout_ms.ok()) return call.Error(std::string(timeout_ms.status().message()), 2);
  call.timeout_ms_ = *timeout_ms;
  if (call.flags_.Has("socket") && call.flags_.Has("address")) {
    return call.Error("give --socket or --address, not both", 2);
  }
  if (validate) {
    if (std::string problem = validate(call); !problem.empty()) return call.Error(problem, 2);
  }
  call.target_ = call.flags_.Has("address")
                     ? *call.flags_.Get("address")
                     : absl::StrCat("unix:", call.flags_.Get("socket").value_or(kDefaultSocket));
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentialsFor(call.flags_);
  if (!credentials.ok()) return call.Error(std::string(credentials.status().message()), 2);
  // Admin replies grow with the daemon's groups, units and ranks: read any size the daemon
  // sends (it bounds what goes into them; README "Limits"), not gRPC's 4 MiB default.
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);
  call.channel_ = grpc::CreateCustomChannel(call.target_, *credentials, channel_args);
  call.stub_ = v1::AdminService::NewStub(call.channel_);
  return body(call);
}

std::string FormatTable(const std::vector<std::vector<std::string>>& rows,
                        const std::string& indent) {
  size_t columns = 0;
  for (const auto& row : rows) columns = std::max(columns, row.size());
  std::vector<size_t> width(columns, 0);
  std::vector<bool> numeric(columns, rows.size() > 1);
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t c = 0; c < rows[r].size(); ++c) {
      width[c] = std::max(width[c], rows[r][c].size());
      double ignored = 0;
      if (r > 0 && !absl::SimpleAtod(rows[r][c], &ignored)) numeric[c] = false;
    }
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = indent;
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string pad(width[c] - row[c].size(), ' ');
      absl::StrAppend(&line, c == 0 ? "" : "  ", numeric[c] ? pad + row[c] : row[c] + pad);
    }
    absl::StrAppend(&out, absl::StripTrailingAsciiWhitespace(line), "\n");
  }
  return out;
}

std::string HumanBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (value >= 1024 && u < 3) {
    value /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", value, units[u]);
}

std::string JoinOrDash(const std::vector<int32_t>& values) {
  return values.empty() ? "-" : absl::StrJoin(values, ",");
}

std::string ModuleName(const std::string& module) { return module.empty() ? "(root)" : module; }

}  // namespace flatshard::cli
