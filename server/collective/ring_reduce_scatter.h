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
// Schedule: kWindow lanes, each a chain of steps over its own scratch slot: lane j carries
// chunks j, j + kWindow, ... through every ring step (one send and one receive per step,
// tagged by the step's index in the rank's whole schedule). A lane posts its next step once
// its previous step's transfers are done and reduced (the next partial is what it sends);
// lanes do not wait for each other, so while one lane reduces or waits for its handshake the
// other's chunk keeps the link busy, and each link has up to kWindow messages in flight
// instead of one at a time (a gap per message otherwise: about 6% of a 1 Gbit/s link at
// 4 MiB chunks, more on faster links). Scratch from the ScratchPool: a send and a receive
// chunk per lane, 2 * min(kWindow, C) chunks per rank (2*S when S fits in one chunk), not 2
// blocks.
//
// Thread safety: a RingReduceScatterSteps belongs to one op of one rank (the ring's RankOp
// drives it). Start and Stop run alone; between them Build and Reduce of different lanes may
// run concurrently (they touch only their lane's slot), those of one lane one at a time.

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
  // Lanes (chunks in flight per link).
  static constexpr int kWindow = 2;

  // REQUIRES: call is a ReduceScatter of > 0 bytes that passed ValidateCall, world >= 2;
  // `chunk_bytes` the same on every rank of the group (message tags depend on it).
  RingReduceScatterSteps(int rank, int world, const OpCall& call, ScratchPool& pool,
                         size_t chunk_bytes);

  // Takes the scratch from the pool; Stop gives it back (every lane done).
  void Start();
  void Stop();
  int lanes() const { return std::min(kWindow, chunks_); }
  // The first step of lane `lane` (< lanes()), and the step after `s` in its lane; steps()
  // when none is left.
  int FirstStep(int lane) const { return NextOfSlot(lane, -1); }
  int NextStep(int s) const { return NextOfSlot(ItemOf(s).slot, s); }
  int steps() const { return steps_; }
  // The transfers of step `s` (REQUIRES: s < steps(), its lane's previous step reduced).
  void Build(int s, std::vector<Xfer>* xfers) const;
  // Every transfer of step `s` succeeded: adds the chunk received to this rank's own and
  // stores the next partial (or the result).
  void Reduce(int s);

 private:
  struct Item {
    int t;  // ring step
    int chunk;
    int slot;  // chunk % kWindow
  };
  Item ItemOf(int s) const;
  // The first step after `after` whose chunk uses `slot`, or steps_.
  int NextOfSlot(int slot, int after) const;
  size_t ChunkOffset(int c) const { return static_cast<size_t>(c) * chunk_; }
  size_t ChunkLen(int c) const { return std::min(chunk_, call_.desc.bytes - ChunkOffset(c)); }
  const uint8_t* InBlock(int b) const { return call_.in.begin() + b * call_.desc.bytes; }
  uint8_t* SendChunk(int slot) const { return scratch_.data() + 2 * slot * chunk_; }
  uint8_t* RecvChunk(int slot) const { return SendChunk(slot) + chunk_; }

  const int rank_;
  const int world_;
  const OpCall call_;
  ScratchPool& pool_;
  const size_t chunk_;
  const int chunks_;
  const int steps_;
  ScratchPool::Scratch scratch_;
};

}  // namespace flatshard::collective
