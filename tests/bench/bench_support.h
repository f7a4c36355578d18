#pragma once
// Helpers shared by the benchmarks that run real flatshardd processes (daemon_benchmark.cc,
// multi_daemon_benchmark.cc, concurrent_groups_benchmark.cc, restart_benchmark.cc): a daemon
// process with private socket and segment prefix, the one-unit manifest they register,
// percentiles, list flags, a few /proc readers, the signal thread that stops the daemons, and
// the "# FIGURE" lines scripts/bench_ab.sh collects. Header-only; not a test fixture (no gtest).
//
// Thread safety: the free functions are thread-safe. BenchDaemon is thread-compatible, except
// that Stop() and ExitNote() may run concurrently with anything (a signal thread stops
// daemons while the main thread uses them).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

extern char** environ;

namespace flatshard::bench {

using Clock = std::chrono::steady_clock;

inline double MicrosSince(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

inline std::string ReadText(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string Tail(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(s.size() - n);
}

// Nearest-rank percentile, p in [0, 100].
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1;
  return v[i];
}
inline double Median(const std::vector<double>& v) { return Percentile(v, 50); }

// Parses a list flag of counts (--world_sizes, --daemons): each an integer in [min, max].
inline absl::StatusOr<std::vector<int>> ParseCounts(const std::string& flag,
                                                    const std::vector<std::string>& items, int min,
                                                    int max, const std::string& what) {
  std::vector<int> out;
  for (const std::string& item : items) {
    int n = 0;
    if (!absl::SimpleAtoi(item, &n) || n < min || n > max) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", item, "\" is not a ", what,
                                                     " in [", min, ", ", max, "]"));
    }
    out.push_back(n);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return out;
}

// Parses a list flag of byte sizes (--bytes 4096,64MiB): each a positive integer, optionally
// followed by K/KiB, M/MiB or G/GiB (powers of 1024), at least `min` and at most `max`.
inline absl::StatusOr<std::vector<int64_t>> ParseByteSizes(const std::string& flag,
                                                           const std::vector<std::string>& items,
                                                           int64_t min, int64_t max) {
  std::vector<int64_t> out;
  for (const std::string& item : items) {
    std::string digits(absl::StripAsciiWhitespace(item));
    int64_t scale = 1;
    for (const auto& [suffixes, factor] : std::vector<std::pair<std::vector<std::string>, int64_t>>{
             {{"KiB", "K", "k"}, int64_t{1} << 10},
             {{"MiB", "M", "m"}, int64_t{1} << 20},
             {{"GiB", "G", "g"}, int64_t{1} << 30}}) {
      for (const std::string& suffix : suffixes) {
        if (scale == 1 && absl::EndsWith(digits, suffix)) {
          digits.resize(digits.size() - suffix.size());
          scale = factor;
        }
      }
    }
    int64_t n = 0;
    if (!absl::SimpleAtoi(digits, &n) || n <= 0 || n > max / scale || n * scale < min) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", item,
                                                     "\" is not a size in [", min, ", ", max,
                                                     "] bytes (suffixes: KiB, MiB, GiB)"));
    }
    out.push_back(n * scale);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return out;
}

// Iterations for a unit of `bytes`: `iters` up to 1 MiB, else a tenth of it (at least
// `floor`): the large-unit rows of a benchmark take about as long as the small ones.
inline int ScaledIters(int iters, int64_t bytes, int floor) {
  return bytes <= (int64_t{1} << 20) ? iters : std::max(floor, iters / 10);
}

