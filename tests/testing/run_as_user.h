#pragma once
// Runs a program as another uid and gid (tests that check what a second user may do: access
// control, published weights). The child drops its supplementary groups, then gid, then uid,
// and execs `args[0]` with exactly `env`; exit status 125: the drop failed, 127: exec failed.
// Returns waitpid's status, or -1 when fork or waitpid failed. Needs root.

#include <grp.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace flatshard::testing {

inline int RunAsUser(std::vector<std::string> args, std::vector<std::string> env, uid_t uid,
                     gid_t gid) {
  std::vector<char*> argv, envp;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) _exit(125);
    ::execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return status;
}

}  // namespace flatshard::testing
