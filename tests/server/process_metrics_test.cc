// process_* metrics from /proc (server/metrics/process_metrics.h).

#include "server/metrics/process_metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::metrics {
namespace {

using ::testing::HasSubstr;

// proc(5): pid (comm) state ppid ... utime=14 stime=15 ... starttime=22 vsize=23 rss=24 ...
// The command name holds a space and a ')' as a process may name itself.
constexpr char kPidStat[] =
    "4242 (flat shardd) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 150 0 0 20 0 12 0 "
    "360000 1073741824 2048 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n";
constexpr char kProcStat[] = "cpu  1 2 3 4\nintr 5\nbtime 1700000000\nprocesses 9\n";

TEST(ProcessMetricsTest, ParsesCpuMemoryAndStartTime) {
  ProcessStats stats;
  ASSERT_TRUE(ParseProcStat(kPidStat, kProcStat, 100, 4096, &stats).ok());
  EXPECT_DOUBLE_EQ(stats.cpu_seconds, 4.0);  // (250 + 150) ticks at 100 Hz
  EXPECT_DOUBLE_EQ(stats.start_time_seconds, 1700000000.0 + 3600.0);
  EXPECT_EQ(stats.virtual_bytes, 1073741824);
  EXPECT_EQ(stats.resident_bytes, 2048 * 4096);
}

TEST(ProcessMetricsTest, MalformedFilesNameTheFileAndField) {
  ProcessStats stats;
  absl::Status s = ParseProcStat("4242 (x) S 1 2", kProcStat, 100, 4096, &stats);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("/proc/self/stat: field 14"));
  s = ParseProcStat("4242 x S 1 2", kProcStat, 100, 4096, &stats);
  EXPECT_THAT(s.message(), HasSubstr("no ')'"));
  s = ParseProcStat(kPidStat, "cpu 1 2 3\n", 100, 4096, &stats);
  EXPECT_THAT(s.message(), HasSubstr("/proc/stat: no valid btime"));
  s = ParseProcStat(kPidStat, "btime soon\n", 100, 4096, &stats);
  EXPECT_THAT(s.message(), HasSubstr("/proc/stat: no valid btime"));
}

TEST(ProcessMetricsTest, ReadsThisProcessAndCountsNewDescriptors) {
  absl::StatusOr<ProcessStats> before = ReadProcessStats();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_GT(before->resident_bytes, 0);
  EXPECT_GE(before->virtual_bytes, before->resident_bytes);
  EXPECT_GE(before->open_fds, 3);
  const int fd = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(fd, 0);
  absl::StatusOr<ProcessStats> after = ReadProcessStats();
  ::close(fd);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->open_fds, before->open_fds + 1);
  EXPECT_EQ(after->start_time_seconds, before->start_time_seconds);
}

TEST(ProcessMetricsTest, RendersThePrometheusClientNamesAndTypes) {
  ProcessStats stats;
  stats.cpu_seconds = 1.5;
  stats.resident_bytes = 10;
  stats.virtual_bytes = 20;
  stats.open_fds = 7;
  stats.max_fds = 1024;
  stats.start_time_seconds = 1700000000.25;
  const std::string text = RenderProcessMetrics(stats);
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"
                              "process_cpu_seconds_total 1.5\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_resident_memory_bytes gauge\n"
                              "process_resident_memory_bytes 10\n"));
  EXPECT_THAT(text, HasSubstr("process_virtual_memory_bytes 20\n"));
  EXPECT_THAT(text, HasSubstr("process_open_fds 7\n"));
  EXPECT_THAT(text, HasSubstr("process_max_fds 1024\n"));
  EXPECT_THAT(text, HasSubstr("process_start_time_seconds 1700000000.25\n"));
}

}  // namespace
}  // namespace flatshard::metrics
