#include "server/access/unix_socket_acceptor.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/logging.h"

namespace flatshard::server::access {
namespace {

absl::Status ErrnoError(int err, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EADDRINUSE:
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    case ENAMETOOLONG:
    case EINVAL:
      return absl::InvalidArgumentError(message);
    default:
      return absl::UnavailableError(message);
  }
}

// The gid of group `name` (a name, or a number).
absl::StatusOr<gid_t> LookupGroup(const std::string& name) {
  struct group grp;
  struct group* found = nullptr;
  std::vector<char> buf(16384);
  int err = 0;
  while ((err = ::getgrnam_r(name.c_str(), &grp, buf.data(), buf.size(), &found)) == ERANGE &&
         buf.size() < (1u << 22)) {
    buf.resize(buf.size() * 2);
  }
  if (found != nullptr) return found->gr_gid;
  uint32_t numeric = 0;
  if (absl::SimpleAtoi(name, &numeric)) return static_cast<gid_t>(numeric);
  return absl::NotFoundError(
      absl::StrCat("--socket_group: there is no group named \"", name, "\"",
                   err != 0 ? absl::StrCat(" (", std::strerror(err), ")") : std::string()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixSocketAcceptor>> UnixSocketAcceptor::Listen(
    const std::string& path, const std::string& socket_group) {
  std::optional<gid_t> gid;
  if (!socket_group.empty()) {
    absl::StatusOr<gid_t> g = LookupGroup(socket_group);
    if (!g.ok()) return g.status();
    gid = *g;
  }
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path ", path, " is longer than ",
                                                   sizeof(addr.sun_path) - 1, " characters"));
  }
  // The socket is bound, given its mode and listening under a temporary name, then renamed
  // into place: a client that sees `path` can connect (a file that exists before listen()
  // refuses connections, which raced with readiness checks that wait for the file). When the
  // temporary name does not fit sun_path, bind in place as before.
  std::string bound = absl::StrCat(path, ".", ::getpid(), ".tmp");
  if (bound.size() >= sizeof(addr.sun_path)) bound = path;
  std::memcpy(addr.sun_path, bound.data(), bound.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoError(errno, "socket(AF_UNIX)");
  auto fail = [&](absl::string_view what) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, absl::StrCat(what, " ", path));
  };
  ::unlink(bound.c_str());  // a temporary name left by a daemon that died here (same pid)
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return fail("bind");
  }
  // Before listen(): until then a connect() is refused, whatever the umask made of the mode.
  if (gid.has_value() && ::chown(bound.c_str(), static_cast<uid_t>(-1), *gid) != 0) {
    ::unlink(bound.c_str());
    return fail(absl::StrCat("chown to group ", socket_group, " (--socket_group) of"));
  }
  if (::chmod(bound.c_str(), 0660) != 0) {
    ::unlink(bound.c_str());
    return fail("chmod 0660");
  }
  if (::listen(fd, SOMAXCONN) != 0) {
    ::unlink(bound.c_str());
    return fail("listen");
  }
  if (bound != path && ::rename(bound.c_str(), path.c_str()) != 0) {
    ::unlink(bound.c_str());
    return fail("rename into place");
  }
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::unlink(path.c_str());
    return fail("pipe for");
  }
  return std::unique_ptr<UnixSocketAcceptor>(new UnixSocketAcceptor(path, fd, wake[0], wake[1]));
}

UnixSocketAcceptor::~UnixSocketAcceptor() {
  Stop();
  if (wake_read_ >= 0) ::close(wake_read_);
  if (wake_write_ >= 0) ::close(wake_write_);
}

void UnixSocketAcceptor::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixSocketAcceptor::Stop() {
  if (thread_.joinable()) {
    const char c = 'x';
    ssize_t ignored = ::write(wake_write_, &c, 1);
    (void)ignored;
    thread_.join();
  }
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void UnixSocketAcceptor::AcceptLoop(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      FS_LOG(ERROR) << "poll on " << path_ << ": " << std::strerror(errno);
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    // Non-blocking, as gRPC's own acceptor makes them.
    const int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        FS_LOG(WARNING) << "accept on " << path_ << ": " << std::strerror(errno);
        if (errno == EMFILE || errno == ENFILE) ::usleep(10000);  // do not spin
      }
      continue;
    }
    ucred cred = {};
    socklen_t len = sizeof(cred);
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      FS_LOG(WARNING) << "SO_PEERCRED on " << path_ << ": " << std::strerror(errno)
                      << "; connection refused";
      ::close(conn);
      continue;
    }
    {
      // Before gRPC sees the descriptor: no call on it can run before its entry exists.
      absl::MutexLock lock(&mu_);
      by_fd_[conn] = PeerCredentials{cred.uid, cred.gid, cred.pid};
    }
    FS_VLOG(1) << "connection fd:" << conn << " from uid=" << cred.uid << " pid=" << cred.pid;
    grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns and closes it from here
  }
}

std::optional<PeerCredentials> UnixSocketAcceptor::Lookup(absl::string_view peer) const {
  if (!absl::ConsumePrefix(&peer, "fd:")) return std::nullopt;
  int fd = -1;
  if (!absl::SimpleAtoi(peer, &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

}  // namespace flatshard::server::access
