#pragma once
// What the benchmarks over emulated nodes (tests/testing/emulated_links.h; --link_rate of
// multi_daemon_benchmark.cc and weights_pull_benchmark.cc) share: a daemon started in a node,
// a command run in a node with UCX on its link only, and Open MPI's launch over the links.
// Header-only; needs root (as EmulatedLinks).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/bench/bench_support.h"
#include "tests/testing/emulated_links.h"

namespace flatshard::bench {

// The environment of a UCX process on an emulated node: UCX on the node's link only and,
// unless `keep_tls` (the caller chose UCX_TLS), UCX_TLS=tcp: shared memory and CMA between
// the namespaces (one host) would bypass the link.
inline std::vector<std::string> UcxOnLinkEnv(bool keep_tls) {
  std::vector<std::string> env = {
      absl::StrCat("UCX_NET_DEVICES=", testing::EmulatedLinks::kInterface)};
  if (!keep_tls) env.push_back("UCX_TLS=tcp");
  return env;
}

// The command prefix that runs a program in node `index`, with `env` ("NAME=value") added.
inline std::vector<std::string> InNode(const testing::EmulatedLinks& links, int index,
                                       const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv = {"ip", "netns", "exec", links.ns(index)};
  if (!env.empty()) {
    argv.push_back("env");
    argv.insert(argv.end(), env.begin(), env.end());
  }
  return argv;
}

// Starts `d` (tag `tag`) in node `index` (`ip netns exec`, which also mounts the node's /sys,
// where UCX finds its devices), UCX as UcxOnLinkEnv(keep_tls) says, its PeerService on the
// node's address without TLS (the links join only this run's private namespaces) on a port
// it picks, read back from --peer_address_file. `flags` and `env` as BenchDaemon::Start's.
// Returns the daemon's peer address; on error `d` is stopped.
inline absl::StatusOr<std::string> StartDaemonOnNode(BenchDaemon& d, const std::string& binary,
                                                     const std::string& tag, int index,
                                                     std::vector<std::string> flags,
                                                     std::vector<std::string> env,
                                                     const testing::EmulatedLinks& links,
                                                     bool keep_tls) {
  const std::filesystem::path peer_file =
      std::filesystem::temp_directory_path() / tag / "peer_address";
  d.launcher = InNode(links, index);
  for (std::string& e : UcxOnLinkEnv(keep_tls)) env.push_back(std::move(e));
  flags.insert(flags.begin(),
               {"--peer_address=" + testing::EmulatedLinks::address(index) + ":0",
                "--peer_address_file=" + peer_file.string(), "--allow_insecure_tcp"});
  absl::Status st = d.Start(binary, tag, flags, env);
  std::string peer;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (st.ok() && peer.empty() && absl::Now() < until) {
    peer = std::string(absl::StripAsciiWhitespace(ReadText(peer_file)));
    if (peer.empty()) absl::SleepFor(absl::Milliseconds(10));
  }
  if (st.ok() && peer.empty()) st = absl::UnavailableError("no --peer_address_file written");
  if (!st.ok()) {
    d.Stop();
    return absl::Status(
        st.code(), absl::StrCat("daemon ", index, " (emulated node ", index, "): ", st.message()));
  }
  return peer;
}

// Plain TCP streams, as iperf measures a link: for each (from, to) of `pairs` at once, `bytes`
// of `src` over one TCP connection from a thread in node `from` to a thread in node `to`
// (setns changes the calling thread's namespace only), received into fresh memory (page
// faults included, as a fresh segment has them); without `links`, one stream over loopback.
// `window` > 0: `src` holds `window` bytes, sent again and again, and each receiver reuses a
// buffer of that size (as iperf: the link's rate, not memory's). The milliseconds until the
// last stream ended, or -1 when one failed.
inline double TcpStreamsMs(const testing::EmulatedLinks* links,
                           const std::vector<std::pair<int, int>>& pairs, const char* src,
                           int64_t bytes, int64_t window = 0) {
  if (window <= 0 || window > bytes) window = bytes;
  const size_t n = links != nullptr ? pairs.size() : 1;
  std::vector<sockaddr_in> addr(n);
  std::vector<std::promise<int>> listening(n);  // the port, or -1
  std::vector<int64_t> got(n, 0);
  std::vector<int> lfds(n, -1);  // set before `listening`
  std::vector<std::thread> threads;
  auto enter = [links](int node) {
    return links == nullptr || ::setns(links->fd(node), CLONE_NEWNET) == 0;
  };
  for (size_t i = 0; i < n; ++i) {
    addr[i].sin_family = AF_INET;
    addr[i].sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (links != nullptr) {
      ::inet_pton(AF_INET, testing::EmulatedLinks::address(pairs[i].second).c_str(),
                  &addr[i].sin_addr);
    }
    threads.emplace_back([&, i] {
      char* dst = static_cast<char*>(
          ::mmap(nullptr, window, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      const int lfd = dst == MAP_FAILED || !enter(links ? pairs[i].second : 0)
                          ? -1
                          : ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in bound = addr[i];
      socklen_t len = sizeof(bound);
      if (lfd < 0 || ::bind(lfd, reinterpret_cast<sockaddr*>(&bound), sizeof(bound)) != 0 ||
          ::getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &len) != 0 ||
          ::listen(lfd, 1) != 0) {
        if (lfd >= 0) ::close(lfd);
        if (dst != MAP_FAILED) ::munmap(dst, window);
        listening[i].set_value(-1);
        return;
      }
      lfds[i] = lfd;
      listening[i].set_value(ntohs(bound.sin_port));
      const int cfd = ::accept(lfd, nullptr, nullptr);
      while (cfd >= 0 && got[i] < bytes) {
        const int64_t at = got[i] % window;
        const ssize_t r =
            ::recv(cfd, dst + at, static_cast<size_t>(std::min(bytes - got[i], window - at)), 0);
        if (r <= 0) break;
        got[i] += r;
      }
      if (cfd >= 0) ::close(cfd);
      ::close(lfd);
      ::munmap(dst, window);
    });
  }
  std::vector<int> ports(n);
  for (size_t i = 0; i < n; ++i) ports[i] = listening[i].get_future().get();
  const Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    if (ports[i] <= 0) continue;
    addr[i].sin_port = htons(static_cast<uint16_t>(ports[i]));
    threads.emplace_back([&, i] {
      const int fd = enter(links ? pairs[i].first : 0) ? ::socket(AF_INET, SOCK_STREAM, 0) : -1;
      if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr[i]), sizeof(addr[i])) == 0) {
        for (int64_t off = 0; off < bytes;) {
          const int64_t at = off % window;
          const ssize_t w = ::send(
              fd, src + at, static_cast<size_t>(std::min(bytes - off, window - at)), MSG_NOSIGNAL);
          if (w <= 0) break;
          off += w;
        }
      } else {
        ::shutdown(lfds[i], SHUT_RDWR);  // never connected: the receiver's accept returns
      }
      if (fd >= 0) ::close(fd);
    });
  }
  for (std::thread& t : threads) t.join();
  const double ms = MicrosSince(t0, Clock::now()) / 1000;
  for (size_t i = 0; i < n; ++i) {
    if (got[i] != bytes) return -1;
  }
  return ms;
}