// CPU time (user + system) of process `pid` so far, in seconds; -1 if unknown.
inline double ProcessCpuSeconds(pid_t pid) {
  const std::string stat = ReadText(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');  // the command name may contain spaces
  if (paren == std::string::npos) return -1;
  std::istringstream in(stat.substr(paren + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  // Fields 3.. (state, ppid, ...): utime and stime are fields 14 and 15.
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  const long ticks = ::sysconf(_SC_CLK_TCK);
  return ticks > 0 ? static_cast<double>(utime + stime) / static_cast<double>(ticks) : -1;
}

// "4KiB", "64MiB", "1GiB"; "1000B" when not a whole number of KiB (figure names).
inline std::string SizeName(int64_t bytes) {
  if (bytes % (int64_t{1} << 30) == 0) return absl::StrCat(bytes >> 30, "GiB");
  if (bytes % (int64_t{1} << 20) == 0) return absl::StrCat(bytes >> 20, "MiB");
  if (bytes % (int64_t{1} << 10) == 0) return absl::StrCat(bytes >> 10, "KiB");
  return absl::StrCat(bytes, "B");
}

// A headline figure for scripts/bench_ab.sh, one line on stdout:
//   # FIGURE <name> <value> <unit> <lower|higher> [context]
// `name`: no spaces (e.g. "latency.lib.summon_end.p50"); lower|higher says which way is
// better; "context" marks a baseline that does not measure the daemon's own work (memcpy,
// Ping): how noisy the machine was, not a verdict on the daemon.
inline void PrintFigure(absl::string_view name, double value, absl::string_view unit,
                        bool lower_is_better = true, bool context = false) {
  std::printf("# FIGURE %s %.6g %s %s%s\n", std::string(name).c_str(), value,
              std::string(unit).c_str(), lower_is_better ? "lower" : "higher",
              context ? " context" : "");
}

// Mappings of /dev/shm/<prefix>.* in this process whose segment was unlinked: count and bytes
// (segments the client library still keeps mapped after the daemon dropped them).
inline std::pair<int64_t, int64_t> RetainedDeletedMappings(const std::string& prefix) {
  std::ifstream in("/proc/self/maps");
  std::string line;
  int64_t count = 0, bytes = 0;
  const std::string needle = "/dev/shm/" + prefix + ".";
  while (std::getline(in, line)) {
    if (line.find(needle) == std::string::npos || line.find("(deleted)") == std::string::npos) {
      continue;
    }
    uint64_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64, &lo, &hi) == 2) {
      ++count;
      bytes += static_cast<int64_t>(hi - lo);
    }
  }
  return {count, bytes};
}

inline std::string LoadAverage() {
  std::string s = ReadText("/proc/loadavg");
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

// MemAvailable from /proc/meminfo, in bytes (-1 if unknown).
inline int64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

inline std::vector<std::filesystem::path> SegmentsWithPrefix(const std::string& prefix) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    if (e.path().filename().string().rfind(prefix + ".", 0) == 0) out.push_back(e.path());
  }
  return out;
}

// One module (type Linear) with one float32 param "weight" of `numel` elements; with
// kPolicyJson the root is the only unit.
inline std::string ManifestJson(int64_t numel) {
  return absl::StrCat(R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Linear", )",
                      R"("bases": ["Module"], "params": [{"name": "weight", "id": 0, "shape": [)",
                      numel, R"(], "dtype": "float32", "requires_grad": true}], "children": []}})");
}
inline constexpr char kPolicyJson[] = "{}";

// Whether a connect() to `addr` succeeds now (a listening socket).
inline bool CanConnect(const sockaddr* addr, socklen_t len, int family) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = ::connect(fd, addr, len) == 0;
  ::close(fd);
  return ok;
}

inline bool UnixSocketAccepts(const std::string& path) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.data(), path.size());
  return CanConnect(reinterpret_cast<const sockaddr*>(&addr), sizeof(addr), AF_UNIX);
}

inline bool LoopbackPortAccepts(int port) {
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return CanConnect(reinterpret_cast<const sockaddr*>(&addr), sizeof(addr), AF_INET);
}

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released); the
// caller retries when someone else took it meanwhile. -1 on error.
inline int PickFreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

inline std::string DescribeWaitStatus(int status) {
  return WIFEXITED(status) ? absl::StrCat("exit code ", WEXITSTATUS(status))
                           : absl::StrCat("signal ", WTERMSIG(status));
}

