// The MPI baseline of a cross-daemon copy of published weights (README "Published weights
// across daemons"): MPI_Bcast of --bytes from rank 0 to the other ranks. Never part of the
// default test run; flatshard_weights_pull_benchmark launches it, or by hand:
//
//   mpirun --oversubscribe [--allow-run-as-root] -np 2
//       build/tests/bench/flatshard_mpi_bcast_baseline [--bytes N] [--iters N] [--warmup N]
//
// Buffers are touched before timing (page faults are not part of the baseline) and the
// received bytes checked once. Per iteration: MPI_Barrier, then MPI_Bcast timed on every rank;
// the iteration's time is the max over ranks, the result the median over --iters after
// --warmup. Rank 0 prints one machine-readable line:
//
//   mpi_bcast np=2 bytes=1073741824 iters=5 median_s=0.123 min_s=0.120 max_s=0.130

#include <mpi.h>

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30, "bytes broadcast from rank 0");
ABSL_FLAG(int32_t, iters, 5, "measured iterations");
ABSL_FLAG(int32_t, warmup, 1, "warm-up iterations");

namespace {

[[noreturn]] void Fail(int rank, const std::string& message) {
  std::fprintf(stderr, "flatshard_mpi_bcast_baseline rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  absl::SetProgramUsageMessage(
      "MPI_Bcast baseline for flatshard's weights pull benchmark.\n"
      "Usage: mpirun -np P flatshard_mpi_bcast_baseline [--bytes N] [--iters N] [--warmup N]");
  absl::ParseCommandLine(argc, argv);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (iters < 1 || warmup < 0) Fail(rank, "want --iters >= 1 and --warmup >= 0");
  if (bytes < 1 || bytes > INT_MAX) {
    Fail(rank, "--bytes " + std::to_string(bytes) + " must be in [1, INT_MAX]");
  }
  std::vector<char> buf(static_cast<size_t>(bytes), rank == 0 ? 7 : 0);
  std::vector<double> times;
  for (int i = 0; i < warmup + iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    MPI_Bcast(buf.data(), static_cast<int>(bytes), MPI_CHAR, 0, MPI_COMM_WORLD);
    double mine = MPI_Wtime() - t0, slowest = 0;
    MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (i == 0 && (buf.front() != 7 || buf.back() != 7)) Fail(rank, "wrong bytes received");
    if (rank == 0 && i >= warmup) times.push_back(slowest);
  }
  if (rank == 0) {
    std::sort(times.begin(), times.end());
    const double median = times[(times.size() + 1) / 2 - 1];
    std::printf("mpi_bcast np=%d bytes=%" PRId64 " iters=%d median_s=%.9f min_s=%.9f max_s=%.9f\n",
                world, bytes, iters, median, times.front(), times.back());
    std::fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
