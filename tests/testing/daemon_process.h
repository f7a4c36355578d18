#pragma once
// A real flatshardd process for integration tests: a private socket in a fresh temp directory
// and a private segment prefix, so tests may run in parallel. Optionally a PeerService on a
// free loopback port (multi-daemon groups; the address is read back from --peer_address_file)
// and a node name. Killed (SIGKILL) at the end unless Terminate() stopped it; leftover
// segments and the directory are removed on every path. The daemon's stderr goes to a log
// file in the directory; its tail is printed when the test has failed.
//
// FS_TEST_FLATSHARDD, when set, names the program to run instead of the built flatshardd
// (e.g. a script that runs it under gdb or valgrind); it gets the same arguments.
//
// Start, Kill and Restart daemons from the test's main thread: the daemon dies with the
// thread that started it (PR_SET_PDEATHSIG), so that a test binary killed by a timeout
// leaves no daemons behind.
// Thread-compatible. Uses FS_BINARY_DIR (set by fs_cc_test).

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/testing/metrics_scrape.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::testing {

struct DaemonOptions {
  // Prefix of the temp directory and the segment prefix (made unique per process and daemon).
  std::string tag_prefix = "fstest";
  // --peer_address=127.0.0.1:0 and --peer_address_file: the daemon may join multi-daemon
  // groups; peer_address() is the address it got.
  bool peer = false;
  // --node_name (empty: the flag is not passed).
  std::string node_name;
  // --default_wait.
  std::string default_wait = "10s";
  // Appended to the command line, e.g. "--peer_timeout=2s". Without a --state_dir there,
  // --ephemeral is passed (persistence is on by default and two daemons may not share a
  // state directory), unless `default_state_dir`.
  std::vector<std::string> extra_flags;
  // Neither --state_dir nor --ephemeral: the daemon picks its default state directory.
  bool default_state_dir = false;
  // An emulated node (tests/testing/emulated_links.h): the daemon runs in this network
  // namespace ("": this process's) and its PeerService binds `peer_host`. Started through
  // `ip netns exec`, which also mounts the namespace's /sys (UCX finds its devices there).
  std::string netns;
  std::string peer_host = "127.0.0.1";
  // "NAME=value" entries added to the daemon's environment (e.g. UCX_NET_DEVICES).
  std::vector<std::string> env;
  // --metrics_address=127.0.0.1:0 and its address file: Metrics() scrapes it.
  bool metrics = false;
};

class DaemonProcess {
 public:
  explicit DaemonProcess(const std::string& tag_prefix = "fstest")
      : DaemonProcess([&] {
          DaemonOptions o;
          o.tag_prefix = tag_prefix;
          return o;
        }()) {}
  explicit DaemonProcess(DaemonOptions options) : options_(std::move(options)) {
    static int counter = 0;
    tag_ = absl::StrCat(options_.tag_prefix, getpid(), "x", counter++);
    dir_ = std::filesystem::temp_directory_path() / tag_;
    std::filesystem::create_directories(dir_);
    socket_ = (dir_ / "flatshardd.sock").string();
    peer_file_ = (dir_ / "peer_address").string();
    log_ = (dir_ / "flatshardd.log").string();
    Start();
  }
  ~DaemonProcess() {
    if (::testing::Test::HasFailure()) PrintLogTail();
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    RemoveSegments();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Sends SIGTERM and returns the exit status (128 + signal if killed; -1 after 20 s).
  int Terminate() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 2000; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  // SIGKILL, as a crash: the socket, the peer address file and the segments stay behind.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // Starts the daemon again (after Kill or Terminate) with the same flags, socket, segment
  // prefix and node name; the peer port is a new one. Returns whether it came up.
  bool Restart() {
    if (pid_ > 0) Kill();
    return Start();
  }
  // Restart with `more_flags` appended to its flags from now on (a daemon restarted with
  // other settings).
  bool Restart(const std::vector<std::string>& more_flags) {
    options_.extra_flags.insert(options_.extra_flags.end(), more_flags.begin(), more_flags.end());
    return Restart();
  }
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // The daemon's segments still in /dev/shm.
  std::vector<std::string> Segments() const {
    std::vector<std::string> out;
    for (const std::string& name : ListSegments(tag_)) out.push_back("/dev/shm/" + name);
    return out;
  }
  std::string address() const { return "unix:" + socket_; }
  const std::string& socket() const { return socket_; }
  const std::string& tag() const { return tag_; }
  // host:port of the PeerService ("" without DaemonOptions::peer).
  const std::string& peer_address() const { return peer_address_; }
  const std::string& node_name() const { return options_.node_name; }
  // Samples of GET /metrics (DaemonOptions::metrics; empty without), by name with labels.
  std::map<std::string, double> Metrics() const {
    std::string host_port;
    std::getline(std::ifstream(dir_ / "metrics_address"), host_port);
    return ParseMetrics(ScrapeMetrics(host_port));
  }
  // Everything the daemon wrote to stderr so far (all its runs).
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // The last `lines` lines of Log(), to stderr, under a header naming the daemon.
  void PrintLogTail(size_t lines = 40) const {
    std::vector<std::string> all = absl::StrSplit(Log(), '\n', absl::SkipEmpty());
    const size_t from = all.size() > lines ? all.size() - lines : 0;
    std::vector<std::string> tail(all.begin() + static_cast<std::ptrdiff_t>(from), all.end());
    std::fprintf(stderr, "---- flatshardd %s%s stderr (last %zu lines) ----\n%s\n----\n",
                 tag_.c_str(),
                 options_.node_name.empty() ? "" : (" node " + options_.node_name).c_str(),
                 tail.size(), absl::StrJoin(tail, "\n").c_str());
  }

 private:
  // Forks and execs flatshardd; waits until it listens (its socket, and its peer address file
  // when it has one). Everything the child needs is built before fork(): the child only
  // calls async-signal-safe functions.
  bool Start() {
    std::error_code ignored;
    std::filesystem::remove(socket_, ignored);
    std::filesystem::remove(peer_file_, ignored);
    peer_address_.clear();
    const char* override_bin = getenv("FS_TEST_FLATSHARDD");
    const std::string bin = override_bin != nullptr && *override_bin != '\0'
                                ? std::string(override_bin)
                                : std::string(FS_BINARY_DIR) + "/server/flatshardd";
    std::vector<std::string> args;
    if (!options_.netns.empty()) args = {IpBinary(), "netns", "exec", options_.netns};
    args.insert(args.end(), {bin, "--socket=" + socket_, "--segment_prefix=" + tag_,
                             "--default_wait=" + options_.default_wait});
    if (options_.peer) {
      args.push_back("--peer_address=" + options_.peer_host + ":0");
      args.push_back("--peer_address_file=" + peer_file_);
    }
    if (!options_.node_name.empty()) args.push_back("--node_name=" + options_.node_name);
    if (options_.metrics) {
      args.push_back("--metrics_address=127.0.0.1:0");
      args.push_back("--metrics_address_file=" + (dir_ / "metrics_address").string());
    }
    bool state_flag = options_.default_state_dir;
    for (const std::string& f : options_.extra_flags) {
      state_flag = state_flag || f.rfind("--state_dir", 0) == 0 || f.rfind("--ephemeral", 0) == 0;
    }
    if (!state_flag) args.push_back("--ephemeral");
    for (const std::string& f : options_.extra_flags) args.push_back(f);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings = options_.env;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());  // first of a name wins
    envp.push_back(nullptr);
    const int log_fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);
      if (log_fd >= 0) dup2(log_fd, STDERR_FILENO);  // dup2 clears FD_CLOEXEC on the copy
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    if (log_fd >= 0) close(log_fd);
    const std::string& ready = options_.peer ? peer_file_ : socket_;
    for (int i = 0; i < 2000 && !std::filesystem::exists(ready); ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        ADD_FAILURE() << "flatshardd " << tag_ << " exited at startup (status " << status << "):\n"
                      << Log();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!std::filesystem::exists(ready)) {
      ADD_FAILURE() << "flatshardd did not come up on " << ready;
      return false;
    }
    if (options_.peer) {
      std::ifstream in(peer_file_);
      std::getline(in, peer_address_);
      EXPECT_FALSE(peer_address_.empty()) << "empty " << peer_file_;
    }
    return true;
  }

  // iproute2's ip (exec needs a path; the child must not search).
  static std::string IpBinary() {
    for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
      if (access(p, X_OK) == 0) return p;
    }
    return "/usr/sbin/ip";
  }

  void RemoveSegments() {
    std::error_code ignored;
    for (const std::string& s : Segments()) std::filesystem::remove(s, ignored);
  }

  DaemonOptions options_;
  std::string tag_;
  std::filesystem::path dir_;
  std::string socket_;
  std::string peer_file_;
  std::string log_;
  std::string peer_address_;
  pid_t pid_ = -1;
};

}  // namespace flatshard::testing
