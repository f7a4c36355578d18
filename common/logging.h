#pragma once
// Minimal logging: one line per message on stderr with time, severity, file:line and thread.
// FS_LOG(INFO|WARNING|ERROR|FATAL) << ...; FS_VLOG(n) << ...; FS_CHECK(cond) << ... for
// programmer invariants only (aborts). Thread-safe: each message is written with one write().

#include <atomic>
#include <sstream>
#include <string>

namespace flatshard {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Messages below this severity are dropped. Default kInfo.
void SetMinLogSeverity(LogSeverity severity);
LogSeverity MinLogSeverity();
// FS_VLOG(n) prints when n <= the verbosity. Default 0.
void SetVerbosity(int level);
int Verbosity();

namespace internal {

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  ~LogMessage();  // writes the line; aborts for kFatal
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
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

#define FS_LOG(sev)                                                                  \
  (FS_LOG_SEVERITY_##sev < ::flatshard::MinLogSeverity())                            \
      ? (void)0                                                                      \
      : ::flatshard::internal::LogVoidify() &                                        \
            ::flatshard::internal::LogMessage(__FILE__, __LINE__, FS_LOG_SEVERITY_##sev) \
                .stream()

#define FS_VLOG(n)                                                                   \
  ((n) > ::flatshard::Verbosity())                                                   \
      ? (void)0                                                                      \
      : ::flatshard::internal::LogVoidify() &                                        \
            ::flatshard::internal::LogMessage(__FILE__, __LINE__,                    \
                                              ::flatshard::LogSeverity::kInfo)       \
                .stream()

#define FS_CHECK(cond)                                                               \
  (cond) ? (void)0                                                                   \
         : ::flatshard::internal::LogVoidify() &                                     \
               ::flatshard::internal::LogMessage(__FILE__, __LINE__,                 \
                                                 ::flatshard::LogSeverity::kFatal)   \
                       .stream()                                                     \
                   << "Check failed: " #cond " "
