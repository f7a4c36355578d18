#pragma once
// TrainerCollectives: small collectives over a group's ranks for trainers (README "Group
// collectives"): AllReduce of a few float32/float64 values (a gradient norm, a flag) and
// Broadcast of bytes from one rank (buffers of sync_module_states). Both run on the group's
// world CollectiveGroup with ops that exist for the shards, so they cross daemons like them:
//
//   1. every rank all-gathers a fixed-size header (what it called, dtype, op, root, size, and
//      why its input is bad, if it is); every rank reaches the same verdict from the same
//      headers, so a rank that passes another size fails every rank with an error naming it,
//      without a collective mismatch that would break the group;
//   2. AllReduce all-gathers the values and every rank reduces them in rank order (the same
//      operations in the same order: bit-identical results on every rank); Broadcast runs the
//      Broadcast op from the root.
//
// Stateless apart from its collaborators; thread-safe. No lock is held across a collective:
// the group's lock only to check the caller and take its CollectiveGroup.

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/rpc_types.h"

namespace flatshard::server {

class GroupTable;

// Element-wise reductions of AllReduce.
enum class ValuesOp : uint8_t { kSum = 1, kMax = 2, kMin = 3 };
// The value types of AllReduce.
enum class ValuesType : uint8_t { kFloat32 = 1, kFloat64 = 2 };

// The largest input of each (bytes per rank): small collectives, not a data path.
inline constexpr uint64_t kMaxAllReduceBytes = uint64_t{1} << 20;
inline constexpr uint64_t kMaxBroadcastBytes = uint64_t{64} << 20;

class TrainerCollectives {
 public:
  // The result's bytes (as many as each rank passed), or the error.
  using BytesCallback = absl::AnyInvocable<void(absl::StatusOr<std::string>)>;

  // `table`, `clock` and `shutting_down` must outlive this object.
  TrainerCollectives(GroupTable* table, Clock* clock, const std::atomic<bool>* shutting_down)
      : table_(table), clock_(clock), shutting_down_(shutting_down) {}

  // Collective: `values` (little-endian values of `type`) reduced element-wise over every
  // rank. Errors: CheckCaller's (this rank alone, at once); INVALID_ARGUMENT on every rank
  // naming the rank whose input is bad (size not a multiple of the value size, over
  // kMaxAllReduceBytes) or differs from rank 0's (call, size, type, op); DEADLINE_EXCEEDED
  // naming the ranks that did not call by `deadline`; the group's sticky error.
  void AllReduce(const Caller& caller, ValuesType type, ValuesOp op, std::string values,
                 absl::Time deadline, BytesCallback done);

  // Collective: rank `root`'s `data` to every rank; each rank passes as many bytes (the
  // others' contents are ignored). Errors as AllReduce (a root out of range, or different
  // on some rank, named).
  void Broadcast(const Caller& caller, int32_t root, std::string data, absl::Time deadline,
                 BytesCallback done);

 private:
  struct Header;
  void Run(const Caller& caller, const Header& mine, std::string data, absl::Time deadline,
           BytesCallback done);

  GroupTable* const table_;
  Clock* const clock_;
  const std::atomic<bool>* const shutting_down_;
};

}  // namespace flatshard::server
