#pragma once
// The MPI baseline of flatshard_multi_daemon_benchmark: flatshard_mpi_allgather_baseline
// (MPI_Allgather or MPI_Reduce_scatter) under mpirun, on this host or over emulated links
// (bench::MpiOverLinks), with a session directory of the run's own.

#include <cstdint>
#include <filesystem>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/emulated_links.h"

namespace flatshard::bench::md {

struct MpiResult {
  double median_s = 0;
  int64_t bytes = 0;
  std::string pml, btl, single_copy;
};

// `ompi_info`'s btl_vader_single_copy_mechanism ("" when unknown).
std::string VaderSingleCopy(const std::filesystem::path& dir);

// `np` processes of `baseline` under `mpirun` (`rpn` per emulated node of `links`, when given):
// a verbose probe (which PML and BTL carry the bytes), then the timed run of `op` ("allgather"
// or "reduce_scatter") over `bytes`. Logs go to `dir`. FAILED_PRECONDITION without mpirun or
// the baseline.
absl::StatusOr<MpiResult> RunMpi(const std::string& mpirun, const std::string& baseline, int np,
                                 int64_t bytes, int iters, int warmup,
                                 const std::filesystem::path& dir, absl::Duration timeout,
                                 const std::string& op = "allgather", int rpn = 1,
                                 const testing::EmulatedLinks* links = nullptr);

}  // namespace flatshard::bench::md
