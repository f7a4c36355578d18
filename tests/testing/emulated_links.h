#pragma once
// Emulated nodes joined by network links with real bandwidth and latency (issue 27), for tests
// and benchmarks. EmulatedLinks::Create makes N network namespaces ("nodes") and one hub
// namespace holding a bridge; every node has one veth interface, kInterface ("fsl0") with
// address 10.77.0.<i+1>/24, whose other end is a port of the bridge. Nothing is added to the
// namespace of the caller: only the nodes' addresses carry traffic. Shaping, per node:
//   - both directions of its link are limited to `rate` by tbf (the node's egress on fsl0, its
//     ingress on the bridge port's egress), so each node has a full-duplex link of that rate;
//   - its egress gets `delay` from netem (one-way latency node -> any peer), when the kernel
//     has sch_netem. Without it (e.g. this project's Firecracker guests: "Specified qdisc kind
//     is unknown") the links run without the delay, delay_note() says so, and Create fails
//     instead when LinkOptions::require_delay.
// Processes enter a node with setns(fd(i), CLONE_NEWNET) in a forked child before exec (an
// async-signal-safe system call), or through `ip netns exec ns(i)` from a shell.
//
// Teardown: the destructor deletes the namespaces (their veths and the bridge go with them).
// Names carry the creating pid ("fsl<pid>x<k>n<i>", "fsl<pid>x<k>h"); every Create first
// deletes the namespaces of owners that are no longer alive (a test or benchmark killed by
// SIGKILL), so nothing outlives the next run. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and
// iproute2's `ip` and `tc`; Create's error names what is missing, for GTEST_SKIP.

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace flatshard::testing {

struct LinkOptions {
  int nodes = 2;
  // tc rate of each direction of every node's link ("10gbit", "25gbit", "800mbit"); "": none.
  std::string rate = "10gbit";
  // One-way added latency ("50us"); "": none.
  std::string delay = "50us";
  // Fail when the delay cannot be applied (no sch_netem) instead of running without it.
  bool require_delay = false;
};

// Runs `argv` (PATH searched), stdout and stderr captured. OK when it exits 0; otherwise an
// error naming the command, its exit status and its output.
inline absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  std::vector<char*> args;
  std::vector<std::string> copy = argv;
  for (std::string& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::execvp(args[0], args.data());
    _exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return out;
  return absl::FailedPreconditionError(absl::StrCat("`", absl::StrJoin(argv, " "), "` failed (",
                                                    WIFEXITED(status)
                                                        ? absl::StrCat("exit ", WEXITSTATUS(status))
                                                        : absl::StrCat("signal ", WTERMSIG(status)),
                                                    "): ", absl::StripAsciiWhitespace(out)));
}

class EmulatedLinks {
 public:
  static constexpr char kInterface[] = "fsl0";

  static absl::StatusOr<std::unique_ptr<EmulatedLinks>> Create(const LinkOptions& options) {
    if (options.nodes < 1 || options.nodes > 200) {
      return absl::InvalidArgumentError(
          absl::StrCat("LinkOptions.nodes: ", options.nodes, ", want 1..200"));
    }
    if (::geteuid() != 0) {
      return absl::FailedPreconditionError(
          "emulated links need root (network namespaces, veth, tc); running as uid " +
          std::to_string(::geteuid()));
    }
    for (const char* tool : {"ip", "tc"}) {
      if (!RunCommand({tool, "-V"}).ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("emulated links need iproute2's `", tool, "` (apt-get install iproute2)"));
      }
    }
    CleanLeftovers();
    static std::atomic<int> counter{0};
    auto links = std::unique_ptr<EmulatedLinks>(
        new EmulatedLinks(options, absl::StrCat("fsl", ::getpid(), "x", counter.fetch_add(1))));
    if (absl::Status s = links->Build(); !s.ok()) return s;
    return links;
  }

  ~EmulatedLinks() { Teardown(); }
  EmulatedLinks(const EmulatedLinks&) = delete;
  EmulatedLinks& operator=(const EmulatedLinks&) = delete;

  int nodes() const { return options_.nodes; }
  const LinkOptions& options() const { return options_; }
  // The namespace of node i (for `ip netns exec`).
  std::string ns(int i) const { return absl::StrCat(prefix_, "n", i); }
  // Node i's address on its link.
  static std::string address(int i) { return absl::StrCat("10.77.0.", i + 1); }
  // An O_CLOEXEC descriptor of node i's namespace, for setns in a forked child.
  int fd(int i) const { return fds_.at(static_cast<size_t>(i)); }
  // Whether the delay is applied, and why not when it is not.
  bool delay_applied() const { return delay_applied_; }
  const std::string& delay_note() const { return delay_note_; }
  // The configured rate in bits per second (0: unshaped).
  double rate_bits_per_s() const { return rate_bps_; }
  // One line for logs and benchmark headers.
  std::string Describe() const {
    return absl::StrCat(
        options_.nodes, " emulated nodes (namespaces ", prefix_, "n*, ", kInterface,
        " on a bridge), rate ",
        options_.rate.empty() ? "unshaped" : options_.rate + " per direction", ", delay ",
        delay_applied_ ? options_.delay : (options_.delay.empty() ? "none" : delay_note_));
  }

  // Deletes this harness's namespaces; idempotent.
  void Teardown() {
    for (int fd : fds_) ::close(fd);
    fds_.clear();
    for (const std::string& n : created_) (void)RunCommand({"ip", "netns", "del", n});
    created_.clear();
  }

  // Deletes the namespaces "fsl<pid>x..." of every pid that is not alive; returns how many.
  static int CleanLeftovers() {
    int removed = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/var/run/netns", ec)) {
      const std::string name = e.path().filename().string();
      absl::string_view rest = name;
      if (!absl::ConsumePrefix(&rest, "fsl")) continue;
      const size_t x = rest.find('x');
      int pid = 0;
      if (x == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, x), &pid)) continue;
      if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
      if (RunCommand({"ip", "netns", "del", name}).ok()) ++removed;
    }
    return removed;
  }

 private:
  EmulatedLinks(LinkOptions options, std::string prefix)
      : options_(std::move(options)), prefix_(std::move(prefix)) {}

  absl::Status NetnsAdd(const std::string& name) {
    absl::StatusOr<std::string> out = RunCommand({"ip", "netns", "add", name});
    if (!out.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create network namespace ", name, ": ", out.status().message()));
    }
    created_.push_back(name);
    return absl::OkStatus();
  }
  static absl::Status In(const std::string& ns, std::vector<std::string> argv) {
    argv.insert(argv.begin(), {"ip", "netns", "exec", ns});
    return RunCommand(argv).status();
  }

  // tc qdiscs of one egress: netem (delay) above tbf (rate) when both.
  absl::Status Shape(const std::string& ns, const std::string& dev, bool with_delay) {
    std::string parent = "root";
    if (with_delay) {
      absl::Status s = In(ns, {"tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                               "delay", options_.delay, "limit", "100000"});
      if (!s.ok()) return s;
      parent = "parent 1:";
    }
    if (options_.rate.empty()) return absl::OkStatus();
    // A burst of 4 ms of line rate (at least 1 MiB): tbf must hold a 64 KiB GSO packet and
    // refill between timer ticks at 10-25 Gbit/s.
    const int64_t burst =
        std::max<int64_t>(int64_t{1} << 20, static_cast<int64_t>(rate_bps_ / 8 / 250));
    std::vector<std::string> argv = {"tc", "qdisc", "add", "dev", dev};
    if (with_delay) {
      argv.insert(argv.end(), {"parent", "1:", "handle", "2:"});
    } else {
      argv.push_back("root");
    }
    argv.insert(argv.end(),
                {"tbf", "rate", options_.rate, "burst", std::to_string(burst), "latency", "50ms"});
    return In(ns, argv);
  }

  absl::Status Build() {
    if (!options_.rate.empty() && !ParseRate(options_.rate, &rate_bps_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("LinkOptions.rate \"", options_.rate, "\": want e.g. 10gbit, 800mbit"));
    }
    const std::string hub = absl::StrCat(prefix_, "h");
    if (absl::Status s = NetnsAdd(hub); !s.ok()) return s;
    if (absl::Status s = In(hub, {"ip", "link", "add", "br0", "type", "bridge"}); !s.ok()) {
      return s;
    }
    if (absl::Status s = In(hub, {"ip", "link", "set", "br0", "up"}); !s.ok()) return s;
    // Whether this kernel has sch_netem: probe on the bridge (no traffic there).
    bool netem = false;
    if (!options_.delay.empty()) {
      absl::Status probe =
          In(hub, {"tc", "qdisc", "add", "dev", "br0", "root", "netem", "delay", options_.delay});
      netem = probe.ok();
      if (netem) {
        (void)In(hub, {"tc", "qdisc", "del", "dev", "br0", "root"});
      } else {
        delay_note_ =
            absl::StrCat("none (", options_.delay,
                         " asked, but tc netem is unavailable here: ", probe.message(), ")");
        if (options_.require_delay) return absl::FailedPreconditionError(delay_note_);
      }
    }
    delay_applied_ = netem;
    for (int i = 0; i < options_.nodes; ++i) {
      const std::string node = ns(i);
      const std::string port = absl::StrCat("v", i);
      if (absl::Status s = NetnsAdd(node); !s.ok()) return s;
      // Both ends made directly in their namespaces: no name ever appears in the caller's.
      if (absl::Status s = In(hub, {"ip", "link", "add", port, "type", "veth", "peer", "name",
                                    kInterface, "netns", node});
          !s.ok()) {
        return s;
      }
      for (const std::vector<std::string>& cmd : std::vector<std::vector<std::string>>{
               {"ip", "link", "set", port, "master", "br0"}, {"ip", "link", "set", port, "up"}}) {
        if (absl::Status s = In(hub, cmd); !s.ok()) return s;
      }
      for (const std::vector<std::string>& cmd : std::vector<std::vector<std::string>>{
               {"ip", "addr", "add", address(i) + "/24", "dev", kInterface},
               {"ip", "link", "set", kInterface, "up"},
               {"ip", "link", "set", "lo", "up"}}) {
        if (absl::Status s = In(node, cmd); !s.ok()) return s;
      }
      if (absl::Status s = Shape(node, kInterface, netem); !s.ok()) return s;
      if (absl::Status s = Shape(hub, port, false); !s.ok()) return s;
      const std::string path = "/var/run/netns/" + node;
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
      }
      fds_.push_back(fd);
    }
    return absl::OkStatus();
  }

  // "10gbit", "800mbit", "1.5gbit", "100kbit" -> bits per second.
  static bool ParseRate(absl::string_view rate, double* bps) {
    const std::string r = absl::AsciiStrToLower(rate);
    absl::string_view v = r;
    double scale = 0;
    if (absl::ConsumeSuffix(&v, "gbit")) {
      scale = 1e9;
    } else if (absl::ConsumeSuffix(&v, "mbit")) {
      scale = 1e6;
    } else if (absl::ConsumeSuffix(&v, "kbit")) {
      scale = 1e3;
    } else {
      return false;
    }
    double x = 0;
    if (!absl::SimpleAtod(v, &x) || x <= 0) return false;
    *bps = x * scale;
    return true;
  }

  LinkOptions options_;
  std::string prefix_;
  std::vector<std::string> created_;
  std::vector<int> fds_;
  double rate_bps_ = 0;
  bool delay_applied_ = false;
  std::string delay_note_;
};

}  // namespace flatshard::testing
