#pragma once
// Mutual TLS for flatshardd's TCP ports (--tcp_address for remote clients, --peer_address for
// other daemons) and the channels PeerClient opens to other daemons.
//
// TlsFiles names three PEM files: this daemon's certificate (chain), its private key and the
// CA that signs every certificate of the deployment. With them the server requires a client
// certificate and verifies it against the CA (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_
// AND_VERIFY); peer channels present the same certificate and verify the server's against the
// same CA (and its name: the host of the peer address must be in the certificate's SAN).
//
// Without TLS, ServerCredentialsFor refuses a non-loopback address unless the operator said
// --allow_insecure_tcp: an unauthenticated port reachable from the network would let anyone
// who guesses a group token into its collectives.

#include <memory>
#include <string>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::server::access {

struct TlsFiles {
  std::string cert;  // --tls_cert
  std::string key;   // --tls_key
  std::string ca;    // --tls_ca
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// True for "127.x.x.x:port", "[::1]:port", "localhost:port" (with or without "ipv4:"/"ipv6:"
// scheme prefixes). "0.0.0.0", "[::]", host names and other addresses are not loopback.
bool IsLoopbackAddress(absl::string_view address);

// Credentials for a server port at `address`, named by `flag` in errors ("--tcp_address").
// TLS configured: all three files must be readable (INVALID_ARGUMENT naming the missing flag
// or unreadable file). Not configured: insecure credentials for a loopback address, or for
// any address with `allow_insecure`; else FAILED_PRECONDITION naming --allow_insecure_tcp.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsFiles& tls, bool allow_insecure, absl::string_view flag, absl::string_view address);

// Channel credentials for PeerClient: TLS with the same files, or insecure when not enabled.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerChannelCredentials(
    const TlsFiles& tls);

}  // namespace flatshard::server::access