// argv and envp (this process's environment plus `extra_env`) for exec, built before fork:
// a forked child may only call async-signal-safe functions. Not copyable (it points into
// itself).
class ExecVectors {
 public:
  ExecVectors(std::vector<std::string> args, std::vector<std::string> extra_env)
      : args_(std::move(args)), env_(std::move(extra_env)) {
    for (std::string& a : args_) argv_.push_back(a.data());
    argv_.push_back(nullptr);
    for (char** e = environ; *e != nullptr; ++e) envp_.push_back(*e);
    for (std::string& e : env_) envp_.push_back(e.data());
    envp_.push_back(nullptr);
  }
  ExecVectors(const ExecVectors&) = delete;
  ExecVectors& operator=(const ExecVectors&) = delete;
  char* const* argv() const { return argv_.data(); }
  char* const* envp() const { return envp_.data(); }

 private:
  std::vector<std::string> args_, env_;
  std::vector<char*> argv_, envp_;
};

// In a forked child: the default signal mask (the benchmarks block SIGINT and SIGTERM for a
// signal thread) and SIGPIPE, death with `parent`, stdout and stderr to `log_path`, its own
// process group when `own_group`; then exec (PATH searched). Async-signal-safe only.
[[noreturn]] inline void ExecLoggedChild(pid_t parent, const char* log_path,
                                         const ExecVectors& exec, bool own_group) {
  if (own_group) ::setpgid(0, 0);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::signal(SIGPIPE, SIG_DFL);  // an ignored SIGPIPE would survive exec
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) _exit(126);
  const int fd = ::open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
  }
  ::execvpe(exec.argv()[0], exec.argv(), exec.envp());
  _exit(127);
}

