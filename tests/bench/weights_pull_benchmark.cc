// A cross-daemon copy of published weights (README "Published weights across daemons"),
// same-run ratios over the same link (two processes on this host), for each of --bytes:
//   - pull ucx / pull grpc: a reader's first WeightsReader::Open of a new version on a daemon
//     with --weights_sources (--weights_transport=ucx: UCX gets of the source's registered
//     segment; =grpc: the bytes in the FetchVersion stream), which copies the version from the
//     source daemon (the descriptor round trips, the bytes into a fresh sealed segment, the
//     open);
//   - ucx p2p: ucx_perftest's ucp_get of the same bytes between 2 processes (UCX_TLS as the
//     daemons', ^cma unless the environment sets it; registered, touched buffers);
//   - tcp: the same bytes over one plain TCP connection between two threads, into fresh
//     memory (page faults included, as the pull's fresh segment has them);
//   - mpi: MPI_Bcast of the same bytes between 2 processes (mpirun; over TCP by default,
//     --mpi_args chooses; touched buffers).
//
//   build/tests/bench/flatshard_weights_pull_benchmark [--bytes 67108864,1073741824]
//       [--repeats 3] [--link_rate 10gbit [--link_delay 50us]]
//
// --link_rate: over emulated nodes (tests/testing/emulated_links.h, as
// flatshard_multi_daemon_benchmark's): the source daemon in node 0, the reader daemons in node
// 1, UCX on the node's link only (UCX_TLS=tcp unless the environment sets it); ucx_perftest's
// server in node 1 and client in node 0; the TCP threads each in its node; MPI_Bcast's two
// ranks one per node (mpirun in node 0, `ip netns exec` as its rsh agent, ob1 over tcp); and a
// "line time" row: the bytes over one link at the rate. Needs root and iproute2.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"
#include "tests/bench/emulated_nodes.h"
#include "tests/testing/emulated_links.h"

ABSL_FLAG(std::vector<std::string>, bytes, std::vector<std::string>({"67108864", "1073741824"}),
          "bytes of the published models (float32 x 4), one module and name each");
ABSL_FLAG(int, repeats, 3, "pulls, TCP copies and MPI_Bcasts measured (medians reported)");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");
ABSL_FLAG(std::string, mpirun, FS_MPIEXEC, "mpirun (empty: no MPI row)");
ABSL_FLAG(std::string, mpi_args, "--mca pml ob1 --mca btl tcp,self",
          "mpirun arguments choosing MPI's transport (default: TCP, the pull's link; empty: "
          "Open MPI's own choice, shared memory on one host)");
ABSL_FLAG(std::string, ucx_perftest, "ucx_perftest",
          "ucx_perftest for the UCX point-to-point row (empty: no row)");
ABSL_FLAG(std::string, mpi_baseline, FS_MPI_BCAST_BASELINE,
          "the flatshard_mpi_bcast_baseline binary (empty: not built)");
ABSL_FLAG(std::string, link_rate, "",
          "two emulated nodes (README \"Multi-node links\"): the source daemon in one, the "
          "reader daemons in the other, joined by veth links shaped to this rate per direction "
          "(tc tbf: 10gbit, 1gbit); the baselines over the same links (--mpi_args unused); "
          "empty: one host's loopback. Needs root and iproute2");
ABSL_FLAG(std::string, link_delay, "",
          "one-way latency of the emulated links (tc netem; where the kernel has no sch_netem "
          "the links run without it and the header says so); empty: none");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;
using client::WeightsReader;
using client::WeightsVersion;

// The emulated nodes of --link_rate (null: loopback).
const testing::EmulatedLinks* g_links = nullptr;

// `bytes` over one plain TCP connection between two threads into fresh memory: on loopback, or
// with g_links from node 0 to node 1 over the link. -1 on failure.
double TcpMs(const char* src, int64_t bytes) {
  return bench::TcpStreamsMs(g_links, {{0, 1}}, src, bytes);
}

// `argv` as one shell command line (each word single-quoted).
std::string ShellLine(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& a : argv) {
    std::string q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    absl::StrAppend(&out, out.empty() ? "" : " ", q, "'");
  }
  return out;
}

