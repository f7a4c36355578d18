#include "common/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatshard {
namespace {
std::atomic<int> g_min_severity{static_cast<int>(LogSeverity::kInfo)};
std::atomic<int> g_verbosity{0};
constexpr char kSeverityLetters[] = "IWEF";
}  // namespace

void SetMinLogSeverity(LogSeverity severity) { g_min_severity = static_cast<int>(severity); }
LogSeverity MinLogSeverity() { return static_cast<LogSeverity>(g_min_severity.load()); }
void SetVerbosity(int level) { g_verbosity = level; }
int Verbosity() { return g_verbosity.load(); }

namespace internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity) : severity_(severity) {
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  stream_ << kSeverityLetters[static_cast<int>(severity)]
          << absl::FormatTime("%Y-%m-%dT%H:%M:%E6S ", absl::Now(), absl::LocalTimeZone())
          << static_cast<long>(::syscall(SYS_gettid)) << ' ' << base << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string line = stream_.str();
  // One write() keeps lines from different threads whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace internal
}  // namespace flatshard
