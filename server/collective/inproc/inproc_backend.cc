#include "server/collective/inproc/inproc_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bulk_copy.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/deadline_timer.h"
#include "server/collective/local_rendezvous.h"
#include "server/collective/op_descriptor.h"
#include "server/collective/reduce.h"
#include "server/collective/worker_pool.h"

namespace flatshard::collective {
namespace {

// ---------------------------------------------------------------------------------------------
// Execution plan of one op: copies and reductions between the ranks' buffers.

struct CopyTask {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
};

// out[0, count) = reduce(srcs[k][0, count)) for the output shard of one rank.
struct ReduceTask {
  uint8_t* dst;
  std::vector<const void*> srcs;
  size_t count;  // elements
};

// A byte range with the index of the output it belongs to (for the in-place exception).
struct Range {
  uintptr_t begin;
  uintptr_t end;
  int owner;
};

Range MakeRange(const void* p, size_t bytes, int owner) {
  auto b = reinterpret_cast<uintptr_t>(p);
  return Range{b, b + bytes, owner};
}

// Writes must be pairwise disjoint; a read may overlap a write only when both are the same
// range of the same output (a ReduceScatter shard reduced in place). Empty ranges never
// conflict. Sorting keeps this O((reads + writes) log writes).
absl::Status CheckOverlaps(std::vector<Range> writes, const std::vector<Range>& reads,
                           bool allow_in_place, uint64_t op_seq, const OpDescriptor& desc) {
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("op_seq ", op_seq, " ", FormatOp(desc),
                                                   ": buffers of different ranks ", what));
  };
  writes.erase(
      std::remove_if(writes.begin(), writes.end(), [](const Range& r) { return r.begin == r.end; }),
      writes.end());
  std::sort(writes.begin(), writes.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < writes.size(); ++i) {
    if (writes[i].begin < writes[i - 1].end) return error("overlap where they are written");
  }
  for (const Range& r : reads) {
    if (r.begin == r.end) continue;
    // First write that ends after the read begins; writes are disjoint, so ends are sorted too.
    auto it = std::upper_bound(writes.begin(), writes.end(), r.begin,
                               [](uintptr_t v, const Range& w) { return v < w.end; });
    for (; it != writes.end() && it->begin < r.end; ++it) {
      const bool in_place =
          allow_in_place && it->begin == r.begin && it->end == r.end && it->owner == r.owner;
      if (!in_place) return error("overlap: an input is overwritten by an output");
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

// The rendezvous (local_rendezvous.h) matches the ranks' calls and owns the error contract;
// the core moves the data of each op whose ranks all arrived, on the last arrival's thread.
class InprocCore {
 public:
  InprocCore(const GroupSpec& spec, std::shared_ptr<DeadlineTimer> timer,
             std::shared_ptr<WorkerPool> pool, InprocBackendOptions options)
      : spec_(spec),
        pool_(std::move(pool)),
        options_(options),
        rendezvous_(std::make_shared<LocalRendezvous>(spec, RendezvousOptionsFor(spec, timer))) {}

  void Arrive(OpCall call, const OpOptions& o, DoneCallback done);
  // `quiet`: the communicator is being destroyed, which is not worth a warning by itself.
  void Abort(absl::Status reason, bool quiet = false) {
    rendezvous_->Fail(std::move(reason), quiet).IgnoreError();  // status() tells the outcome
  }
  absl::Status status() const { return rendezvous_->status(); }
  std::vector<PendingOpInfo> PendingOps() const { return rendezvous_->PendingOps(); }

 private:
  static LocalRendezvousOptions RendezvousOptionsFor(const GroupSpec& spec,
                                                     std::shared_ptr<DeadlineTimer> timer) {
    LocalRendezvousOptions o;
    o.log_name = absl::StrCat("group=", spec.group_id, " inproc communicator");
    o.host_only = true;
    o.timer = std::move(timer);
    return o;  // the last rank to arrive moves the data (hand_over_on_arrival)
  }

  // Moves the data of an op whose ranks all arrived. Runs without a lock.
  absl::Status Execute(uint64_t op_seq, const OpDescriptor& desc,
                       const std::vector<RendezvousCall>& calls);
  absl::Status ExecuteCopies(uint64_t op_seq, const OpDescriptor& desc,
                             std::vector<CopyTask> tasks);
  absl::Status ExecuteReduce(uint64_t op_seq, const OpDescriptor& desc,
                             const std::vector<RendezvousCall>& calls);

  const GroupSpec spec_;
  const std::shared_ptr<WorkerPool> pool_;
  const InprocBackendOptions options_;
  const std::shared_ptr<LocalRendezvous> rendezvous_;
};

void InprocCore::Arrive(OpCall call, const OpOptions& o, DoneCallback done) {
  std::optional<RendezvousOp> op = rendezvous_->Arrive(std::move(call), o, std::move(done));
  if (!op) return;  // waiting for other ranks, or failed
  // Every rank arrived: all calls are local and in op->calls, indexed by rank.
  absl::Status result = rendezvous_->Finish(op->op_seq, Execute(op->op_seq, op->desc, op->calls));
  FS_VLOG(2) << "group=" << spec_.group_id << " op_seq=" << op->op_seq << " " << FormatOp(op->desc)
             << " done: " << result;
  for (RendezvousCall& c : op->calls) std::move(c.done)(result);
}

absl::Status InprocCore::Execute(uint64_t op_seq, const OpDescriptor& desc,
                                 const std::vector<RendezvousCall>& arrivals) {
  const int world = spec_.world_size;
  const size_t s = desc.bytes;
  std::vector<CopyTask> tasks;
  switch (desc.kind) {
    case CollectiveKind::kAllReduce:  // composed above the Communicator; ValidateCall refuses it
      return absl::InvalidArgumentError(FormatOp(desc) + " reached the inproc backend");
    case CollectiveKind::kReduceScatter:
      return ExecuteReduce(op_seq, desc, arrivals);
    case CollectiveKind::kAllGather: {
      // Each shard is copied once into each distinct output buffer.
      std::vector<uint8_t*> outs;
      for (const RendezvousCall& a : arrivals) {
        uint8_t* d = a.call.out.begin();
        if (std::find(outs.begin(), outs.end(), d) == outs.end()) outs.push_back(d);
      }
      for (uint8_t* d : outs) {
        for (int k = 0; k < world; ++k) {
          tasks.push_back(CopyTask{d + k * s, arrivals[k].call.in.begin(), s});
        }
      }
      break;
    }
    case CollectiveKind::kGather: {
      uint8_t* d = arrivals[desc.root].call.out.begin();
      for (int k = 0; k < world; ++k) {
        tasks.push_back(CopyTask{d + k * s, arrivals[k].call.in.begin(), s});
      }
      break;
    }
    case CollectiveKind::kBroadcast: {
      const uint8_t* src = arrivals[desc.root].call.in.begin();
      std::vector<uint8_t*> outs;
      for (const RendezvousCall& a : arrivals) {
        uint8_t* d = a.call.out.begin();
        if (std::find(outs.begin(), outs.end(), d) == outs.end()) outs.push_back(d);
      }
      for (uint8_t* d : outs) tasks.push_back(CopyTask{d, src, s});
      break;
    }
  }
  return ExecuteCopies(op_seq, desc, std::move(tasks));
}

absl::Status InprocCore::ExecuteCopies(uint64_t op_seq, const OpDescriptor& desc,
                                       std::vector<CopyTask> tasks) {
  // A shard that already sits in its slot (in place) is not copied.
  tasks.erase(std::remove_if(tasks.begin(), tasks.end(),
                             [](const CopyTask& t) { return t.bytes == 0 || t.dst == t.src; }),
              tasks.end());
  if (tasks.empty()) return absl::OkStatus();
  std::vector<Range> writes, reads;
  size_t total = 0;
  for (const CopyTask& t : tasks) {
    writes.push_back(MakeRange(t.dst, t.bytes, -1));
    reads.push_back(MakeRange(t.src, t.bytes, -2));
    total += t.bytes;
  }
  FS_RETURN_IF_ERROR(CheckOverlaps(std::move(writes), reads, false, op_seq, desc));

  const bool stream = BulkShouldStream(total);
  if (pool_ == nullptr || pool_->num_helpers() == 0 || total < options_.parallel_min_bytes) {
    for (const CopyTask& t : tasks) BulkCopy(t.dst, t.src, t.bytes, stream);
    return absl::OkStatus();
  }
  const size_t piece = std::max<size_t>(options_.piece_bytes, 4096);
  std::vector<CopyTask> pieces;
  for (const CopyTask& t : tasks) {
    for (size_t off = 0; off < t.bytes; off += piece) {
      pieces.push_back(CopyTask{t.dst + off, t.src + off, std::min(piece, t.bytes - off)});
    }
  }
  pool_->ParallelFor(pieces.size(), [&](size_t i) {
    BulkCopy(pieces[i].dst, pieces[i].src, pieces[i].bytes, stream);
  });
  return absl::OkStatus();
}

absl::Status InprocCore::ExecuteReduce(uint64_t op_seq, const OpDescriptor& desc,
                                       const std::vector<RendezvousCall>& arrivals) {
  const int world = spec_.world_size;
  const size_t s = desc.bytes;
  if (s == 0) return absl::OkStatus();
  const size_t item = static_cast<size_t>(ItemSize(desc.dtype));
  std::vector<ReduceTask> tasks;
  std::vector<Range> writes, reads;
  for (int r = 0; r < world; ++r) {
    ReduceTask t;
    t.dst = arrivals[r].call.out.begin();
    t.count = s / item;
    writes.push_back(MakeRange(t.dst, s, r));
    for (int k = 0; k < world; ++k) {
      const uint8_t* src = arrivals[k].call.in.begin() + r * s;
      t.srcs.push_back(src);
      reads.push_back(MakeRange(src, s, r));
    }
    tasks.push_back(std::move(t));
  }
  FS_RETURN_IF_ERROR(CheckOverlaps(std::move(writes), reads, true, op_seq, desc));

  const size_t total = s * world * world;  // bytes read
  if (pool_ == nullptr || pool_->num_helpers() == 0 || total < options_.parallel_min_bytes) {
    for (const ReduceTask& t : tasks) {
      ReduceInto(desc.dtype, t.srcs, t.dst, t.count, desc.reduce_op, world);
    }
    return absl::OkStatus();
  }
  // Pieces sized so that each reads about piece_bytes from all ranks together.
  const size_t piece_elems = std::max<size_t>(options_.piece_bytes / (item * world), size_t{4096});
  struct Piece {
    const ReduceTask* task;
    size_t first;
    size_t count;
  };
  std::vector<Piece> pieces;
  for (const ReduceTask& t : tasks) {
    for (size_t e = 0; e < t.count; e += piece_elems) {
      pieces.push_back(Piece{&t, e, std::min(piece_elems, t.count - e)});
    }
  }
  pool_->ParallelFor(pieces.size(), [&](size_t i) {
    const Piece& p = pieces[i];
    std::vector<const void*> srcs(p.task->srcs.size());
    for (size_t k = 0; k < srcs.size(); ++k) {
      srcs[k] = static_cast<const uint8_t*>(p.task->srcs[k]) + p.first * item;
    }
    ReduceInto(desc.dtype, srcs, p.task->dst + p.first * item, p.count, desc.reduce_op, world);
  });
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

class InprocCommunicator final : public Communicator {
 public:
  explicit InprocCommunicator(std::shared_ptr<InprocCore> core) : core_(std::move(core)) {}
  ~InprocCommunicator() override {
    core_->Abort(absl::AbortedError("inproc communicator destroyed"), /*quiet=*/true);
  }

  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& o,
                 DoneCallback done) override {
    core_->Arrive(AllGatherCall(in, out, o.unit), o, std::move(done));
  }
  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& o,
                     DoneCallback done) override {
    core_->Arrive(ReduceScatterCall(in, out, op, o.unit), o, std::move(done));
  }
  void Broadcast(MutableBuffer buf, int root, const OpOptions& o, DoneCallback done) override {
    core_->Arrive(BroadcastCall(buf, root, o.unit), o, std::move(done));
  }
  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& o,
              DoneCallback done) override {
    core_->Arrive(GatherCall(in, out, root, o.unit), o, std::move(done));
  }
  void Abort(absl::Status reason) override { core_->Abort(std::move(reason)); }
  absl::Status status() const override { return core_->status(); }
  std::vector<PendingOpInfo> PendingOps() const override { return core_->PendingOps(); }
  absl::string_view backend_name() const override { return "inproc"; }

 private:
  std::shared_ptr<InprocCore> core_;
};

class InprocBackend final : public CollectiveBackend {
 public:
  explicit InprocBackend(const InprocBackendOptions& options)
      : options_(options), timer_(std::make_shared<DeadlineTimer>()) {
    int helpers = options.copy_threads;
    if (helpers < 0) {
      const int hw = static_cast<int>(std::thread::hardware_concurrency());
      helpers = std::clamp(hw - 1, 0, 7);
    }
    pool_ = std::make_shared<WorkerPool>(helpers);
  }

