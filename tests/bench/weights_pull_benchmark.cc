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
//       [--repeats 3]

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;
using client::WeightsReader;
using client::WeightsVersion;

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// `bytes` over one loopback TCP connection, sender and receiver threads, into fresh memory
// (or memory already touched).
double TcpMs(const char* src, int64_t bytes, bool fresh) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::listen(lfd, 1);
  char* dst = static_cast<char*>(
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (!fresh) std::memset(dst, 0, static_cast<size_t>(bytes));
  const Clock::time_point t0 = Clock::now();
  std::thread sender([&] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return;
    for (int64_t off = 0; off < bytes;) {
      const ssize_t n = ::send(fd, src + off, static_cast<size_t>(bytes - off), MSG_NOSIGNAL);
      if (n <= 0) break;
      off += n;
    }
    ::close(fd);
  });
  const int cfd = ::accept(lfd, nullptr, nullptr);
  int64_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::recv(cfd, dst + got, static_cast<size_t>(bytes - got), 0);
    if (n <= 0) break;
    got += n;
  }
  sender.join();
  const double ms = MicrosSince(t0, Clock::now()) / 1000;
  ::close(cfd);
  ::close(lfd);
  ::munmap(dst, bytes);
  return got == bytes ? ms : -1;
}

std::string Output(const std::string& cmd);

// MPI_Bcast of `bytes` between 2 processes: median ms, or an error saying why not.
absl::StatusOr<double> MpiBcastMs(int64_t bytes, int repeats) {
  const std::string mpirun = absl::GetFlag(FLAGS_mpirun);
  const std::string baseline = absl::GetFlag(FLAGS_mpi_baseline);
  if (mpirun.empty() || baseline.empty() || ::access(baseline.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        "no MPI baseline (install libopenmpi-dev, build "
        "flatshard_mpi_bcast_baseline)");
  }
  const std::string cmd =
      absl::StrCat(mpirun, " --oversubscribe", ::geteuid() == 0 ? " --allow-run-as-root" : "", " ",
                   absl::GetFlag(FLAGS_mpi_args), " -np 2 ", baseline, " --bytes=", bytes,
                   " --iters=", repeats, " 2>&1");
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

// ucx_perftest's ucp_get of `bytes` between a server and a client process on loopback:
// the overall latency per get in ms, or an error saying why not.
absl::StatusOr<double> UcxGetMs(int64_t bytes, int repeats) {
  const std::string perftest = absl::GetFlag(FLAGS_ucx_perftest);
  if (perftest.empty() || Output(absl::StrCat("command -v ", perftest)).empty()) {
    return absl::NotFoundError("no ucx_perftest (install ucx-utils)");
  }
  const char* tls = std::getenv("UCX_TLS");
  const std::string env = absl::StrCat("UCX_TLS='", tls != nullptr ? tls : "^cma", "' ");
  const int port = FreePort();
  // The server serves one test and exits; the client retries until the server listens.
  const std::string cmd = absl::StrCat(
      env, "timeout 300 ", perftest, " -p ", port, " >/dev/null 2>&1 & for i in $(seq 50); do ",
      env, "timeout 300 ", perftest, " 127.0.0.1 -p ", port, " -t ucp_get -s ", bytes, " -n ",
      repeats, " -w 1 2>&1 | grep Final: && break; sleep 0.2; done; wait");
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
struct Row {
  int64_t bytes = 0;
  std::vector<double> ucx, grpc, local, tcp;
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
  const std::string peer = absl::StrCat("127.0.0.1:", FreePort());
  BenchDaemon source, ucx_reader, grpc_reader;
  ScopedStopOnSignal stop_source(&source), stop_ucx(&ucx_reader), stop_grpc(&grpc_reader);
  if (absl::Status s = source.Start(absl::GetFlag(FLAGS_flatshardd), "fswpsrc",
                                    {"--weights_keep=1", "--peer_address=" + peer});
      !s.ok()) {
    std::fprintf(stderr, "source: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  for (auto [d, transport] : {std::pair{&ucx_reader, "ucx"}, std::pair{&grpc_reader, "grpc"}}) {
    if (absl::Status s = d->Start(absl::GetFlag(FLAGS_flatshardd), absl::StrCat("fswp", transport),
                                  {"--weights_keep=1", "--weights_sources=" + peer,
                                   absl::StrCat("--weights_transport=", transport)});
        !s.ok()) {
      std::fprintf(stderr, "reader daemon (%s): %s\n", transport, std::string(s.message()).c_str());
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
        (t == 0 ? row.ucx : row.grpc).push_back(MicrosSince(t0, Clock::now()) / 1000);
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
      row.tcp.push_back(TcpMs(src.data(), row.bytes, /*fresh=*/true));
    }
  }
  for (const Row& row : rows) {
    const std::string size = SizeName(row.bytes);
    const double u = Median(row.ucx), g = Median(row.grpc), t = Median(row.tcp);
    absl::StatusOr<double> p2p = UcxGetMs(row.bytes, repeats);
    absl::StatusOr<double> mpi = MpiBcastMs(row.bytes, repeats);
    std::printf(
        "cross-daemon pull of %s, median of %d: over UCX %.1f ms (%.2f GB/s), over gRPC %.1f ms "
        "(%.2f GB/s): UCX/gRPC %.2fx; open of the local copy afterwards %.2f ms\n",
        size.c_str(), repeats, u, row.bytes / u / 1e6, g, row.bytes / g / 1e6, u / g,
        Median(row.local));
    std::printf(
        "plain TCP point-to-point of %s (loopback, fresh memory): %.1f ms: pull over UCX "
        "is %.2fx, over gRPC %.2fx\n",
        size.c_str(), t, u / t, g / t);
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
          size.c_str(), absl::GetFlag(FLAGS_mpi_args).c_str(), *mpi, u / *mpi, g / *mpi);
    } else {
      std::printf("MPI_Bcast: skipped: %s\n", std::string(mpi.status().message()).c_str());
    }
    const std::string f = absl::StrCat("weights_pull.", size, ".");
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
