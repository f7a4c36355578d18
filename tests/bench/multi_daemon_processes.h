#pragma once
// The child processes of flatshard_multi_daemon_benchmark (multi_daemon_benchmark.cc): the
// registry its signal thread ends on SIGINT/SIGTERM, and tools (mpirun, ucx_perftest,
// ompi_info) run in process groups of their own.

#include <sys/types.h>

#include <atomic>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <signal.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tests/bench/bench_support.h"
#include "tests/testing/emulated_links.h"

namespace flatshard::bench::md {

// Every process this benchmark started, for the signal thread. Daemons are stopped through
// their BenchDaemon; ranks get SIGKILL; tools (mpirun, ucx_perftest) run in their own process
// groups and get SIGTERM, then SIGKILL.
struct Children {
  absl::Mutex mu;
  std::set<BenchDaemon*> daemons ABSL_GUARDED_BY(mu);
  std::set<pid_t> ranks ABSL_GUARDED_BY(mu);
  std::set<pid_t> tool_groups ABSL_GUARDED_BY(mu);
  std::filesystem::path temp_dir ABSL_GUARDED_BY(mu);           // tool logs; removed at exit
  std::set<testing::EmulatedLinks*> links ABSL_GUARDED_BY(mu);  // torn down last
};
Children& children();
extern std::atomic<bool> g_interrupted;

// Sends SIGTERM to the process group `pgid`, SIGKILL after `grace`, and reaps its leader.
void EndToolGroup(pid_t pgid, absl::Duration grace);

// SIGINT and SIGTERM are blocked in every thread; this one waits for them, ends every child,
// removes the daemons' segments and directories, and exits 128 + signal.
void SignalThread(sigset_t signals);

// A tool in its own process group, stdout and stderr to `log_path`; registered for cleanup.
absl::StatusOr<pid_t> SpawnTool(const std::vector<std::string>& argv_in,
                                const std::vector<std::string>& env_in,
                                const std::string& log_path);

// Waits for the tool until `deadline`; past it, ends its group. The wait status.
absl::StatusOr<int> WaitTool(pid_t pid, absl::Time deadline, absl::string_view what);

// Ends a tool early (error paths).
void KillTool(pid_t pid);

// Whether `name` is an executable file (a path) or one on $PATH.
bool FindInPath(const std::string& name);

}  // namespace flatshard::bench::md
