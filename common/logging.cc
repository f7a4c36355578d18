#include "common/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatshard {
namespace {
std::atomic<int> g_min_severity{static_cast<int>(LogSeverity::kInfo)};
std::atomic<int> g_verbosity{0};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
constexpr char kSeverityLetters[] = "IWEF";

// The id fields lifted into their own JSON keys.
constexpr absl::string_view kIdKeys[] = {"group", "rank", "unit", "op_seq", "session", "module"};

// Newlines and other control characters escaped, so a record stays one line.
void AppendOneLine(absl::string_view s, std::string* out) {
  for (char c : s) {
    if (c == '\n') {
      *out += "\\n";
    } else if (c == '\r') {
      *out += "\\r";
    } else {
      *out += c;
    }
  }
}

void AppendJsonString(absl::string_view s, std::string* out) {
  *out += '"';
  for (char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
          *out += buf;
        } else {
          *out += c;
        }
    }
  }
  *out += '"';
}

}  // namespace

void SetMinLogSeverity(LogSeverity severity) { g_min_severity = static_cast<int>(severity); }
LogSeverity MinLogSeverity() { return static_cast<LogSeverity>(g_min_severity.load()); }
void SetVerbosity(int level) { g_verbosity = level; }
int Verbosity() { return g_verbosity.load(); }

absl::string_view LogSeverityName(LogSeverity severity) {
  switch (severity) {
    case LogSeverity::kInfo:
      return "INFO";
    case LogSeverity::kWarning:
      return "WARNING";
    case LogSeverity::kError:
      return "ERROR";
    case LogSeverity::kFatal:
      return "FATAL";
  }
  return "UNKNOWN";
}

absl::StatusOr<LogSeverity> ParseLogSeverity(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "info") return LogSeverity::kInfo;
  if (n == "warning" || n == "warn") return LogSeverity::kWarning;
  if (n == "error") return LogSeverity::kError;
  if (n == "fatal") return LogSeverity::kFatal;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown log level '", name, "' (want info, warning, error or fatal)"));
}

absl::Status SetLogLevel(absl::string_view level) {
  absl::StatusOr<LogSeverity> severity = ParseLogSeverity(level);
  if (!severity.ok()) return severity.status();
  SetMinLogSeverity(*severity);
  return absl::OkStatus();
}

void SetLogFormat(LogFormat format) { g_format = static_cast<int>(format); }
LogFormat GetLogFormat() { return static_cast<LogFormat>(g_format.load()); }

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "text") return LogFormat::kText;
  if (n == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown log format '", name, "' (want text or json)"));
}

std::string FormatLogRecord(LogFormat format, LogSeverity severity, absl::string_view file,
                            int line, long tid, absl::string_view time, absl::string_view message) {
  std::string out;
  out.reserve(message.size() + 96);
  if (format == LogFormat::kText) {
    absl::StrAppend(&out, absl::string_view(&kSeverityLetters[static_cast<int>(severity)], 1), time,
                    " ", tid, " ", file, ":", line, "] ");
    AppendOneLine(message, &out);
    out += '\n';
    return out;
  }
  out += "{\"ts\":";
  AppendJsonString(time, &out);
  out += ",\"level\":";
  AppendJsonString(LogSeverityName(severity), &out);
  absl::StrAppend(&out, ",\"tid\":", tid, ",\"src\":");
  AppendJsonString(absl::StrCat(file, ":", line), &out);
  out += ",\"msg\":";
  AppendJsonString(message, &out);
  // Lift `key=value` tokens of the id keys (first occurrence of each) into their own fields.
  bool seen[std::size(kIdKeys)] = {};
  size_t pos = 0;
  while (pos < message.size()) {
    size_t end = message.find_first_of(" \t\n", pos);
    if (end == absl::string_view::npos) end = message.size();
    absl::string_view token = message.substr(pos, end - pos);
    pos = end + 1;
    const size_t eq = token.find('=');
    if (eq == absl::string_view::npos || eq == 0) continue;
    const absl::string_view key = token.substr(0, eq);
    absl::string_view value = token.substr(eq + 1);
    while (!value.empty() && (value.back() == ',' || value.back() == ';' || value.back() == ':' ||
                              value.back() == ')' || value.back() == '.')) {
      value.remove_suffix(1);
    }
    for (size_t i = 0; i < std::size(kIdKeys); ++i) {
      if (key == kIdKeys[i] && !seen[i] && !value.empty()) {
        seen[i] = true;
        out += ',';
        AppendJsonString(key, &out);
        out += ':';
        AppendJsonString(value, &out);
      }
    }
  }
  out += "}\n";
  return out;
}

namespace internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity)
    : file_(file), line_(line), severity_(severity) {}

LogMessage::~LogMessage() {
  const char* base = std::strrchr(file_, '/');
  base = base ? base + 1 : file_;
  const std::string time =
      absl::FormatTime("%Y-%m-%dT%H:%M:%E6S", absl::Now(), absl::LocalTimeZone());
  const std::string line =
      FormatLogRecord(GetLogFormat(), severity_, base, line_,
                      static_cast<long>(::syscall(SYS_gettid)), time, stream_.str());
  // One write() keeps lines from different threads whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace internal
}  // namespace flatshard
