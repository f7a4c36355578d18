#include "server/metrics/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "server/metrics/registry.h"

namespace flatshard::metrics {
namespace {

// Fields of /proc/<pid>/stat (proc(5)), counted from 1 as the man page does.
constexpr int kUtime = 14;
constexpr int kStime = 15;
constexpr int kStartTime = 22;
constexpr int kVsize = 23;
constexpr int kRss = 24;

absl::StatusOr<int64_t> FieldAt(const std::vector<absl::string_view>& after_comm, int field) {
  // after_comm[0] is field 3 (state): the command name (field 2) may hold spaces and ')'.
  const size_t i = static_cast<size_t>(field - 3);
  int64_t v = 0;
  if (i >= after_comm.size() || !absl::SimpleAtoi(after_comm[i], &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("/proc/self/stat: field ", field, " is missing or not an integer"));
  }
  return v;
}

void Sample(std::string* out, absl::string_view name, absl::string_view type,
            absl::string_view help, double value) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ",
                  FormatValue(value), "\n");
}

}  // namespace

absl::Status ParseProcStat(absl::string_view pid_stat, absl::string_view proc_stat,
                           int64_t ticks_per_second, int64_t page_size, ProcessStats* stats) {
  const size_t close = pid_stat.rfind(')');
  if (close == absl::string_view::npos) {
    return absl::InvalidArgumentError("/proc/self/stat: no ')' after the command name");
  }
  const std::vector<absl::string_view> fields = absl::StrSplit(
      absl::StripAsciiWhitespace(pid_stat.substr(close + 1)), ' ', absl::SkipEmpty());
  int64_t utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
  for (auto [field, value] :
       {std::pair{kUtime, &utime}, std::pair{kStime, &stime}, std::pair{kStartTime, &start},
        std::pair{kVsize, &vsize}, std::pair{kRss, &rss}}) {
    absl::StatusOr<int64_t> v = FieldAt(fields, field);
    if (!v.ok()) return v.status();
    *value = *v;
  }
  int64_t btime = -1;
  for (absl::string_view line : absl::StrSplit(proc_stat, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ") &&
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &btime)) {
      btime = -1;
    }
  }
  if (btime < 0) return absl::InvalidArgumentError("/proc/stat: no valid btime line");
  if (ticks_per_second <= 0 || page_size <= 0) {
    return absl::InvalidArgumentError("sysconf: _SC_CLK_TCK or _SC_PAGESIZE is not positive");
  }
  const double tick = 1.0 / static_cast<double>(ticks_per_second);
  stats->cpu_seconds = static_cast<double>(utime + stime) * tick;
  stats->start_time_seconds = static_cast<double>(btime) + static_cast<double>(start) * tick;
  stats->virtual_bytes = vsize;
  stats->resident_bytes = rss * page_size;
  return absl::OkStatus();
}

absl::StatusOr<ProcessStats> ReadProcessStats() {
  ProcessStats stats;
  std::string pid_stat, proc_stat;
  for (auto [path, text] :
       {std::pair{"/proc/self/stat", &pid_stat}, std::pair{"/proc/stat", &proc_stat}}) {
    absl::StatusOr<std::string> read = ReadWholeFile(path);
    if (!read.ok()) return absl::NotFoundError(absl::StrCat(path, ": ", read.status().message()));
    *text = *std::move(read);
  }
  if (absl::Status s =
          ParseProcStat(pid_stat, proc_stat, sysconf(_SC_CLK_TCK), sysconf(_SC_PAGESIZE), &stats);
      !s.ok()) {
    return s;
  }
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (const dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++stats.open_fds;
    }
    closedir(dir);
    --stats.open_fds;  // the directory stream's own descriptor
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    stats.max_fds = static_cast<int64_t>(limit.rlim_cur);
  }
  return stats;
}

std::string RenderProcessMetrics(const ProcessStats& stats) {
  std::string out;
  Sample(&out, "process_cpu_seconds_total", "counter",
         "Total user and system CPU time spent in seconds.", stats.cpu_seconds);
  Sample(&out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
         static_cast<double>(stats.resident_bytes));
  Sample(&out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
         static_cast<double>(stats.virtual_bytes));
  Sample(&out, "process_open_fds", "gauge", "Number of open file descriptors.",
         static_cast<double>(stats.open_fds));
  Sample(&out, "process_max_fds", "gauge", "Maximum number of open file descriptors.",
         static_cast<double>(stats.max_fds));
  Sample(&out, "process_start_time_seconds", "gauge",
         "Start time of the process since unix epoch in seconds.", stats.start_time_seconds);
  return out;
}

}  // namespace flatshard::metrics
