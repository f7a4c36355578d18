#include "server/access/tls_config.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"

namespace flatshard::server::access {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS needs --tls_cert, --tls_key and --tls_ca together; ", flag, " is missing"));
  }
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path, " (", text.status().message(), ")"));
  }
  if (text->find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a PEM file"));
  }
  return text;
}

struct Pems {
  std::string cert, key, ca;
};

absl::StatusOr<Pems> ReadAll(const TlsFiles& tls) {
  Pems p;
  absl::StatusOr<std::string> cert = ReadPem(tls.cert, "--tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(tls.key, "--tls_key");
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> ca = ReadPem(tls.ca, "--tls_ca");
  if (!ca.ok()) return ca.status();
  return Pems{*std::move(cert), *std::move(key), *std::move(ca)};
}

}  // namespace

bool IsLoopbackAddress(absl::string_view address) {
  absl::ConsumePrefix(&address, "dns:");
  absl::ConsumePrefix(&address, "ipv4:");
  absl::ConsumePrefix(&address, "ipv6:");
  absl::string_view host = address;
  if (absl::ConsumePrefix(&host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return false;
    host = host.substr(0, close);
  } else if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  return absl::StartsWith(host, "127.") || host == "::1" || host == "localhost";
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsFiles& tls, bool allow_insecure, absl::string_view flag, absl::string_view address) {
  if (!tls.enabled()) {
    if (!allow_insecure && !IsLoopbackAddress(address)) {
      return absl::FailedPreconditionError(absl::StrCat(
          flag, " ", address,
          " is not a loopback address and TLS is not configured "
          "(--tls_cert, --tls_key, --tls_ca); refusing to serve it without authentication. "
          "Configure TLS, bind 127.0.0.1, or pass --allow_insecure_tcp to accept the risk"));
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<Pems> pems = ReadAll(tls);
  if (!pems.ok()) return pems.status();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = pems->ca;
  options.pem_key_cert_pairs.push_back({pems->key, pems->cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerChannelCredentials(
    const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<Pems> pems = ReadAll(tls);
  if (!pems.ok()) return pems.status();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pems->ca;
  options.pem_private_key = pems->key;
  options.pem_cert_chain = pems->cert;
  return grpc::SslCredentials(options);
}

}  // namespace flatshard::server::access
