// A cross-daemon copy of published weights (README "Published weights across daemons"),
// same-run ratios over the same link (loopback TCP between two processes on this host):
//   - pull: a reader's first WeightsReader::Open of a new version on a daemon with
//     --weights_sources, which copies the version of --bytes from the source daemon (the
//     descriptor round trips, the bytes into a fresh sealed segment, the open);
//   - tcp: the same bytes over one plain TCP connection between two threads, into fresh
//     memory (page faults included, as the pull's fresh segment has them);
//   - mpi: MPI_Bcast of the same bytes between 2 processes (mpirun; over TCP by default,
//     --mpi_args chooses; touched buffers).
//
//   build/tests/bench/flatshard_weights_pull_benchmark [--bytes 1073741824] [--repeats 3]

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30, "bytes of the published model (float32 x 4)");
ABSL_FLAG(int, repeats, 3, "pulls, TCP copies and MPI_Bcasts measured (medians reported)");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");
ABSL_FLAG(std::string, mpirun, FS_MPIEXEC, "mpirun (empty: no MPI row)");
ABSL_FLAG(std::string, mpi_args, "--mca pml ob1 --mca btl tcp,self",
          "mpirun arguments choosing MPI's transport (default: TCP, the pull's link; empty: "
          "Open MPI's own choice, shared memory on one host)");
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
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  const size_t at = out.find("median_s=");
  double s = 0;
  if (at == std::string::npos ||
      !absl::SimpleAtod(out.substr(at + 9, out.find(' ', at) - at - 9), &s)) {
    return absl::InternalError(absl::StrCat("no median_s in: ", Tail(out, 2000)));
  }
  return s * 1000;
}

int Run() {
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const std::string peer = absl::StrCat("127.0.0.1:", FreePort());
  BenchDaemon source, reader_daemon;
  ScopedStopOnSignal stop_source(&source), stop_reader(&reader_daemon);
  if (absl::Status s = source.Start(absl::GetFlag(FLAGS_flatshardd), "fswpsrc",
                                    {"--weights_keep=1", "--peer_address=" + peer});
      !s.ok()) {
    std::fprintf(stderr, "source: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  if (absl::Status s = reader_daemon.Start(absl::GetFlag(FLAGS_flatshardd), "fswpdst",
                                           {"--weights_keep=1", "--weights_sources=" + peer});
      !s.ok()) {
    std::fprintf(stderr, "reader daemon: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  ClientOptions options;
  options.address = source.address();
  options.call_timeout = absl::Seconds(600);
  absl::StatusOr<std::unique_ptr<Client>> trainer = Client::Connect(options);
  if (!trainer.ok()) return 1;
  absl::Status setup = (*trainer)->Join("pull", 1, 0, "tok");
  absl::StatusOr<client::RegisteredModule> m =
      setup.ok()
          ? (*trainer)->Register("", ManifestJson(bytes / 4), kPolicyJson, client::InitMode::kZeros)
          : absl::StatusOr<client::RegisteredModule>(setup);
  if (!m.ok()) {
    std::fprintf(stderr, "setup: %s\n", m.status().ToString().c_str());
    return 1;
  }
  for (const client::UnitShardView& u : m->shards) {
    std::memset(u.data, 0x3f, static_cast<size_t>(u.shard_numel) * 4);
  }
  if (absl::Status s = (*trainer)->Commit("").status(); !s.ok()) return 1;
  ClientOptions ro;
  ro.address = reader_daemon.address();
  ro.call_timeout = absl::Seconds(600);
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = WeightsReader::Connect(ro);
  if (!r.ok()) return 1;
  std::vector<double> pull, local, tcp, tcp_touched;
  std::vector<char> src(static_cast<size_t>(bytes), 0x3f);
  for (int i = 0; i < repeats; ++i) {
    if (absl::StatusOr<client::PublishedVersion> v = (*trainer)->Publish("", "w"); !v.ok()) {
      std::fprintf(stderr, "publish: %s\n", v.status().ToString().c_str());
      return 1;
    }
    Clock::time_point t0 = Clock::now();
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = (*r)->Open("w");
    pull.push_back(MicrosSince(t0, Clock::now()) / 1000);
    if (!v.ok() || (*v)->info().bytes < bytes) {
      std::fprintf(stderr, "pull: %s\n", v.status().ToString().c_str());
      return 1;
    }
    (void)(*v)->Release();
    t0 = Clock::now();
    v = (*r)->Open("w");  // the same version again: one "not newer" round trip, no copy
    local.push_back(MicrosSince(t0, Clock::now()) / 1000);
    if (v.ok()) (void)(*v)->Release();
    tcp.push_back(TcpMs(src.data(), bytes, /*fresh=*/true));
    tcp_touched.push_back(TcpMs(src.data(), bytes, /*fresh=*/false));
  }
  src.clear();
  src.shrink_to_fit();
  absl::StatusOr<double> mpi = MpiBcastMs(bytes, repeats);
  const double p = Median(pull), t = Median(tcp);
  std::printf(
      "cross-daemon pull of %s: %.1f ms median of %d (%.2f GB/s); open of the local "
      "copy afterwards %.2f ms\n",
      SizeName(bytes).c_str(), p, repeats, bytes / p / 1e6, Median(local));
  const double tt = Median(tcp_touched);
  std::printf(
      "plain TCP point-to-point of %s (loopback): into fresh memory %.1f ms (pull is %.2fx), "
      "into touched memory %.1f ms (pull is %.2fx)\n",
      SizeName(bytes).c_str(), t, p / t, tt, p / tt);
  if (mpi.ok()) {
    std::printf("MPI_Bcast of %s between 2 processes (%s): %.1f ms: pull is %.2fx\n",
                SizeName(bytes).c_str(), absl::GetFlag(FLAGS_mpi_args).c_str(), *mpi, p / *mpi);
  } else {
    std::printf("MPI_Bcast: skipped: %s\n", std::string(mpi.status().message()).c_str());
  }
  PrintFigure("weights_pull.pull_ms", p, "ms");
  PrintFigure("weights_pull.tcp_ms", t, "ms", true, /*context=*/true);
  PrintFigure("weights_pull.pull_over_tcp", p / t, "x");
  PrintFigure("weights_pull.tcp_touched_ms", tt, "ms", true, /*context=*/true);
  PrintFigure("weights_pull.pull_over_tcp_touched", p / tt, "x");
  if (mpi.ok()) {
    PrintFigure("weights_pull.mpi_bcast_ms", *mpi, "ms", true, /*context=*/true);
    PrintFigure("weights_pull.pull_over_mpi_bcast", p / *mpi, "x");
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
