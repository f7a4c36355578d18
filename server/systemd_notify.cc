#include "server/systemd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace flatshard::server {

SystemdNotifier SystemdNotifier::FromEnvironment() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  absl::Duration interval = absl::ZeroDuration();
  if (const char* usec = std::getenv("WATCHDOG_USEC"); usec != nullptr) {
    int64_t us = 0;
    bool ours = true;
    // WATCHDOG_PID names the process the watchdog is meant for (systemd sets it when the
    // variables may be inherited by children).
    if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && *pid != '\0') {
      int64_t p = 0;
      ours = absl::SimpleAtoi(pid, &p) && p == static_cast<int64_t>(::getpid());
    }
    if (ours && absl::SimpleAtoi(usec, &us) && us > 0) interval = absl::Microseconds(us);
  }
  return SystemdNotifier(socket == nullptr ? "" : socket, interval);
}

SystemdNotifier::SystemdNotifier(std::string socket, absl::Duration watchdog_interval)
    : socket_(std::move(socket)), watchdog_interval_(watchdog_interval) {}

SystemdNotifier::SystemdNotifier(SystemdNotifier&& other) noexcept
    : socket_(std::move(other.socket_)), watchdog_interval_(other.watchdog_interval_) {
  FS_CHECK(!other.watchdog_.joinable()) << "moving a SystemdNotifier with a running watchdog";
}

SystemdNotifier::~SystemdNotifier() { StopWatchdog(); }

absl::Status SystemdNotifier::Notify(absl::string_view state) const {
  if (socket_.empty()) return absl::OkStatus();
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (socket_.size() >= sizeof(addr.sun_path) || (socket_[0] != '/' && socket_[0] != '@')) {
    return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET '", socket_, "' is not usable"));
  }
  std::memcpy(addr.sun_path, socket_.data(), socket_.size());
  // An abstract socket: a leading NUL, and the length counts exactly the name's bytes.
  if (socket_[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket_.size());
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("sd_notify: socket: ", std::strerror(errno)));
  }
  ssize_t n;
  do {
    n = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr),
                 len);
  } while (n < 0 && errno == EINTR);
  const int err = errno;
  ::close(fd);
  if (n < 0) {
    return absl::UnavailableError(absl::StrCat("sd_notify to ", socket_, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

void SystemdNotifier::StartWatchdog() {
  if (socket_.empty() || watchdog_interval_ <= absl::ZeroDuration() || watchdog_.joinable()) {
    return;
  }
  stop_ = std::make_unique<absl::Notification>();
  // Half the interval, as sd_watchdog_enabled(3) recommends: one late keep-alive is not fatal.
  const absl::Duration period = watchdog_interval_ / 2;
  watchdog_ = std::thread([this, period, stop = stop_.get()] {
    do {
      if (absl::Status s = Notify("WATCHDOG=1"); !s.ok()) {
        FS_LOG(WARNING) << "watchdog keep-alive failed: " << s;
      }
    } while (!stop->WaitForNotificationWithTimeout(period));
  });
  FS_LOG(INFO) << "systemd watchdog: keep-alive every " << period;
}

void SystemdNotifier::StopWatchdog() {
  if (!watchdog_.joinable()) return;
  stop_->Notify();
  watchdog_.join();
}

}  // namespace flatshard::server
