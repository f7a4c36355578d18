#include "tests/bench/multi_daemon_processes.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace flatshard::bench::md {

namespace fs = std::filesystem;

Children& children() {
  static Children* c = new Children;
  return *c;
}
std::atomic<bool> g_interrupted{false};

// Sends SIGTERM to the process group `pgid`, SIGKILL after `grace`, and reaps its leader.
void EndToolGroup(pid_t pgid, absl::Duration grace) {
  ::kill(-pgid, SIGTERM);
  const absl::Time give_up = absl::Now() + grace;
  while (absl::Now() < give_up) {
    if (::waitpid(pgid, nullptr, WNOHANG) == pgid) {
      ::kill(-pgid, SIGKILL);  // stragglers of the group, if any
      return;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  ::kill(-pgid, SIGKILL);
  ::waitpid(pgid, nullptr, 0);
}

// SIGINT and SIGTERM are blocked in every thread; this one waits for them, ends every child,
// removes the daemons' segments and directories, and exits 128 + signal.
void SignalThread(sigset_t signals) {
  int sig = 0;
  if (sigwait(&signals, &sig) != 0) return;
  g_interrupted = true;
  std::fprintf(stderr, "flatshard_multi_daemon_benchmark: signal %d: ending child processes\n",
               sig);
  Children& c = children();
  absl::MutexLock lock(&c.mu);
  for (pid_t pid : c.ranks) ::kill(pid, SIGKILL);
  for (pid_t pid : c.ranks) ::waitpid(pid, nullptr, 0);
  for (pid_t pgid : c.tool_groups) EndToolGroup(pgid, absl::Seconds(3));
  for (BenchDaemon* d : c.daemons) d->Stop();
  for (testing::EmulatedLinks* l : c.links) l->Teardown();
  if (!c.temp_dir.empty()) {
    std::error_code ec;
    fs::remove_all(c.temp_dir, ec);
  }
  _exit(128 + sig);
}

// A tool in its own process group, stdout and stderr to `log_path`; registered for cleanup.
absl::StatusOr<pid_t> SpawnTool(const std::vector<std::string>& argv_in,
                                const std::vector<std::string>& env_in,
                                const std::string& log_path) {
  const ExecVectors exec(argv_in, env_in);
  const pid_t parent = ::getpid();
  Children& c = children();
  absl::MutexLock lock(&c.mu);  // registered before the signal thread could miss it
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) ExecLoggedChild(parent, log_path.c_str(), exec, /*own_group=*/true);
  ::setpgid(pid, pid);  // also here: no window in which a kill(-pid) misses the child
  c.tool_groups.insert(pid);
  return pid;
}

// Waits for the tool until `deadline`; past it, ends its group. The wait status.
absl::StatusOr<int> WaitTool(pid_t pid, absl::Time deadline, absl::string_view what) {
  int status = 0;
  pid_t got = 0;
  while ((got = ::waitpid(pid, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  Children& c = children();
  absl::MutexLock lock(&c.mu);
  c.tool_groups.erase(pid);
  if (got == pid) {
    ::kill(-pid, SIGKILL);  // whatever it left in its group
    return status;
  }
  EndToolGroup(pid, absl::Seconds(3));
  return absl::DeadlineExceededError(absl::StrCat(what, " did not finish in time: killed"));
}

// Ends a tool early (error paths).
void KillTool(pid_t pid) {
  Children& c = children();
  absl::MutexLock lock(&c.mu);
  if (c.tool_groups.erase(pid) > 0) EndToolGroup(pid, absl::Seconds(3));
}

// Whether `name` is an executable file (a path) or one on $PATH.
bool FindInPath(const std::string& name) {
  if (name.find('/') != std::string::npos) return ::access(name.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  for (absl::string_view d : absl::StrSplit(path != nullptr ? path : "", ':', absl::SkipEmpty())) {
    if (::access(absl::StrCat(d, "/", name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

}  // namespace flatshard::bench::md