std::string Output(const std::string& cmd);

// MPI_Bcast of `bytes` between 2 processes (with g_links: one per node, `dir` holds mpirun's
// hostfile and agent): median ms, or an error saying why not.
absl::StatusOr<double> MpiBcastMs(int64_t bytes, int repeats, const std::filesystem::path& dir) {
  const std::string mpirun = absl::GetFlag(FLAGS_mpirun);
  const std::string baseline = absl::GetFlag(FLAGS_mpi_baseline);
  if (mpirun.empty() || baseline.empty() || ::access(baseline.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        "no MPI baseline (install libopenmpi-dev, build "
        "flatshard_mpi_bcast_baseline)");
  }
  std::string launch = absl::StrCat(mpirun, " ", absl::GetFlag(FLAGS_mpi_args));
  if (g_links != nullptr) {
    absl::StatusOr<std::vector<std::string>> prefix = MpiOverLinks(mpirun, 1, *g_links, dir);
    if (!prefix.ok()) return prefix.status();
    launch = ShellLine(*prefix);
  }
  const std::string cmd =
      absl::StrCat(launch, " --oversubscribe", ::geteuid() == 0 ? " --allow-run-as-root" : "",
                   " -np 2 ", baseline, " --bytes=", bytes, " --iters=", repeats, " 2>&1");
  const std::string out = Output(cmd);
  const size_t at = out.find("median_s=");
  double s = 0;
  if (at == std::string::npos ||
      !absl::SimpleAtod(out.substr(at + 9, out.find(' ', at) - at - 9), &s)) {
    return absl::InternalError(absl::StrCat("no median_s in: ", Tail(out, 2000)));
  }
  return s * 1000;
}

// Runs `cmd` (a shell command line) and returns what it printed.
std::string Output(const std::string& cmd) {
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  return out;
}

// ucx_perftest's ucp_get of `bytes` between a server and a client process on loopback (with
// g_links: the server in node 1, the client in node 0, UCX on the link): the overall latency
// per get in ms, or an error saying why not.
absl::StatusOr<double> UcxGetMs(int64_t bytes, int repeats) {
  const std::string perftest = absl::GetFlag(FLAGS_ucx_perftest);
  if (perftest.empty() || Output(absl::StrCat("command -v ", perftest)).empty()) {
    return absl::NotFoundError("no ucx_perftest (install ucx-utils)");
  }
  const char* tls = std::getenv("UCX_TLS");
  std::string server_env = absl::StrCat("UCX_TLS='", tls != nullptr ? tls : "^cma", "' ");
  std::string client_env = server_env;
  std::string host = "127.0.0.1";
  if (g_links != nullptr) {
    const std::vector<std::string> env = UcxOnLinkEnv(/*keep_tls=*/tls != nullptr);
    server_env = ShellLine(InNode(*g_links, 1, env)) + " ";
    client_env = ShellLine(InNode(*g_links, 0, env)) + " ";
    host = testing::EmulatedLinks::address(1);
  }
  const int port = PickFreeLoopbackPort();
  // The server serves one test and exits; the client retries until the server listens.
  const std::string cmd =
      absl::StrCat(server_env, "timeout 300 ", perftest, " -p ", port,
                   " >/dev/null 2>&1 & for i in $(seq 50); do ", client_env, "timeout 300 ",
                   perftest, " ", host, " -p ", port, " -t ucp_get -s ", bytes, " -n ", repeats,
                   " -w 1 2>&1 | grep Final: && break; sleep 0.2; done; wait");
  const std::string out = Output(cmd);
  // "Final: iters p50 avg overall(usec) bw_avg bw_overall(MB/s) rate_avg rate_overall"
  std::vector<std::string> words = absl::StrSplit(out, ' ', absl::SkipWhitespace());
  double usec = 0;
  if (words.size() < 5 || words[0] != "Final:" || !absl::SimpleAtod(words[4], &usec)) {
    return absl::InternalError(absl::StrCat("no Final: line in: ", Tail(out, 2000)));
  }
  return usec / 1000;
}