// The TMPDIR (where Open MPI puts its session directory) of node `index`'s MPI processes.
inline std::filesystem::path MpiNodeTmp(const std::filesystem::path& dir, int index) {
  return dir / absl::StrCat("ompi_node", index);
}

// Open MPI over the links: mpirun runs in node 0's namespace with a hostfile of the nodes'
// addresses (ranks_per_node slots each, filled in rank order as flatshard places its ranks),
// and reaches the other nodes through an rsh agent (written to `dir`) that runs their orted
// with `ip netns exec`; its out-of-band channel and the TCP BTL use the links only, ob1 over
// tcp (between nodes), vader (within a node) and self; every node's processes get a TMPDIR of
// their own under `dir` (MpiNodeTmp). The launch prefix (then -np etc.).
inline absl::StatusOr<std::vector<std::string>> MpiOverLinks(const std::string& mpirun, int rpn,
                                                             const testing::EmulatedLinks& links,
                                                             const std::filesystem::path& dir) {
  const std::filesystem::path hostfile = dir / "mpi_hosts";
  const std::filesystem::path agent = dir / "mpi_netns_agent.sh";
  std::string hosts, cases;
  for (int i = 0; i < links.nodes(); ++i) {
    absl::StrAppend(&hosts, testing::EmulatedLinks::address(i), " slots=", rpn, "\n");
    // vader names its segments by host name and local rank: the nodes share this host's
    // name and /dev/shm, so every node but 0 (whose ranks mpirun starts) gets a directory.
    const std::filesystem::path vader = dir / absl::StrCat("vader_node", i);
    if (i > 0) std::filesystem::create_directories(vader);
    // Each node's session directory under a TMPDIR of its own, as on separate hosts: orteds
    // of one host name sharing one tree race creating it ("File exists", exit 213).
    std::filesystem::create_directories(MpiNodeTmp(dir, i));
    absl::StrAppend(&cases, "  ", testing::EmulatedLinks::address(i), ") ns=", links.ns(i),
                    " tmp=", MpiNodeTmp(dir, i).string(),
                    i > 0 ? absl::StrCat(" vader=", vader.string()) : "", " ;;\n");
  }
  const std::string script = absl::StrCat(
      "#!/bin/sh\n# mpirun's rsh agent: runs the command for host $1 in its namespace\n",
      "host=\"$1\"; shift\ncase \"$host\" in\n", cases,
      "  *) echo \"no emulated node $host\" >&2; exit 1 ;;\nesac\n",
      "exec ip netns exec \"$ns\" env OMPI_MCA_btl_vader_backing_directory=\"$vader\" "
      "TMPDIR=\"$tmp\" /bin/sh -c \"$*\"\n");
  {
    std::ofstream h(hostfile), a(agent);
    h << hosts;
    a << script;
    if (!h || !a) return absl::InternalError(absl::StrCat("cannot write ", hostfile.string()));
  }
  std::filesystem::permissions(agent, std::filesystem::perms::owner_all);
  const std::string dev = testing::EmulatedLinks::kInterface;
  std::vector<std::string> launch = InNode(links, 0, {"TMPDIR=" + MpiNodeTmp(dir, 0).string()});
  launch.insert(launch.end(),
                {mpirun, "--hostfile", hostfile.string(), "--mca", "plm_rsh_agent", agent.string(),
                 "--mca", "oob_tcp_if_include", dev, "--mca", "pml", "ob1", "--mca", "btl",
                 "tcp,vader,self", "--mca", "btl_tcp_if_include", dev});
  return launch;
}

}  // namespace flatshard::bench
