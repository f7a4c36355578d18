#pragma once
// Minimal logging: one line per message on stderr with time, severity, file:line and thread
// (text), or one JSON object per line (SetLogFormat). Messages carry their ids as key=value
// fields (`group=g rank=1 unit=3 op_seq=7`, STYLE.md §4).
// FS_LOG(INFO|WARNING|ERROR|FATAL) << ...; FS_VLOG(n) << ...; FS_CHECK(cond) << ... for
// programmer invariants only (aborts). Thread-safe: each message is written with one write().

#include <atomic>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Messages below this severity are dropped. Default kInfo. Thread-safe, at any time.
void SetMinLogSeverity(LogSeverity severity);
LogSeverity MinLogSeverity();
// FS_VLOG(n) prints when n <= the verbosity. Default 0. Thread-safe, at any time.
void SetVerbosity(int level);
int Verbosity();

// "INFO", "WARNING", "ERROR", "FATAL".
absl::string_view LogSeverityName(LogSeverity severity);
// Parses a level name, case-insensitive: "info", "warning" (or "warn"), "error", "fatal".
// INVALID_ARGUMENT otherwise.
absl::StatusOr<LogSeverity> ParseLogSeverity(absl::string_view name);
// Run-time level change (flatshardd --log_level, the admin SetLogLevel RPC): `level` as for
// ParseLogSeverity; on success sets the minimum severity. INVALID_ARGUMENT (and no change)
// for an unknown name. Thread-safe.
absl::Status SetLogLevel(absl::string_view level);

// Line format. kText: `I2024-05-01T12:00:00.123456 4711 daemon.cc:42] message`.
// kJson: one JSON object per line with "ts", "level", "tid", "src", "msg", and the message's
// id fields (group=, rank=, unit=, op_seq=, session=, module=) lifted into their own keys.
// Either way a message's newlines are escaped, so every record is exactly one line.
enum class LogFormat { kText = 0, kJson = 1 };
void SetLogFormat(LogFormat format);
LogFormat GetLogFormat();
// "text" or "json"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);

// The record as written (with its trailing newline), for tests. `tid` and `time` as given.
std::string FormatLogRecord(LogFormat format, LogSeverity severity, absl::string_view file,
                            int line, long tid, absl::string_view time, absl::string_view message);

namespace internal {

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  ~LogMessage();  // writes the line; aborts for kFatal
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  const char* file_;
  int line_;
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & stream` compile.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace flatshard

#define FS_LOG_SEVERITY_INFO ::flatshard::LogSeverity::kInfo
#define FS_LOG_SEVERITY_WARNING ::flatshard::LogSeverity::kWarning
#define FS_LOG_SEVERITY_ERROR ::flatshard::LogSeverity::kError
#define FS_LOG_SEVERITY_FATAL ::flatshard::LogSeverity::kFatal

#define FS_LOG(sev)                                       \
  (FS_LOG_SEVERITY_##sev < ::flatshard::MinLogSeverity()) \
      ? (void)0                                           \
      : ::flatshard::internal::LogVoidify() &             \
            ::flatshard::internal::LogMessage(__FILE__, __LINE__, FS_LOG_SEVERITY_##sev).stream()

#define FS_VLOG(n)                                                                                 \
  ((n) > ::flatshard::Verbosity())                                                                 \
      ? (void)0                                                                                    \
      : ::flatshard::internal::LogVoidify() &                                                      \
            ::flatshard::internal::LogMessage(__FILE__, __LINE__, ::flatshard::LogSeverity::kInfo) \
                .stream()

#define FS_CHECK(cond)                                                             \
  (cond) ? (void)0                                                                 \
         : ::flatshard::internal::LogVoidify() &                                   \
               ::flatshard::internal::LogMessage(__FILE__, __LINE__,               \
                                                 ::flatshard::LogSeverity::kFatal) \
                       .stream()                                                   \
                   << "Check failed: " #cond " "
