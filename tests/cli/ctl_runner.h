#pragma once
// Runs the built `flatshardctl` binary (FS_BINARY_DIR/client/flatshardctl) as a user would,
// capturing stdout and stderr separately through files; stdin is /dev/null. StartCtl/WaitCtl
// run it in the background (e.g. a drain that waits), optionally with stdout on a given
// descriptor (a pseudo-terminal). Thread-compatible.

#include <fcntl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/files.h"

namespace flatshard::testing {

inline const std::string& CtlPath() {
  static const std::string* path =
      new std::string(std::string(FS_BINARY_DIR) + "/client/flatshardctl");
  return *path;
}

struct CtlResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// A flatshardctl started in the background.
struct CtlProcess {
  pid_t pid = -1;
  std::string out_path;
  std::string err_path;
};

// Starts flatshardctl with `args`; its stdout goes to `stdout_fd` when >= 0, else to a file.
inline CtlProcess StartCtl(const std::vector<std::string>& args, int stdout_fd = -1) {
  CtlProcess p;
  const std::string dir = ::testing::TempDir();
  p.out_path = dir + "/flatshardctl_out_XXXXXX";
  p.err_path = dir + "/flatshardctl_err_XXXXXX";
  const int out_fd = mkstemp(p.out_path.data());
  const int err_fd = mkstemp(p.err_path.data());
  if (out_fd < 0 || err_fd < 0) {
    ADD_FAILURE() << "mkstemp failed in " << dir;
    return p;
  }
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(CtlPath().c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  p.pid = fork();
  if (p.pid == 0) {
    dup2(stdout_fd >= 0 ? stdout_fd : out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    const int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    execv(CtlPath().c_str(), argv.data());
    _exit(127);
  }
  close(out_fd);
  close(err_fd);
  if (p.pid < 0) ADD_FAILURE() << "fork failed";
  return p;
}

// True while the background flatshardctl has not exited.
inline bool CtlRunning(const CtlProcess& p) {
  siginfo_t info = {};
  return p.pid > 0 && waitid(P_PID, p.pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
         info.si_pid == 0;
}

inline CtlResult WaitCtl(const CtlProcess& p) {
  CtlResult r;
  int status = 0;
  if (p.pid <= 0 || waitpid(p.pid, &status, 0) != p.pid) {
    ADD_FAILURE() << "waitpid failed";
  } else if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else {
    ADD_FAILURE() << "flatshardctl died with signal " << WTERMSIG(status);
  }
  r.out = ReadFile(p.out_path);
  r.err = ReadFile(p.err_path);
  unlink(p.out_path.c_str());
  unlink(p.err_path.c_str());
  return r;
}

inline CtlResult RunCtl(const std::vector<std::string>& args) { return WaitCtl(StartCtl(args)); }

inline std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::string line;
  std::istringstream in(text);
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

}  // namespace flatshard::testing
