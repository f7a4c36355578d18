#pragma once
// A real flatshardd process for integration tests: a private socket in a fresh temp directory
// and a private segment prefix, so tests may run in parallel. Killed (SIGKILL) at the end
// unless Terminate() stopped it; leftover segments and the directory are removed.
// Thread-compatible. Uses FS_BINARY_DIR (set by fs_cc_test).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::testing {

class DaemonProcess {
 public:
  explicit DaemonProcess(const std::string& tag_prefix = "fstest") {
    static int counter = 0;
    tag_ = absl::StrCat(tag_prefix, getpid(), "x", counter++);
    dir_ = std::filesystem::temp_directory_path() / tag_;
    std::filesystem::create_directories(dir_);
    socket_ = (dir_ / "flatshardd.sock").string();
    pid_ = fork();
    if (pid_ == 0) {
      const std::string bin = std::string(FS_BINARY_DIR) + "/server/flatshardd";
      const std::string socket_flag = "--socket=" + socket_;
      const std::string prefix_flag = "--segment_prefix=" + tag_;
      execl(bin.c_str(), bin.c_str(), socket_flag.c_str(), prefix_flag.c_str(),
            "--default_wait=10s", static_cast<char*>(nullptr));
      _exit(127);
    }
    // The socket appears once the server listens.
    for (int i = 0; i < 2000 && !std::filesystem::exists(socket_); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(std::filesystem::exists(socket_)) << "flatshardd did not come up on " << socket_;
  }
  ~DaemonProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    for (const std::string& s : Segments()) std::filesystem::remove(s);
    std::filesystem::remove_all(dir_);
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Sends SIGTERM and returns the exit status (128 + signal if killed; -1 after 20 s).
  int Terminate() {
    kill(pid_, SIGTERM);
    for (int i = 0; i < 2000; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  // The daemon's segments still in /dev/shm.
  std::vector<std::string> Segments() const {
    std::vector<std::string> out;
    for (const std::string& name : ListSegments(tag_)) out.push_back("/dev/shm/" + name);
    return out;
  }
  std::string address() const { return "unix:" + socket_; }
  const std::string& socket() const { return socket_; }
  const std::string& tag() const { return tag_; }

 private:
  std::string tag_;
  std::filesystem::path dir_;
  std::string socket_;
  pid_t pid_ = -1;
};

}  // namespace flatshard::testing
