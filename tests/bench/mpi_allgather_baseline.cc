// The MPI baseline of flatshard's multi-daemon unshard (DESIGN.md "Performance targets": a 1 GiB
// unit across daemons <= 1.10x Open MPI `MPI_Allgather` of the same bytes). Never part of the
// default test run; flatshard_multi_daemon_benchmark launches it, or by hand:
//
//   mpirun --oversubscribe [--allow-run-as-root] -np P
//       build/tests/bench/flatshard_mpi_allgather_baseline [--bytes N] [--iters N] [--warmup N]
//
// P processes all-gather `--bytes` in total (each contributes bytes/P, rounded down to whole
// float32 elements, as flatshard shards a float32 unit). Buffers are touched before timing and
// the gathered values checked once. Per iteration: MPI_Barrier, then MPI_Allgather timed on
// every rank; the iteration's time is the max over ranks (what the slowest trainer sees), and
// the result is the median over --iters iterations after --warmup. Rank 0 prints '#' comment
// lines and one machine-readable line:
//
//   mpi_allgather np=2 bytes=1073741824 per_rank_bytes=536870912 iters=20 median_s=0.123
//       min_s=0.120 max_s=0.130   (one line)
//
// (bytes = per_rank_bytes * np, the bytes every rank ends up with.) Exits non-zero with a
// message on bad flags or a wrong gathered value.
//
// --op=reduce_scatter times MPI_Reduce_scatter (equal blocks, float sum) instead: every rank
// contributes `bytes` (rank + 1 everywhere) and keeps its bytes/P block of the sum, as
// flatshard reduce-scatters a unit's gradient; the line starts "mpi_reduce_scatter" and
// bytes is the reduced size (nccl-tests' convention for both collectives).

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

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30,
          "total bytes gathered (every rank contributes bytes/P, rounded down to float32)");
ABSL_FLAG(int32_t, iters, 20, "measured iterations");
ABSL_FLAG(int32_t, warmup, 3, "warm-up iterations");
ABSL_FLAG(std::string, op, "allgather",
          "allgather (MPI_Allgather) or reduce_scatter "
          "(MPI_Reduce_scatter, float sum)");

namespace {

// Rank 0 prints the message; every rank aborts the job.
[[noreturn]] void Fail(int rank, const std::string& message) {
  if (rank == 0) std::fprintf(stderr, "flatshard_mpi_allgather_baseline: %s\n", message.c_str());
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
      "MPI_Allgather baseline for flatshard's multi-daemon benchmark.\n"
      "Usage: mpirun -np P flatshard_mpi_allgather_baseline [--bytes N] [--iters N] "
      "[--warmup N]");
  absl::ParseCommandLine(argc, argv);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (iters < 1 || warmup < 0) Fail(rank, "want --iters >= 1 and --warmup >= 0");
  const std::string op = absl::GetFlag(FLAGS_op);
  if (op != "allgather" && op != "reduce_scatter") {
    Fail(rank, "--op \"" + op + "\": want allgather or reduce_scatter");
  }
  const bool reduce = op == "reduce_scatter";
  const int64_t per_rank_numel = bytes / world / static_cast<int64_t>(sizeof(float));
  if (per_rank_numel < 1) {
    Fail(rank, "--bytes " + std::to_string(bytes) + " is less than one float32 per rank");
  }
  if (per_rank_numel > INT_MAX) {
    Fail(rank, "--bytes " + std::to_string(bytes) + " is more than INT_MAX floats per rank");
  }
  const int count = static_cast<int>(per_rank_numel);
  const int64_t per_rank_bytes = per_rank_numel * static_cast<int64_t>(sizeof(float));

  // Touched buffers: page faults are not part of the baseline (nor of flatshard's steady state).
  // All-gather: send one block, receive all; reduce-scatter: send all, receive one block.
  std::vector<float> send(static_cast<size_t>(count) * (reduce ? world : 1),
                          static_cast<float>(rank + 1));
  std::vector<float> recv(static_cast<size_t>(count) * (reduce ? 1 : world), 0.0f);
  // MPI_Reduce_scatter, not the _block variant: Open MPI's tuned component has a ring for
  // it at large sizes, where its _block variant reduces to one rank and scatters.
  const std::vector<int> recv_counts(static_cast<size_t>(world), count);
  const float sum = static_cast<float>(world) * static_cast<float>(world + 1) / 2;

  std::vector<double> times;  // rank 0: max over ranks, per measured iteration
  for (int i = 0; i < warmup + iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    if (reduce) {
      MPI_Reduce_scatter(send.data(), recv.data(), recv_counts.data(), MPI_FLOAT, MPI_SUM,
                         MPI_COMM_WORLD);
    } else {
      MPI_Allgather(send.data(), count, MPI_FLOAT, recv.data(), count, MPI_FLOAT, MPI_COMM_WORLD);
    }
    double mine = MPI_Wtime() - t0, slowest = 0;
    MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (i == 0 && reduce) {
      for (int64_t e : {int64_t{0}, int64_t{count} - 1}) {
        if (recv[static_cast<size_t>(e)] != sum) {
          std::fprintf(stderr, "rank %d: reduced element %" PRId64 " is %g, want %g\n", rank, e,
                       static_cast<double>(recv[static_cast<size_t>(e)]), static_cast<double>(sum));
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
      }
    } else if (i == 0) {
      // Block k holds k + 1: check both ends of every block.
      for (int k = 0; k < world; ++k) {
        for (int64_t e : {int64_t{k} * count, int64_t{k} * count + count - 1}) {
          if (recv[static_cast<size_t>(e)] != static_cast<float>(k + 1)) {
            std::fprintf(stderr, "rank %d: element %" PRId64 " is %g, want %d\n", rank, e,
                         static_cast<double>(recv[static_cast<size_t>(e)]), k + 1);
            MPI_Abort(MPI_COMM_WORLD, 1);
          }
        }
      }
    }
    if (rank == 0 && i >= warmup) times.push_back(slowest);
  }
  if (rank == 0) {
    std::sort(times.begin(), times.end());
    // Nearest-rank median, as the flatshard benchmarks take it.
    const double median = times[(times.size() + 1) / 2 - 1];
    std::printf("# %s: %d ranks x %" PRId64
                " bytes (float32), %d iterations after %d "
                "warm-up; time = max over ranks per iteration\n",
                reduce ? "MPI_Reduce_scatter" : "MPI_Allgather", world, per_rank_bytes, iters,
                warmup);
    std::printf("mpi_%s np=%d bytes=%" PRId64 " per_rank_bytes=%" PRId64
                " iters=%d median_s=%.9f min_s=%.9f max_s=%.9f\n",
                op.c_str(), world, per_rank_bytes * world, per_rank_bytes, iters, median,
                times.front(), times.back());
    std::fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
