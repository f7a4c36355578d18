#include "client/channel_target.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace flatshard::client::internal {

// ClientOptions::address as the gRPC target to dial. gRPC takes any string and, for one it
// cannot resolve (a bare socket path, a host without a port), only times out after
// call_timeout saying nothing of why; so a filesystem path becomes "unix:<path>" and what
// is neither a target nor a path is refused at once.
absl::StatusOr<std::string> ChannelTarget(const std::string& address) {
  if (address.empty()) return absl::InvalidArgumentError("Connect: empty address");
  // gRPC's own schemes, and any "scheme://..." URI (e.g. dns:///host:port): as given.
  for (absl::string_view scheme : {"unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:"}) {
    if (absl::StartsWith(address, scheme)) return address;
  }
  if (const size_t colon = address.find("://");
      colon != std::string::npos && colon > 0 && absl::ascii_isalpha(address[0])) {
    return address;
  }
  // A path: "/run/flatshard/flatshardd.sock", "./d.sock", "sockets/d.sock".
  if (absl::StrContains(address, '/')) return absl::StrCat("unix:", address);
  // host:port, host a name, an IPv4 address or a bracketed IPv6 address.
  if (const size_t colon = address.rfind(':'); colon != std::string::npos && colon > 0) {
    const absl::string_view host = absl::string_view(address).substr(0, colon);
    const absl::string_view digits = absl::string_view(address).substr(colon + 1);
    int port = 0;
    const bool port_ok = !digits.empty() && digits.size() <= 5 &&
                         std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) &&
                         absl::SimpleAtoi(digits, &port) && port > 0 && port <= 65535;
    const bool host_ok = (host.size() > 2 && host.front() == '[' && host.back() == ']') ||
                         host.find_first_of(":[] \t") == absl::string_view::npos;
    if (port_ok && host_ok) return address;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "Connect: address \"", address,
      "\" is neither a Unix socket nor host:port; write \"unix:/path/to.sock\" (or a path "
      "with a '/': \"/path/to.sock\", \"./to.sock\") or \"host:port\""));
}

namespace {

// ClientOptions::tls_*: all three PEM files, read now (INVALID_ARGUMENT naming a missing one).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentials(
    const ClientOptions& options) {
  auto read = [](const std::string& path, const char* field) -> absl::StatusOr<std::string> {
    if (path.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Connect: TLS needs tls_ca_file, tls_cert_file and tls_key_file; ", field, " is empty"));
    }
    absl::StatusOr<std::string> text = ReadWholeFile(path);
    if (!text.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("Connect: cannot read ", field, " ", path,
                                                     " (", text.status().message(), ")"));
    }
    return text;
  };
  grpc::SslCredentialsOptions ssl;
  FS_ASSIGN_OR_RETURN(ssl.pem_root_certs, read(options.tls_ca_file, "tls_ca_file"));
  FS_ASSIGN_OR_RETURN(ssl.pem_cert_chain, read(options.tls_cert_file, "tls_cert_file"));
  FS_ASSIGN_OR_RETURN(ssl.pem_private_key, read(options.tls_key_file, "tls_key_file"));
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options) {
  const bool tls = !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
                   !options.tls_key_file.empty();
  if (!tls || options.address.rfind("unix:", 0) == 0) return grpc::InsecureChannelCredentials();
  return TlsCredentials(options);
}

}  // namespace flatshard::client::internal
