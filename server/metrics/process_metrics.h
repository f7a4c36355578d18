#pragma once
// The standard process_* metrics of the Prometheus client libraries (their "process
// collector"), read from /proc/self at scrape time:
//   process_cpu_seconds_total          counter, user + system CPU time
//   process_resident_memory_bytes      gauge, resident set size
//   process_virtual_memory_bytes       gauge, virtual memory size
//   process_open_fds                   gauge, open file descriptors
//   process_max_fds                    gauge, the soft RLIMIT_NOFILE
//   process_start_time_seconds         gauge, start time since the Unix epoch
// Thread-safe: pure functions over the kernel's files.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::metrics {

struct ProcessStats {
  double cpu_seconds = 0;
  int64_t resident_bytes = 0;
  int64_t virtual_bytes = 0;
  int64_t open_fds = 0;
  int64_t max_fds = 0;  // 0: unlimited
  double start_time_seconds = 0;
};

// Parses the text of /proc/<pid>/stat and the `btime` line of /proc/stat (boot time, seconds
// since the epoch) into `stats`' CPU, memory and start-time fields. `ticks_per_second` and
// `page_size` are sysconf's _SC_CLK_TCK and _SC_PAGESIZE.
// Errors: INVALID_ARGUMENT naming the file and field that is missing or malformed.
absl::Status ParseProcStat(absl::string_view pid_stat, absl::string_view proc_stat,
                           int64_t ticks_per_second, int64_t page_size, ProcessStats* stats);

// This process's stats. Errors: as ParseProcStat, or NOT_FOUND naming an unreadable file
// (no /proc: then the scrape simply lacks process_* metrics).
absl::StatusOr<ProcessStats> ReadProcessStats();

// The Prometheus text (HELP, TYPE and one sample per metric) of `stats`.
std::string RenderProcessMetrics(const ProcessStats& stats);

}  // namespace flatshard::metrics
