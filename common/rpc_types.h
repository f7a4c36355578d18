#pragma once
// The values ShardService's calls carry, as the daemon and the client library use them: one
// definition each, and one wire mapping each (common/proto_convert.h). The daemon's code
// (GroupManager, the collectives, the GPU contexts) uses these types directly; the client's
// public API (client/include/flatshard/client.h, which must not include this uninstalled
// header) keeps its own identically numbered InitMode, ReduceOp and SummonOptions, bridged to
// these in client.cc (static_asserts there keep the two in step).
//
// Plain values, no dependencies: C++17, thread-compatible.

#include <cstdint>
#include <string>

namespace flatshard {

// How a registration fills the shards (proto InitMode).
enum class InitMode {
  kZeros,          // shards start at zero
  kFromEveryRank,  // every rank writes the full values into the init summon
  kFromRank0,      // rank 0 writes them; the daemons broadcast (FSDP sync_module_states)
};

// How gradients (and every reducing collective) combine over the ranks (proto ReduceOp).
// kAvg is the sum divided by world_size. Also the data plane's op (collective::ReduceOp).
enum class ReduceOp : uint8_t { kSum, kAvg };

// summon_full_params options (proto SummonOptions); defaults as spec/semantics.md §3.
struct SummonOptions {
  bool recurse = true;
  bool writeback = true;
  bool rank0_only = false;
  // GPU daemons: the views are pinned host memory (the all-gather still runs on the GPU).
  // Host daemons: host memory is the only memory, so views are always "offloaded".
  bool offload_to_cpu = false;
  bool with_grads = false;
  // Units with a compute dtype (PlanUnit::compute_dtype) in it: the shard is cast before the
  // all-gather (a summon for forward/backward). Gradients (with_grads) stay full precision.
  bool compute_precision = false;
};

// Identifies the caller of every ShardService call after JoinGroup (proto Caller).
struct Caller {
  std::string group;
  int32_t rank = 0;
  std::string token;
  uint64_t session = 0;
  // Who is calling: the uid the kernel reported for a Unix-socket caller, or -1 (remote
  // callers over TCP; unit tests). Not on the wire: the daemon fills it in. A group answers
  // only callers of the uid that created it.
  int64_t uid = -1;
};

// An interprocess CUDA event (proto CudaEvent): the trainer's "written" event, the daemon's
// "ready" one.
struct IpcEvent {
  uint64_t id = 0;         // unique per creating process; 0: no event
  std::string ipc_handle;  // cudaIpcEventHandle_t bytes
  std::string device_uuid;
};

// Where a buffer's bytes are for the other process (proto MemoryHandle): a range of a shared
// memory segment, or of a CUDA allocation opened through its IPC handle.
struct MemoryHandle {
  std::string segment;  // shm name, or the CUDA allocation's label
  uint64_t segment_bytes = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool cuda = false;  // the fields below are set
  std::string cuda_ipc_handle;
  std::string device_uuid;
  int32_t device = -1;  // the daemon's ordinal (informational)
};

}  // namespace flatshard
