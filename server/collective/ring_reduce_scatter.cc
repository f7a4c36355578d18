#include "server/collective/ring_reduce_scatter.h"

#include <algorithm>

#include "server/collective/reduce.h"

namespace flatshard::collective {

RingReduceScatterSteps::RingReduceScatterSteps(int rank, int world, const OpCall& call,
                                               ScratchPool& pool, size_t chunk_bytes)
    : rank_(rank),
      world_(world),
      call_(call),
      pool_(pool),
      chunk_(PipelineChunkBytes(chunk_bytes, call.desc.bytes, world - 1)),
      chunks_(static_cast<int>((call.desc.bytes + chunk_ - 1) / chunk_)),
      steps_(chunks_ * (world - 1)) {}

RingReduceScatterSteps::Item RingReduceScatterSteps::ItemOf(int s) const {
  const int per_group = kWindow * (world_ - 1);  // steps of a full group
  const int group = s / per_group;
  const int q = s - group * per_group;
  const int size = std::min(kWindow, chunks_ - group * kWindow);  // chunks in this group
  const int j = q % size;
  return Item{q / size, group * kWindow + j, j};
}

int RingReduceScatterSteps::NextOfSlot(int slot, int after) const {
  // A slot recurs every kWindow steps within a group (its chunks interleave), so this is short.
  for (int s = after + 1; s < steps_; ++s) {
    if (ItemOf(s).slot == slot) return s;
  }
  return steps_;
}

void RingReduceScatterSteps::Start() {
  scratch_ = pool_.Acquire(2 * static_cast<size_t>(lanes()) * chunk_);
}

void RingReduceScatterSteps::Stop() {
  scratch_ = ScratchPool::Scratch();  // back to the pool for the next op
}

void RingReduceScatterSteps::Build(int s, std::vector<Xfer>* xfers) const {
  const Item it = ItemOf(s);
  const size_t off = ChunkOffset(it.chunk), len = ChunkLen(it.chunk);
  const uint32_t sub = static_cast<uint32_t>(s);
  const uint8_t* src = it.t == 0 ? InBlock(Mod(rank_ - 1, world_)) + off : SendChunk(it.slot);
  xfers->push_back(SendXfer(Mod(rank_ + 1, world_), sub, src, len));
  xfers->push_back(RecvXfer(Mod(rank_ - 1, world_), sub, RecvChunk(it.slot), len));
}

void RingReduceScatterSteps::Reduce(int s) {
  const OpDescriptor& d = call_.desc;
  const Item it = ItemOf(s);
  const size_t off = ChunkOffset(it.chunk);
  const size_t count = ChunkLen(it.chunk) / ItemSize(d.dtype);
  const void* srcs[2] = {RecvChunk(it.slot), InBlock(Mod(rank_ - it.t - 2, world_)) + off};
  if (it.t < world_ - 2) {
    ReduceInto(d.dtype, srcs, SendChunk(it.slot), count, ReduceOp::kSum, 1);
  } else {
    ReduceInto(d.dtype, srcs, call_.out.begin() + off, count, d.reduce_op, world_);
  }
}

}  // namespace flatshard::collective
