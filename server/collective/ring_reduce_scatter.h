#pragma once
// The flat ring's ReduceScatter (one rank per node, or RingOptions::node_of_rank unset),
// pipelined in chunks so that the reduction of one chunk runs while the next chunk's
// transfers move: the ring communicator (ring_algorithms.h) drives it step by step.
//
// Notation: W ranks, S the shard bytes, the block b of rank k's input in_k[b] (S bytes), C
// chunks of RingOptions::pipeline_chunk_bytes per block (PipelineChunkBytes). As in the
// unchunked ring, ring step t (0..W-2) of rank r sends the partial sum of block r-t-1 to r+1
// (step 0: its own input block r-1) and receives the partial of block r-t-2 from r-1, adds its
// own in_r[r-t-2] and keeps the sum as the next step's partial; at t = W-2 that block is r's
// and the sum (divided by W for kAvg) goes to `out`. Partials travel in the buffer's dtype
// (half types round at every step). The sum for block b is therefore, element by element,
// in_{b+1} + in_{b+2} + ... + in_{b-1} + in_b (ranks mod W), exactly the unchunked ring's:
// chunking splits elements, never an element's sum, so the results are bit-identical for
// every chunk size.
//
// Schedule: chunks go in groups of kWindow; within a group every chunk's ring step t runs
// before any chunk's step t+1, and each communicator step carries one chunk's ring step (one
// send, one receive, tagged by the step's index). A step's reduction is deferred into the
// next step, after that step's transfers are posted (Overlap): the chunk that depends on it
// comes kWindow steps later, so the link keeps moving while the rank reduces. A group of one
// chunk (C = 1, or the last chunk of an odd C) reduces before posting, as the unchunked ring.
// Scratch from the ScratchPool: a send and a receive chunk per slot of the window, 2 *
// min(kWindow, C) chunks per rank (2*S when S fits in one chunk), not 2 blocks.
//
// Thread safety: a RingReduceScatterSteps belongs to one op of one rank; its methods run one at
// a time (the ring's RankOp drives them).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "server/collective/op_descriptor.h"
#include "server/collective/ring_step.h"
#include "server/collective/scratch_pool.h"

namespace flatshard::collective {

class RingReduceScatterSteps {
 public:
  // Chunks whose ring steps interleave (the deferred reductions' slack).
  static constexpr int kWindow = 2;

  // REQUIRES: call is a ReduceScatter of > 0 bytes that passed ValidateCall, world >= 2;
  // `chunk_bytes` the same on every rank of the group (message tags depend on it).
  RingReduceScatterSteps(int rank, int world, const OpCall& call, ScratchPool& pool,
                         size_t chunk_bytes);

  // Fills the transfers of step `s` (0, 1, ... in order), first doing the deferred reduction
  // when step `s` needs its result; false when the op has no step `s` (the last reduction
  // done, the scratch back in the pool).
  bool Build(int s, std::vector<Xfer>* xfers);
  // The reduction deferred by After, if any: run after posting the next step's transfers.
  void Overlap();
  // Every transfer of step `s` succeeded: its reduction is now due (Overlap or Build runs it).
  void After(int s);

 private:
  struct Item {
    int t;  // ring step
    int chunk;
    int slot;  // chunk % kWindow
  };
  Item ItemOf(int s) const;
  size_t ChunkOffset(int c) const { return static_cast<size_t>(c) * chunk_; }
  size_t ChunkLen(int c) const { return std::min(chunk_, call_.desc.bytes - ChunkOffset(c)); }
  const uint8_t* InBlock(int b) const { return call_.in.begin() + b * call_.desc.bytes; }
  uint8_t* SendChunk(int slot) const { return scratch_.data() + 2 * slot * chunk_; }
  uint8_t* RecvChunk(int slot) const { return SendChunk(slot) + chunk_; }
  // Adds the chunk received at step `s` to this rank's own and stores the next partial (or the
  // result).
  void Reduce(int s);

  const int rank_;
  const int world_;
  const OpCall call_;
  ScratchPool& pool_;
  const size_t chunk_;
  const int chunks_;
  const int steps_;
  ScratchPool::Scratch scratch_;
  int pending_ = -1;  // the step whose reduction is due, or -1
};

}  // namespace flatshard::collective
