#pragma once
// The scratch checks of the ring collectives (ring_reduce_scatter_test.cc,
// hierarchical_algorithms_test.cc): a ring of one process's ranks (InprocTransport) whose
// reduce-scatters draw their scratch from a ScratchPool the test reads afterwards.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/ring_algorithms.h"
#include "server/collective/scratch_pool.h"
#include "tests/server/collective/backend_conformance.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective::testing {

// `ops` reduce-scatters (op_seq 1..ops, the same buffers) of float32 ones, `shard` elements
// per rank, over a ring of `world` ranks with options `o` (o.scratch set): every output
// element must be `world`. Returns o.scratch's idle bytes after each op.
inline std::vector<size_t> IdleScratchAfterReduceScatters(const RingOptions& o, int world,
                                                          size_t shard, int ops) {
  std::vector<size_t> idle;
  absl::StatusOr<std::unique_ptr<Communicator>> comm = NewRingCommunicator(
      GroupSpec::AllLocal("g", world), std::make_shared<InprocTransport>(world), o);
  EXPECT_TRUE(comm.ok()) << comm.status();
  if (!comm.ok()) return idle;
  std::vector<std::vector<float>> in(world, std::vector<float>(shard * world, 1.0f));
  std::vector<std::vector<float>> out(world, std::vector<float>(shard));
  for (uint64_t op = 1; op <= static_cast<uint64_t>(ops); ++op) {
    RunRanks(world, [&](int r) {
      DoneRecorder done;
      (*comm)->ReduceScatter(ConstBuffer{in[r].data(), shard * world * 4, DType::kFloat32},
                             MutableBuffer{out[r].data(), shard * 4, DType::kFloat32},
                             ReduceOp::kSum, Opts(r, op), done.Callback());
      EXPECT_TRUE(done.Wait().ok()) << done.status();
      EXPECT_THAT(out[r], ::testing::Each(static_cast<float>(world))) << "op " << op;
    });
    idle.push_back(o.scratch->idle_bytes());
  }
  return idle;
}

}  // namespace flatshard::collective::testing