// flatshardd on a private socket (<tmp>/<tag>/flatshardd.sock) and segment prefix (<tag>); its
// stdout and stderr go to <tmp>/<tag>/flatshardd.log. The daemon gets SIGTERM if this process
// dies (even by SIGKILL). Start() returns once the socket accepts connections (and, with
// `wait_port` > 0, 127.0.0.1:<wait_port> too). Stop() (also the destructor) ends it and removes
// its segments and directory.
class BenchDaemon {
 public:
  // Whether `binary --helpfull` lists --ephemeral (asked once per binary).
  static bool KnowsEphemeral(const std::string& binary) {
    static absl::Mutex mu(absl::kConstInit);
    static auto* known = new std::map<std::string, bool>();
    absl::MutexLock lock(&mu);
    if (auto it = known->find(binary); it != known->end()) return it->second;
    std::string out;
    if (FILE* p = ::popen(absl::StrCat("'", binary, "' --helpfull 2>&1").c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
      ::pclose(p);
    }
    return (*known)[binary] = out.find("--ephemeral") != std::string::npos;
  }

  BenchDaemon() = default;
  BenchDaemon(const BenchDaemon&) = delete;
  BenchDaemon& operator=(const BenchDaemon&) = delete;
  ~BenchDaemon() { Stop(); }

  // `extra_flags` are appended to --socket, --segment_prefix and --default_wait=120s;
  // `extra_env` ("NAME=value") to this process's environment. The process must not have
  // started another daemon with this object (Stop() first).
  absl::Status Start(const std::string& binary, const std::string& tag,
                     const std::vector<std::string>& extra_flags = {},
                     const std::vector<std::string>& extra_env = {}, int wait_port = 0) {
    if (::access(binary.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("flatshardd binary ", binary,
                                              " is missing or not executable (build the "
                                              "flatshardd target, or pass --flatshardd)"));
    }
    dir_ = std::filesystem::temp_directory_path() / tag;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return absl::InternalError(absl::StrCat("mkdir ", dir_.string(), ": ", ec.message()));
    {
      absl::MutexLock lock(&stop_mu_);
      tag_ = tag;
    }
    socket_ = (dir_ / "flatshardd.sock").string();
    log_ = dir_ / "flatshardd.log";
    // Everything exec needs is built before fork: the child only calls async-signal-safe
    // functions.
    // The benchmarks time the daemon alone through raw RPCs that open no Lease stream, so the
    // lease bound (--lease_timeout, 10 s by default) must not end their sessions mid-run.
    // `launcher` first, e.g. {"ip", "netns", "exec", <ns>} for a daemon on an emulated node.
    std::vector<std::string> args = launcher;
    args.insert(args.end(), {binary, "--socket=" + socket_, "--segment_prefix=" + tag,
                             "--default_wait=120s", "--lease_timeout=3600s"});
    // Persistence is flatshardd's default and two daemons may not share a state directory:
    // without a --state_dir of its own a benchmark daemon keeps nothing (--ephemeral), when
    // the binary knows the flag (scripts/bench_ab.sh also runs builds from before it, which
    // keep nothing without --state_dir).
    bool state_flag = false;
    for (const std::string& f : extra_flags) {
      state_flag = state_flag || f.rfind("--state_dir", 0) == 0 || f.rfind("--ephemeral", 0) == 0;
    }
    if (!state_flag && KnowsEphemeral(binary)) args.push_back("--ephemeral");
    args.insert(args.end(), extra_flags.begin(), extra_flags.end());
    const ExecVectors exec(std::move(args), extra_env);
    const std::string log_path = log_.string();
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) ExecLoggedChild(parent, log_path.c_str(), exec, /*own_group=*/false);
    {
      absl::MutexLock lock(&stop_mu_);
      pid_ = pid;
    }
    const auto give_up = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < give_up) {
      if (const std::string note = ExitNote(); !note.empty()) {
        return absl::UnavailableError(
            absl::StrCat("flatshardd ", note, " at startup; its log:\n", LogTail()));
      }
      if (UnixSocketAccepts(socket_) && (wait_port <= 0 || LoopbackPortAccepts(wait_port))) {
        return absl::OkStatus();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return absl::UnavailableError(
        absl::StrCat("flatshardd did not come up on ", socket_,
                     wait_port > 0 ? absl::StrCat(" and 127.0.0.1:", wait_port) : "",
                     " within 30 s; its log:\n", LogTail()));
  }

  // Prepended to the daemon's command line by Start() (PATH searched): e.g. `ip netns exec`.
  std::vector<std::string> launcher;

  // Stop() also removes `path` (recursively), e.g. a --state_dir outside the socket directory.
  void RemoveOnStop(std::filesystem::path path) {
    absl::MutexLock lock(&stop_mu_);
    remove_on_stop_.push_back(std::move(path));
  }

  // SIGTERM (the daemon removes its socket and segments), SIGKILL after 20 s; then removes
  // whatever is left: /dev/shm/<tag>.*, the socket directory and the RemoveOnStop() paths.
  // Idempotent.
  void Stop() {
    absl::MutexLock lock(&stop_mu_);
    struct RemoveListed {
      std::vector<std::filesystem::path>* paths;
      ~RemoveListed() {
        std::error_code ec;
        for (const std::filesystem::path& p : *paths) std::filesystem::remove_all(p, ec);
        paths->clear();
      }
    } remove_listed{&remove_on_stop_};
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      bool exited = false;
      for (int i = 0; i < 2000 && !exited; ++i) {
        exited = ::waitpid(pid_, nullptr, WNOHANG) == pid_;
        if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!exited) {
        std::fprintf(stderr, "flatshardd %s did not stop within 20 s of SIGTERM: SIGKILL\n",
                     tag_.c_str());
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
      }
      pid_ = -1;
    }
    if (!tag_.empty()) {
      final_log_ = ReadText(log_);  // complete now: the daemon flushed its stdio at exit
      std::error_code ec;
      for (const std::filesystem::path& s : SegmentsWithPrefix(tag_)) {
        std::filesystem::remove(s, ec);
      }
      if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
      tag_.clear();
    }
  }