// The figures of one size.
// With --weights_keep=1, pull i >= kFreshPulls of a name lands in the spare segment of the
// version two before it (memory the reader's daemon has written); the first ones in fresh
// memory, whose first touch is costly on some VMs (README "Publishing weights").
constexpr int kFreshPulls = 2;
struct Row {
  int64_t bytes = 0;
  std::vector<double> ucx, grpc, local, tcp;
  std::vector<double> ucx_steady, grpc_steady;  // pulls kFreshPulls, kFreshPulls + 1, ...
};

int Run() {
  std::vector<Row> rows;
  for (const std::string& b : absl::GetFlag(FLAGS_bytes)) {
    Row row;
    if (!absl::SimpleAtoi(b, &row.bytes) || row.bytes < 4096 || row.bytes % 4 != 0) {
      std::fprintf(stderr, "--bytes: \"%s\" is not a byte count (>= 4096, a multiple of 4)\n",
                   b.c_str());
      return 1;
    }
    rows.push_back(row);
  }
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const std::string link_rate = absl::GetFlag(FLAGS_link_rate);
  std::unique_ptr<testing::EmulatedLinks> links;
  if (!link_rate.empty()) {
    testing::LinkOptions lo;
    lo.nodes = 2;
    lo.rate = link_rate;
    lo.delay = absl::GetFlag(FLAGS_link_delay);
    absl::StatusOr<std::unique_ptr<testing::EmulatedLinks>> l = testing::EmulatedLinks::Create(lo);
    if (!l.ok()) {
      std::fprintf(stderr, "--link_rate: %s\n", std::string(l.status().message()).c_str());
      return 1;
    }
    links = *std::move(l);
    g_links = links.get();
    std::printf("# links: %s; UCX_TLS %s\n", links->Describe().c_str(),
                std::getenv("UCX_TLS") != nullptr ? std::getenv("UCX_TLS") : "tcp");
  }
  // mpirun's hostfile and agent over the links.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("fswpbench", ::getpid());
  std::filesystem::create_directories(dir);
  struct RemoveDir {
    std::filesystem::path p;
    ~RemoveDir() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } remove_dir{dir};
  const std::string binary = absl::GetFlag(FLAGS_flatshardd);
  const bool keep_tls = std::getenv("UCX_TLS") != nullptr;
  // A daemon on loopback, or in emulated node `node`: its peer address ("" where it has none).
  auto start = [&](BenchDaemon& d, const std::string& tag, int node, bool peer,
                   std::vector<std::string> flags) -> absl::StatusOr<std::string> {
    flags.insert(flags.begin(), "--weights_keep=1");
    if (links != nullptr) {
      return StartDaemonOnNode(d, binary, tag, node, flags, {}, *links, keep_tls);
    }
    std::string address;
    if (peer) {
      address = absl::StrCat("127.0.0.1:", PickFreeLoopbackPort());
      flags.push_back("--peer_address=" + address);
    }
    FS_RETURN_IF_ERROR(d.Start(binary, tag, flags));
    return address;
  };
  BenchDaemon source, ucx_reader, grpc_reader;
  ScopedStopOnSignal stop_source(&source), stop_ucx(&ucx_reader), stop_grpc(&grpc_reader);
  absl::StatusOr<std::string> peer = start(source, "fswpsrc", 0, true, {});
  if (!peer.ok()) {
    std::fprintf(stderr, "source: %s\n", std::string(peer.status().message()).c_str());
    return 1;
  }
  for (auto [d, transport] : {std::pair{&ucx_reader, "ucx"}, std::pair{&grpc_reader, "grpc"}}) {
    if (absl::StatusOr<std::string> s =
            start(*d, absl::StrCat("fswp", transport), 1, false,
                  {"--weights_sources=" + *peer, absl::StrCat("--weights_transport=", transport)});
        !s.ok()) {
      std::fprintf(stderr, "reader daemon (%s): %s\n", transport,
                   std::string(s.status().message()).c_str());
      return 1;
    }
  }
  ClientOptions options;
  options.address = source.address();
  options.call_timeout = absl::Seconds(600);
  absl::StatusOr<std::unique_ptr<Client>> trainer = Client::Connect(options);
  if (!trainer.ok()) return 1;
  if (absl::Status s = (*trainer)->Join("pull", 1, 0, "tok"); !s.ok()) {
    std::fprintf(stderr, "join: %s\n", s.ToString().c_str());
    return 1;
  }
  std::vector<std::unique_ptr<WeightsReader>> readers;
  for (const BenchDaemon* d : {&ucx_reader, &grpc_reader}) {
    ClientOptions ro;
    ro.address = d->address();
    ro.call_timeout = absl::Seconds(600);
    absl::StatusOr<std::unique_ptr<WeightsReader>> r = WeightsReader::Connect(ro);
    if (!r.ok()) return 1;
    readers.push_back(*std::move(r));
  }
  for (size_t k = 0; k < rows.size(); ++k) {
    Row& row = rows[k];
    const std::string module = absl::StrCat("m", k), name = absl::StrCat("w", k);
    absl::StatusOr<client::RegisteredModule> m = (*trainer)->Register(
        module, ManifestJson(row.bytes / 4), kPolicyJson, client::InitMode::kZeros);
    if (!m.ok()) {
      std::fprintf(stderr, "register: %s\n", m.status().ToString().c_str());
      return 1;
    }
    for (const client::UnitShardView& u : m->shards) {
      std::memset(u.data, 0x3f, static_cast<size_t>(u.shard_numel) * 4);
    }
    if (absl::Status s = (*trainer)->Commit(module).status(); !s.ok()) return 1;
    std::vector<char> src(static_cast<size_t>(row.bytes), 0x3f);
    for (int i = 0; i < repeats; ++i) {
      if (absl::StatusOr<client::PublishedVersion> v = (*trainer)->Publish(module, name); !v.ok()) {
        std::fprintf(stderr, "publish: %s\n", v.status().ToString().c_str());
        return 1;
      }
      for (size_t t = 0; t < readers.size(); ++t) {
        Clock::time_point t0 = Clock::now();
        absl::StatusOr<std::unique_ptr<WeightsVersion>> v = readers[t]->Open(name);
        const double ms = MicrosSince(t0, Clock::now()) / 1000;
        (t == 0 ? row.ucx : row.grpc).push_back(ms);
        if (i >= kFreshPulls) (t == 0 ? row.ucx_steady : row.grpc_steady).push_back(ms);
        if (!v.ok() || (*v)->info().bytes < row.bytes) {
          std::fprintf(stderr, "pull: %s\n", v.status().ToString().c_str());
          return 1;
        }
        (void)(*v)->Release();
        if (t == 0) {
          t0 = Clock::now();
          v = readers[t]->Open(name);  // the same version again: one "not newer" round trip
          row.local.push_back(MicrosSince(t0, Clock::now()) / 1000);
          if (v.ok()) (void)(*v)->Release();
        }
      }
      row.tcp.push_back(TcpMs(src.data(), row.bytes));
    }
  }
  for (const Row& row : rows) {
    const std::string size = SizeName(row.bytes);
    const double u = Median(row.ucx), g = Median(row.grpc), t = Median(row.tcp);
    absl::StatusOr<double> p2p = UcxGetMs(row.bytes, repeats);
    absl::StatusOr<double> mpi = MpiBcastMs(row.bytes, repeats, dir);
    std::printf(
        "cross-daemon pull of %s, median of %d: over UCX %.1f ms (%.2f GB/s), over gRPC %.1f ms "
        "(%.2f GB/s): UCX/gRPC %.2fx; open of the local copy afterwards %.2f ms\n",
        size.c_str(), repeats, u, row.bytes / u / 1e6, g, row.bytes / g / 1e6, u / g,
        Median(row.local));
    const std::string where = g_links != nullptr ? "over the link" : "loopback";
    std::printf(
        "plain TCP point-to-point of %s (%s, fresh memory): %.1f ms: pull over UCX is %.2fx, "
        "over gRPC %.2fx\n",
        size.c_str(), where.c_str(), t, u / t, g / t);
    // The bytes over one link at its rate (with the links).
    const double line = g_links != nullptr
                            ? static_cast<double>(row.bytes) * 8 / g_links->rate_bits_per_s() * 1e3
                            : 0;
    if (line > 0) {
      std::printf(
          "line time of %s at %s: %.1f ms: pull over UCX is %.2fx (%.0f%% of line rate), over "
          "gRPC %.2fx (%.0f%%)\n",
          size.c_str(), link_rate.c_str(), line, u / line, 100 * line / u, g / line,
          100 * line / g);
    }
    if (p2p.ok()) {
      std::printf("ucx_perftest ucp_get of %s: %.1f ms: pull over UCX is %.2fx, over gRPC %.2fx\n",
                  size.c_str(), *p2p, u / *p2p, g / *p2p);
    } else {
      std::printf("UCX point-to-point: skipped: %s\n", std::string(p2p.status().message()).c_str());
    }
    if (mpi.ok()) {
      std::printf(
          "MPI_Bcast of %s between 2 processes (%s): %.1f ms: pull over UCX is %.2fx, over gRPC "
          "%.2fx\n",
          size.c_str(),
          g_links != nullptr ? "one per node, ob1 over tcp" : absl::GetFlag(FLAGS_mpi_args).c_str(),
          *mpi, u / *mpi, g / *mpi);
    } else {
      std::printf("MPI_Bcast: skipped: %s\n", std::string(mpi.status().message()).c_str());
    }
    // Steady state (an RL loop's pulls): into the spare segment, against the same baselines.
    double us = 0;
    if (!row.ucx_steady.empty()) {
      us = Median(row.ucx_steady);
      const double gs = Median(row.grpc_steady);
      std::printf(
          "steady-state pull of %s (pulls %d..%d, into the name's spare segment), median of %zu: "
          "over UCX %.1f ms (%.2f GB/s), over gRPC %.1f ms: UCX/gRPC %.2fx",
          size.c_str(), kFreshPulls + 1, repeats, row.ucx_steady.size(), us, row.bytes / us / 1e6,
          gs, us / gs);
      if (line > 0) std::printf("; %.0f%% of line rate", 100 * line / us);
      if (p2p.ok()) std::printf("; %.2fx ucp_get", us / *p2p);
      if (mpi.ok()) std::printf("; %.2fx MPI_Bcast", us / *mpi);
      std::printf("; %.2fx TCP\n", us / t);
    } else {
      std::printf("steady-state pull of %s: not measured (--repeats %d <= %d)\n", size.c_str(),
                  repeats, kFreshPulls);
    }
    const std::string f = absl::StrCat(
        "weights_pull.", g_links != nullptr ? absl::StrCat(link_rate, ".") : "", size, ".");
    if (us > 0) {
      PrintFigure(f + "ucx_steady_ms", us, "ms");
      if (line > 0) PrintFigure(f + "ucx_steady_over_line_time", us / line, "x");
      if (p2p.ok()) PrintFigure(f + "ucx_steady_over_ucx_get", us / *p2p, "x");
      if (mpi.ok()) PrintFigure(f + "ucx_steady_over_mpi_bcast", us / *mpi, "x");
    }
    PrintFigure(f + "ucx_ms", u, "ms");
    PrintFigure(f + "grpc_ms", g, "ms", true, /*context=*/true);
    PrintFigure(f + "ucx_over_grpc", u / g, "x");
    PrintFigure(f + "tcp_ms", t, "ms", true, /*context=*/true);
    PrintFigure(f + "ucx_over_tcp", u / t, "x");
    if (p2p.ok()) {
      PrintFigure(f + "ucx_get_ms", *p2p, "ms", true, /*context=*/true);
      PrintFigure(f + "ucx_over_ucx_get", u / *p2p, "x");
    }
    if (mpi.ok()) {
      PrintFigure(f + "mpi_bcast_ms", *mpi, "ms", true, /*context=*/true);
      PrintFigure(f + "ucx_over_mpi_bcast", u / *mpi, "x");
    }
    if (line > 0) PrintFigure(f + "ucx_over_line_time", u / line, "x");
  }
  return 0;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  flatshard::bench::StartSignalThread(argv[0]);
  const int rc = flatshard::bench::Run();
  while (flatshard::bench::Interrupted()) pause();
  return rc;
}