  absl::string_view Name() const override { return "inproc"; }
  bool IsViable() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind != MemoryKind::kCuda; }

  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& group) override {
    FS_RETURN_IF_ERROR(CheckGroupSpec(group));
    if (static_cast<int>(group.local_ranks.size()) != group.world_size) {
      std::vector<int> remote;
      for (int r = 0; r < group.world_size; ++r) {
        if (std::find(group.local_ranks.begin(), group.local_ranks.end(), r) ==
            group.local_ranks.end()) {
          remote.push_back(r);
        }
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", group.group_id, ": the inproc backend needs every rank in this daemon; ",
          FormatRanks(remote), " live elsewhere"));
    }
    FS_LOG(INFO) << "group=" << group.group_id << " inproc communicator for " << group.world_size
                 << " ranks";
    return std::make_unique<InprocCommunicator>(
        std::make_shared<InprocCore>(group, timer_, pool_, options_));
  }

 private:
  const InprocBackendOptions options_;
  // Shared with communicators, which may outlive the backend.
  std::shared_ptr<DeadlineTimer> timer_;
  std::shared_ptr<WorkerPool> pool_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateInprocBackend(
    const InprocBackendOptions& options) {
  return std::make_unique<InprocBackend>(options);
}

}  // namespace flatshard::collective
