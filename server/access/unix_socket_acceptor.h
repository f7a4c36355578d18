#pragma once
// UnixSocketAcceptor: flatshardd's Unix socket, accepted by hand so that the daemon learns who
// is on the other end. gRPC 1.51 does not expose SO_PEERCRED, so the acceptor binds and
// listens itself (mode 0660, optionally chgrp'ed to --socket_group), reads SO_PEERCRED of
// every accepted connection, remembers it under the connection's descriptor and hands the
// descriptor to the gRPC server (grpc::AddInsecureChannelFromFd). Calls on such a channel
// report ctx->peer() == "fd:<n>"; Lookup("fd:<n>") gives the credentials read at accept time.
//
// Why the fd number identifies the connection: gRPC closes the descriptor only when the
// channel's transport is destroyed, and every live call holds a reference on its channel, so
// while a handler runs the number cannot be reused by a later accept. An entry is overwritten
// when the kernel hands out the same number again, i.e. only after every call of the old
// connection is gone.
//
//   auto acceptor = UnixSocketAcceptor::Listen("/run/flatshard/flatshardd.sock", "trainers");
//   ... build and start the grpc::Server (without a unix: listening port) ...
//   (*acceptor)->Start(server.get());
//   ... handlers: (*acceptor)->Lookup(ctx->peer()) ...
//   (*acceptor)->Stop();  // before server->Shutdown()
//
// Thread-safe: Lookup may be called from any thread; Start and Stop from one thread.

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class Server;
}

namespace flatshard::server::access {

// What the kernel says about the process that connected (SO_PEERCRED, at connect time).
struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

class UnixSocketAcceptor {
 public:
  // Binds `path` (which must not exist: the caller removes stale sockets), chowns it to the
  // group `socket_group` when not empty, sets mode 0660 and listens. Errors: NOT_FOUND when
  // the group does not exist (naming --socket_group); the errno code of socket, bind, chown,
  // chmod or listen, naming the path.
  static absl::StatusOr<std::unique_ptr<UnixSocketAcceptor>> Listen(
      const std::string& path, const std::string& socket_group);
  ~UnixSocketAcceptor();  // Stop()
  UnixSocketAcceptor(const UnixSocketAcceptor&) = delete;
  UnixSocketAcceptor& operator=(const UnixSocketAcceptor&) = delete;

  // Starts the accept thread; connections go to `server`, which must outlive Stop().
  void Start(grpc::Server* server);
  // Stops accepting and closes the listening socket (connections already handed to gRPC stay
  // with it). Idempotent.
  void Stop();

  // The credentials of the connection whose gRPC peer string is `peer` ("fd:<n>"); nullopt
  // for any other peer string or an unknown descriptor.
  std::optional<PeerCredentials> Lookup(absl::string_view peer) const;

 private:
  UnixSocketAcceptor(std::string path, int listen_fd, int wake_read, int wake_write)
      : path_(std::move(path)),
        listen_fd_(listen_fd),
        wake_read_(wake_read),
        wake_write_(wake_write) {}
  void AcceptLoop(grpc::Server* server);

  const std::string path_;
  int listen_fd_ = -1;
  int wake_read_ = -1;  // Stop() writes to wake_write_; the loop polls wake_read_
  int wake_write_ = -1;
  std::thread thread_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, PeerCredentials> by_fd_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server::access