  // SIGKILL, as a crash: the segments, the socket and the directory stay (a restart with
  // Start() and the same tag finds them). Idempotent.
  void Kill() {
    absl::MutexLock lock(&stop_mu_);
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // The daemon's process id while it runs; -1 otherwise.
  pid_t pid() const {
    absl::MutexLock lock(&stop_mu_);
    return pid_;
  }
  std::string address() const { return "unix:" + socket_; }
  const std::string& socket() const { return socket_; }
  std::string tag() const {
    absl::MutexLock lock(&stop_mu_);
    return tag_;
  }
  // The log so far; after Stop(), the whole log as it was when the daemon ended.
  std::string Log() const {
    {
      absl::MutexLock lock(&stop_mu_);
      if (tag_.empty() && !final_log_.empty()) return final_log_;
    }
    return ReadText(log_);
  }
  std::string LogTail() const { return Tail(Log(), 4000); }

  // "" while the daemon runs (or was never started); how it ended if it exited on its own.
  std::string ExitNote() {
    absl::MutexLock lock(&stop_mu_);
    if (pid_ <= 0) return "";
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return "";
    pid_ = -1;
    return absl::StrCat("exited (", DescribeWaitStatus(status), ")");
  }

 private:
  mutable absl::Mutex stop_mu_;
  std::string tag_ ABSL_GUARDED_BY(stop_mu_);
  pid_t pid_ ABSL_GUARDED_BY(stop_mu_) = -1;
  std::string final_log_ ABSL_GUARDED_BY(stop_mu_);
  std::vector<std::filesystem::path> remove_on_stop_ ABSL_GUARDED_BY(stop_mu_);
  std::filesystem::path dir_;
  std::string socket_;
  std::filesystem::path log_;
};

// ---- Cleanup on SIGINT and SIGTERM -------------------------------------------------------------

// The daemons the signal thread (StartSignalThread) stops. Thread-safe.
class SignalStops {
 public:
  static SignalStops& Get() {
    static SignalStops* const stops = new SignalStops;  // never destroyed: the thread may run
    return *stops;
  }
  void Add(BenchDaemon* d) {
    absl::MutexLock lock(&mu_);
    daemons_.insert(d);
  }
  void Remove(BenchDaemon* d) {
    absl::MutexLock lock(&mu_);
    daemons_.erase(d);
  }
  // Stops every registered daemon; they stay registered (Stop() is idempotent).
  void StopAll() {
    absl::MutexLock lock(&mu_);
    for (BenchDaemon* d : daemons_) d->Stop();
  }
  std::atomic<bool> interrupted{false};

 private:
  absl::Mutex mu_;
  std::set<BenchDaemon*> daemons_ ABSL_GUARDED_BY(mu_);
};

// Registers a daemon with the signal thread for this object's lifetime (declare it after the
// daemon, so that it is forgotten before it is destroyed).
class ScopedStopOnSignal {
 public:
  explicit ScopedStopOnSignal(BenchDaemon* d) : d_(d) { SignalStops::Get().Add(d_); }
  ~ScopedStopOnSignal() { SignalStops::Get().Remove(d_); }
  ScopedStopOnSignal(const ScopedStopOnSignal&) = delete;
  ScopedStopOnSignal& operator=(const ScopedStopOnSignal&) = delete;

 private:
  BenchDaemon* d_;
};

// Blocks SIGINT and SIGTERM and starts a detached thread that waits for them, stops every
// registered daemon (removing its segments and directories) and exits 128 + signal. Call from
// main before any other thread starts, so that every thread inherits the mask. After Run()
// returns, main should `while (Interrupted()) pause();`: the errors an interruption caused are
// not worth reporting.
inline void StartSignalThread(const char* program) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals, program] {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) return;
    SignalStops::Get().interrupted = true;
    std::fprintf(stderr, "%s: signal %d: stopping flatshardd\n", program, sig);
    SignalStops::Get().StopAll();
    _exit(128 + sig);
  }).detach();
}
inline bool Interrupted() { return SignalStops::Get().interrupted.load(); }

}  // namespace flatshard::bench
