#pragma once
// The sd_notify protocol (systemd's `Type=notify`) without libsystemd, as documented in
// sd_notify(3) and systemd.service(5): one datagram of "KEY=VALUE\n..." to the AF_UNIX socket
// named by $NOTIFY_SOCKET (a path, or an abstract name when it starts with '@').
//
//   SystemdNotifier notifier = SystemdNotifier::FromEnvironment();
//   notifier.Notify("READY=1\nSTATUS=listening on /run/flatshard/flatshardd.sock");
//   notifier.StartWatchdog();        // WATCHDOG=1 every $WATCHDOG_USEC / 2, if set for us
//   ...
//   notifier.Notify("STOPPING=1");
//   notifier.StopWatchdog();
//
// Without $NOTIFY_SOCKET (not started by systemd) every call is a no-op that returns OK, so the
// daemon calls it unconditionally. The environment is read once, by FromEnvironment; the
// variables are left in place (child processes are not expected).
//
// Thread safety: Notify may be called from any thread; Start/StopWatchdog from one thread.

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace flatshard::server {

class SystemdNotifier {
 public:
  // Reads $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID. The watchdog is enabled when
  // WATCHDOG_USEC is a positive integer and WATCHDOG_PID is unset or this process's pid.
  static SystemdNotifier FromEnvironment();
  // For tests: an explicit socket ("" = disabled) and watchdog interval (zero = none).
  SystemdNotifier(std::string socket, absl::Duration watchdog_interval);
  ~SystemdNotifier();  // stops the watchdog thread
  SystemdNotifier(SystemdNotifier&& other) noexcept;
  SystemdNotifier& operator=(SystemdNotifier&&) = delete;
  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;

  // Whether there is a socket to notify.
  bool enabled() const { return !socket_.empty(); }
  // The keep-alive period systemd asked for ($WATCHDOG_USEC); zero when none.
  absl::Duration watchdog_interval() const { return watchdog_interval_; }

  // Sends `state` ("READY=1", "STOPPING=1", "STATUS=...", several separated by '\n').
  // OK without a socket. UNAVAILABLE when the datagram cannot be sent (the message names the
  // socket and errno); callers log it and go on: a lost READY makes systemd time out the
  // start, which is the right outcome anyway.
  absl::Status Notify(absl::string_view state) const;

  // Sends WATCHDOG=1 at once and then every watchdog_interval() / 2 from a thread, until
  // StopWatchdog. No-op without a socket or an interval, or when already running.
  void StartWatchdog();
  void StopWatchdog();

 private:
  std::string socket_;
  absl::Duration watchdog_interval_;
  std::unique_ptr<absl::Notification> stop_;
  std::thread watchdog_;
};

}  // namespace flatshard::server
