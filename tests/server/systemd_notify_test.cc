// SystemdNotifier against a real AF_UNIX datagram socket standing in for systemd's.

#include "server/systemd_notify.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

// A bound datagram socket: a path, or an abstract name when `name` starts with '@'.
class FakeSystemd {
 public:
  explicit FakeSystemd(std::string name) : name_(std::move(name)) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, name_.data(), name_.size());
    if (name_[0] == '@') addr.sun_path[0] = '\0';
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name_.size());
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  }
  ~FakeSystemd() {
    ::close(fd_);
    if (name_[0] == '/') ::unlink(name_.c_str());
  }
  // The next datagram, or "" after `timeout_ms`.
  std::string Receive(int timeout_ms = 2000) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return "";
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }

 private:
  std::string name_;
  int fd_ = -1;
};

std::string TempSocketPath() {
  return (std::filesystem::temp_directory_path() /
          absl::StrCat("fs_notify_", ::getpid(), "_",
                       ::testing::UnitTest::GetInstance()->current_test_info()->name()))
      .string();
}

TEST(SystemdNotifyTest, SendsStatesToAPathSocket) {
  const std::string path = TempSocketPath();
  FakeSystemd systemd(path);
  SystemdNotifier notifier(path, absl::ZeroDuration());
  ASSERT_TRUE(notifier.enabled());
  ASSERT_TRUE(notifier.Notify("READY=1\nSTATUS=serving").ok());
  EXPECT_EQ(systemd.Receive(), "READY=1\nSTATUS=serving");
  ASSERT_TRUE(notifier.Notify("STOPPING=1").ok());
  EXPECT_EQ(systemd.Receive(), "STOPPING=1");
  notifier.StartWatchdog();  // no interval: nothing is sent
  EXPECT_EQ(systemd.Receive(100), "");
}

TEST(SystemdNotifyTest, SendsToAnAbstractSocket) {
  const std::string name = absl::StrCat("@fs_notify_test_", ::getpid());
  FakeSystemd systemd(name);
  SystemdNotifier notifier(name, absl::ZeroDuration());
  ASSERT_TRUE(notifier.Notify("READY=1").ok());
  EXPECT_EQ(systemd.Receive(), "READY=1");
}

TEST(SystemdNotifyTest, WatchdogSendsKeepAlivesAtHalfTheInterval) {
  const std::string path = TempSocketPath();
  FakeSystemd systemd(path);
  SystemdNotifier notifier(path, absl::Milliseconds(100));
  notifier.StartWatchdog();
  // One at once, then every 50 ms.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(systemd.Receive(1000), "WATCHDOG=1") << i;
  notifier.StopWatchdog();
  while (!systemd.Receive(20).empty()) {
  }
  EXPECT_EQ(systemd.Receive(200), "") << "keep-alives after StopWatchdog";
}

TEST(SystemdNotifyTest, ReadsTheEnvironment) {
  const std::string path = TempSocketPath();
  FakeSystemd systemd(path);
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  ::setenv("WATCHDOG_USEC", "3000000", 1);
  ::unsetenv("WATCHDOG_PID");
  {
    SystemdNotifier n = SystemdNotifier::FromEnvironment();
    EXPECT_TRUE(n.enabled());
    EXPECT_EQ(n.watchdog_interval(), absl::Seconds(3));
    ASSERT_TRUE(n.Notify("STATUS=x").ok());
    EXPECT_EQ(systemd.Receive(), "STATUS=x");
  }
  // The watchdog is meant for another process.
  ::setenv("WATCHDOG_PID", std::to_string(::getpid() + 1).c_str(), 1);
  EXPECT_EQ(SystemdNotifier::FromEnvironment().watchdog_interval(), absl::ZeroDuration());
  ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
  EXPECT_EQ(SystemdNotifier::FromEnvironment().watchdog_interval(), absl::Seconds(3));
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  ::unsetenv("WATCHDOG_PID");
  SystemdNotifier off = SystemdNotifier::FromEnvironment();
  EXPECT_FALSE(off.enabled());
  EXPECT_TRUE(off.Notify("READY=1").ok()) << "no socket: a no-op";
}

TEST(SystemdNotifyTest, AMissingSocketIsAnError) {
  SystemdNotifier notifier(TempSocketPath() + ".absent", absl::ZeroDuration());
  EXPECT_EQ(notifier.Notify("READY=1").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(SystemdNotifier("relative", absl::ZeroDuration()).Notify("READY=1").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flatshard::server
