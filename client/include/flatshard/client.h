#pragma once
// flatshard client library: the one public header. C++17 and later.
//
// A trainer process links `flatshard_client`, connects to its node's daemon (flatshardd),
// joins a group, registers its model and then summons (unshards) parameters, reduce-scatters
// gradients and reads its shards. Parameter bytes never travel over gRPC: the daemon keeps
// them in shared-memory segments and the client maps each segment once, caches the mapping
// and hands out views (pointer, shape, dtype) into it. In steady state a summon makes no
// mmap call and copies no parameter bytes.
//
//   flatshard::client::ClientOptions options;
//   options.address = "unix:/run/flatshard/flatshardd.sock";  // or "host:port"
//   FS_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(options));
//   FS_RETURN_IF_ERROR(client->Join("job-17", world_size, rank, token));
//   FS_ASSIGN_OR_RETURN(RegisteredModule model,
//                       client->Register("", manifest_json, policy_json, InitMode::kZeros));
//   {
//     FS_ASSIGN_OR_RETURN(std::unique_ptr<SummonedParams> full,
//                         client->Summon("", "layers.0", SummonOptions()));
//     if (const ParamView* w = full->Find("layers.0.weight")) { ... edit w->data ... }
//     FS_RETURN_IF_ERROR(full->End());  // writes back and reshards; or let it go out of scope
//   }
//
// Errors: every method returns absl::Status or absl::StatusOr. An error of an RPC arrives with
// the gRPC code and message the daemon (or the gRPC runtime) gave, unchanged; the codes are
// those of spec/semantics.md §4. Each RPC has one deadline (ClientOptions::call_timeout, or
// join_timeout for Join). An attempt is retried (exponential backoff, up to max_attempts and
// within that same deadline) only when it cannot have taken effect: it failed with
// UNAVAILABLE from the gRPC runtime (not from the daemon, whose answers are marked) and the
// channel had no connection when it started, so it never reached a daemon (e.g. the daemon is
// restarting). Nothing else is retried: whatever the daemon answers, UNAVAILABLE included
// ("rank 2's session ended ... during a collective"), and a call whose connection broke after
// it was sent, come back as they are.
// Names are bounded (common/limits.h, README "Limits"): group 256 bytes, token 1 KiB, module
// paths 4 KiB, manifest JSON 64 MiB and 200,000 modules, policy JSON 1 MiB; longer input is
// refused with INVALID_ARGUMENT naming the field and the limit, before any RPC.
//
// Sessions and leases: Join opens a `Lease` stream that stays open until Leave or the
// Client's destruction; the daemon ends the session's summons without writeback when it
// closes, also when this process dies. If the lease breaks (the daemon went away), later
// calls fail with FAILED_PRECONDITION quoting why, and the client may Join again.
//
// Thread safety: Client is thread-safe. SummonedParams, PendingReduceScatter, ParamViews and
// ShardViews are thread-compatible: their const methods may run concurrently, End() and
// Finish() need exclusive access. Reads and writes of the mapped bytes are the caller's
// business (the daemon does not touch a summoned buffer until End).
//
// GPU memory: a daemon with the GPU backend keeps shards and unsharded buffers in device
// memory. The client then opens each of the daemon's device allocations once through CUDA IPC
// (cached like shm segments; ipc_open_calls()) and views carry `device`, this process's CUDA
// ordinal of the pointer (-1: host memory). Ordering runs on ClientOptions::cuda_stream, with
// interprocess CUDA events and no host round trip either way:
//   - after Summon and PendingReduceScatter::Finish return, work enqueued on cuda_stream
//     sees the bytes (the views; the updated gradient shard): the client made cuda_stream
//     wait (cudaStreamWaitEvent) on the daemon's `ready` event, or found that event already
//     completed (then nothing is enqueued). The host does not wait: read device views from
//     the stream, not from a host thread that has not synchronized it (a daemon ordering on
//     the device answers a world-1 summon before its copies ran).
//   - before Summon (when the session has device shards: the optimizer may have written
//     them), SummonedParams::End and PendingReduceScatter::Finish, the client records its
//     own interprocess event on cuda_stream and sends it, so the daemon reads nothing before
//     all work enqueued on cuda_stream so far is done, the trainer's writes included. Writes on
//     other streams must be ordered before cuda_stream's by the trainer.
// A session with only host memory never calls CUDA. A process that receives device memory
// but has no usable GPU (or was built without CUDA) fails the call with FAILED_PRECONDITION
// naming the GPU; NOT_FOUND when that GPU is not visible (CUDA_VISIBLE_DEVICES).
//
// Lifetime: a view's pointer stays mapped while the object that handed it out holds the view
// (it keeps the mapping alive, even past Leave or the Client's destruction). End() drops the
// views: the bytes are the daemon's again, and writes after End are lost. Objects may outlive
// their Client; End() then fails (see SummonedParams::End).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "flatshard/dtype.h"
#include "flatshard/plan.h"
#include "flatshard/version.h"

namespace flatshard {

// The planner's output (common/plan.h, internal and C++20). Code built against the installed
// headers reads the same plan through PlanLayout (<flatshard/plan.h>, RegisteredModule::layout).
struct Plan;

namespace client {

namespace internal {
class ClientCore;
class DeviceMemoryOpener;
struct WeightsReaderAccess;
class ModuleLayout;
class RidingEnds;
class ShardViewsBuilder;
class ViewBuilder;
struct SummonJob;
struct FinishJob;
}  // namespace internal

struct ClientOptions {
  // The daemon's gRPC address: "unix:/path/to.sock" or "host:port" (any gRPC target, e.g.
  // "dns:///host:port", is used as given). A filesystem path, i.e. one that contains a '/'
  // ("/run/flatshard/flatshardd.sock", "./d.sock"), means "unix:<path>". Connect refuses
  // anything else (e.g. "d.sock", "host" without a port) at once with INVALID_ARGUMENT.
  std::string address;
  // Deadline of every call but Join, retries included. Collective calls (Register, Summon,
  // End, ReduceScatter) wait for the slowest rank within it.
  absl::Duration call_timeout = absl::Seconds(30);
  // Deadline of JoinGroup, which waits until every rank of the group has joined.
  absl::Duration join_timeout = absl::Seconds(60);
  // Attempts per call that never reached the daemon (see "Errors" above; 1 = no retry).
  int max_attempts = 5;
  // Backoff between attempts: doubles from initial_backoff up to max_backoff, with jitter.
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(1);
  // Mutual TLS for TCP addresses of a daemon started with --tls_cert/--tls_key/--tls_ca:
  // PEM files of the CA that signed the daemon's certificate, and of this client's
  // certificate and key (signed by the CA the daemon trusts). All empty: plaintext. Not used
  // for "unix:" addresses (the daemon learns a local client's uid from the kernel instead).
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // The CUDA stream (a cudaStream_t) the trainer's work on device views runs on; nullptr:
  // the legacy default stream. Used only when the daemon hands out device memory, and then
  // it must belong to the GPU holding that memory (see "GPU memory" above).
  void* cuda_stream = nullptr;
};

// How a registration fills the shards (proto InitMode).
enum class InitMode {
  kZeros,          // shards start at zero
  kFromEveryRank,  // every rank writes the full values into RegisteredModule::init_summon
  kFromRank0,      // rank 0 writes them; the daemons broadcast (FSDP sync_module_states)
};

enum class ReduceOp { kSum, kAvg };

// Client::AllReduce's element-wise reductions.
enum class ValuesReduceOp { kSum, kMax, kMin };

// summon_full_params options; defaults as spec/semantics.md §3.
struct SummonOptions {
  bool recurse = true;
  bool writeback = true;
  bool rank0_only = false;
  bool offload_to_cpu = false;
  bool with_grads = false;
  // FSDP's MixedPrecision.param_dtype for a forward/backward summon: units the plan gives a
  // `compute_dtype` (policy "mixed_precision") are handed out in it; the daemon casts each
  // rank's shard before the all-gather, so the bytes moved and the views are low precision.
  // Units without one (no mixed precision, module_types_to_ignore) come in full precision.
  // Not with writeback or rank0_only (INVALID_ARGUMENT): like FSDP's summon_full_params,
  // state dicts and checkpoints, those are always full precision. Gradients (with_grads)
  // stay full precision.
  bool compute_precision = false;
};

// One parameter (or its gradient) inside a mapped flat buffer.
struct ParamView {
  // First element. Valid while the object that handed out the view lives. Writable only when
  // `writable` (a summon without writeback maps its buffers read-only: writes would fault).
  void* data = nullptr;
  std::vector<int64_t> shape;  // empty for a scalar
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  std::string fqn;
  int32_t unit = -1;  // index of the plan unit holding it
  // For device memory `writable` is the contract only (device memory cannot be mapped
  // read-only): writes to a non-writable view are not written back.
  bool writable = false;
  int device = -1;  // CUDA ordinal (in this process) of `data`; -1: host memory
};

// The views of a set of units, looked up by FQN. Tied FQNs (PlanUnit::shared) are views of
// their own that alias the first FQN's pointer. Keeps the mappings it points into alive.
// Thread-compatible; immutable once built.
class ParamViews {
 public:
  using const_iterator = std::vector<ParamView>::const_iterator;

  ParamViews();  // empty
  ParamViews(ParamViews&&) noexcept;
  ParamViews& operator=(ParamViews&&) noexcept;
  ParamViews(const ParamViews&) = delete;
  ParamViews& operator=(const ParamViews&) = delete;
  ~ParamViews();

  // The view of `fqn`; nullptr when it is in none of these units (or the set is empty).
  // Constant time: the FQN index is built once per registered module, not per summon.
  const ParamView* Find(absl::string_view fqn) const;

  bool empty() const { return views_.empty(); }
  size_t size() const { return views_.size(); }
  const ParamView& operator[](size_t i) const { return views_[i]; }
  // Unit by unit in the order the daemon returned them; within a unit, flat order, then the
  // tied aliases.
  const_iterator begin() const { return views_.begin(); }
  const_iterator end() const { return views_.end(); }

  // The mappings the views point into. Sharing them keeps the bytes mapped after the owner
  // dropped its views (End()), e.g. for a language binding whose arrays outlive the summon;
  // writes after End are still lost.
  const std::vector<std::shared_ptr<const void>>& mappings() const { return keepalive_; }

 private:
  friend class internal::ViewBuilder;

  std::shared_ptr<const internal::ModuleLayout> layout_;
  std::vector<int32_t> first_view_;  // per plan unit position: index into views_, or -1
  std::vector<ParamView> views_;
  std::vector<std::shared_ptr<const void>> keepalive_;  // the mappings views_ point into
};

// A summon in progress (RAII): the full parameters of the summoned units, and their
// gradients under with_grads. Ends the summon exactly once: End(), or else the destructor.
class SummonedParams {
 public:
  SummonedParams(const SummonedParams&) = delete;
  SummonedParams& operator=(const SummonedParams&) = delete;
  // Calls End() unless it was called; logs its error (use End() to see it).
  ~SummonedParams();

  // The parameter `fqn`; nullptr when no summoned unit holds it, on ranks without views, or
  // after End().
  const ParamView* Find(absl::string_view fqn) const { return params_.Find(fqn); }
  // Its gradient; nullptr also without with_grads or while the unit has no gradient yet.
  const ParamView* FindGrad(absl::string_view fqn) const { return grads_.Find(fqn); }
  const ParamViews& params() const { return params_; }
  const ParamViews& grads() const { return grads_; }
  ParamViews::const_iterator begin() const { return params_.begin(); }
  ParamViews::const_iterator end() const { return params_.end(); }

  // False on ranks other than 0 under rank0_only, when nothing was unsharded (see note()),
  // and after End().
  bool has_views() const { return !params_.empty(); }
  // Plan unit indices summoned, also on ranks without views.
  const std::vector<int32_t>& units() const { return units_; }
  // The daemon's remark, e.g. "path is not a unit root: nothing unsharded"; often empty.
  const std::string& note() const { return note_; }
  uint64_t id() const { return id_; }
  const std::string& registered_module() const { return module_; }

  // Ends the summon (collective: every rank ends it): the daemon writes back if the summon
  // asked for it, then reshards. Drops the views. Called twice, returns the first result
  // without calling the daemon again.
  // Device views: first records the trainer's event on ClientOptions::cuda_stream and sends
  // it, so the daemon writes back only after the writes enqueued there.
  // With writeback the End is atomic across the group (spec/semantics.md §3a): it waits for
  // every rank's End, and then every rank's range is written back (and the module's shards
  // committed, see Client::Commit), or, if a rank died (UNAVAILABLE naming it, at once) or
  // missed the deadline (DEADLINE_EXCEEDED naming it), no rank's is. The init summon of a
  // registration commits the initial values the same way; until it did on every rank the
  // module is not usable (Register it again on every rank). A daemon decides it once for all
  // its ranks: if one of them fails its init End although every rank agreed (its agreement
  // torn by a daemon's death), no init End of that daemon's ranks is OK (FAILED_PRECONDITION
  // naming that rank) and none of them sees the module as initialised.
  // Over several daemons with a state directory a failure of the group after every rank's
  // End agreed (a daemon killed, a rank's session ended) may fail the other ranks' End with
  // "the writeback of summon S (generation G) did not complete on this rank: ..."; the shards
  // may then hold G's writes until the next formation, which puts every rank at one
  // generation: G when any rank committed it (rolled forward), else G-1 (rolled back). As
  // after a failed Commit, re-join before writing the shards (README "Restarts").
  // Errors: the RPC's (e.g. DEADLINE_EXCEEDED naming missing ranks, ABORTED); a failed
  // writeback leaves the old shards intact. FAILED_PRECONDITION when the Client was destroyed
  // or left first (the daemon then ended the summon without writeback) or the lease broke.
  // A failed event record (CUDA's error) is returned without calling the daemon: writing back
  // unordered bytes would be worse; the summon then ends with the session.
  absl::Status End();
  // After an End() that succeeded: the committed generation this rank's shards hold (a
  // writeback End commits, so the new one; see Client::Commit). nullopt before End, after a
  // failed End, or when the daemon did not say.
  std::optional<uint64_t> generation() const { return generation_; }

 private:
  friend class internal::ClientCore;
  friend class internal::RidingEnds;
  SummonedParams(std::weak_ptr<internal::ClientCore> core, uint64_t session, std::string module,
                 uint64_t id);

  std::weak_ptr<internal::ClientCore> core_;
  uint64_t session_ = 0;  // the session that summoned; End fails in a later one
  std::string module_;
  uint64_t id_ = 0;
  ParamViews params_;
  ParamViews grads_;
  std::vector<int32_t> units_;
  std::string note_;
  int device_ = -1;        // a device view's ordinal: End() then sends the trainer's `written`
  bool writeback_ = true;  // End() is then a collective
  std::optional<uint64_t> generation_;
  bool ended_ = false;
  absl::Status end_status_;
};

// Summons handed to a Summon that ends them first (Client::Summon's end_first).
using SummonedList = std::vector<std::unique_ptr<SummonedParams>>;

// A summon started by Client::StartSummon: its all-gather runs while the trainer computes.
class PendingSummon {
 public:
  PendingSummon(const PendingSummon&) = delete;
  PendingSummon& operator=(const PendingSummon&) = delete;
  // Waits for the summon unless Wait() was called; a summon that completed but was never
  // taken is ended (its views are dropped, as SummonedParams' destructor does).
  ~PendingSummon();

  // Blocks until the summon completed and returns what Client::Summon would have returned
  // for it: its views, or its error (named as Summon names them). The wait is bounded by the
  // call's deadline (ClientOptions::call_timeout, counted from when the RPC was sent). Once:
  // a second call returns FAILED_PRECONDITION.
  absl::StatusOr<std::unique_ptr<SummonedParams>> Wait();
  // True once Wait() would not block.
  bool ready() const;

 private:
  friend class internal::ClientCore;
  explicit PendingSummon(std::shared_ptr<internal::SummonJob> job);

  std::shared_ptr<internal::SummonJob> job_;
  bool waited_ = false;
};

// Phase one of a gradient reduce-scatter: a writable view of the unit's full (padded) flat
// gradient buffer. Write the gradient, then Finish() reduce-scatters it into the sharded
// gradient.
class PendingReduceScatter {
 public:
  PendingReduceScatter(const PendingReduceScatter&) = delete;
  PendingReduceScatter& operator=(const PendingReduceScatter&) = delete;
  // Without Finish(): logs an error and reduces nothing (the proto has no cancel; the daemon
  // drops the staged gradient with the next Begin for the unit or the session).
  ~PendingReduceScatter();

  int32_t unit() const { return unit_; }
  DType dtype() const { return dtype_; }
  // The whole flat buffer: padded_numel elements; padding is reduced too.
  void* data() const { return data_; }
  int64_t numel() const { return numel_; }
  // CUDA ordinal (in this process) of data(); -1: host memory.
  int device() const { return device_; }
  // Per-parameter views into data(); tied FQNs alias.
  const ParamView* Find(absl::string_view fqn) const { return grads_.Find(fqn); }
  const ParamViews& grads() const { return grads_; }

  // Phase two (collective: every rank of the unit's group calls it): reduce-scatters what was
  // written. Once; a second call returns the first result. Device memory: sends the
  // trainer's event recorded on cuda_stream, and on return cuda_stream waits for the daemon's
  // `ready` (the gradient shard is updated for work enqueued there next).
  // Errors: the RPC's; FAILED_PRECONDITION when the Client is gone or the lease broke; CUDA's
  // (recording or waiting on the events), naming the unit.
  absl::Status Finish();

 private:
  friend class internal::ClientCore;
  PendingReduceScatter(std::weak_ptr<internal::ClientCore> core, uint64_t session,
                       std::string module, int32_t unit, ReduceOp op, bool accumulate);

  std::weak_ptr<internal::ClientCore> core_;
  uint64_t session_ = 0;
  std::string module_;
  int32_t unit_ = -1;
  ReduceOp op_ = ReduceOp::kSum;
  bool accumulate_ = false;
  DType dtype_ = DType::kFloat32;
  void* data_ = nullptr;
  int64_t numel_ = 0;
  int device_ = -1;
  ParamViews grads_;
  bool finished_ = false;
  absl::Status finish_status_;
};

// A reduce-scatter whose phase two Client::StartFinish started: it runs while the trainer
// goes on (e.g. with the backward of the next unit).
class FinishingReduceScatter {
 public:
  FinishingReduceScatter(const FinishingReduceScatter&) = delete;
  FinishingReduceScatter& operator=(const FinishingReduceScatter&) = delete;
  // Waits for the reduce-scatter (it cannot be cancelled: the other ranks take part).
  ~FinishingReduceScatter();

  int32_t unit() const { return unit_; }
  // Blocks until phase two completed and returns what PendingReduceScatter::Finish would
  // have; bounded by the call's deadline. Later calls return the same result.
  absl::Status Wait();
  // True once Wait() would not block.
  bool ready() const;

 private:
  friend class internal::ClientCore;
  FinishingReduceScatter(std::shared_ptr<internal::FinishJob> job, int32_t unit);

  std::shared_ptr<internal::FinishJob> job_;
  int32_t unit_ = -1;
};

// Optimizer state (Client::RegisterState): named buffers the daemon keeps next to each of this
// rank's shards, per unit, with the shard's placement and lifetime, committed and rolled back
// with the shards (Client::Commit).
enum class StateShape {
  kShard,   // as many elements as the unit's shard (shard_numel): exp_avg, momentum_buffer
  kScalar,  // one element per unit and rank: Adam's step
};

// One state of a spec. `name`: non-empty, at most 128 bytes of letters, digits, '_' and '.',
// unique within the spec.
struct StateSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  StateShape shape = StateShape::kShard;
};

// One unit's buffer of one state on this rank: `numel` elements of `dtype` at `data`
// (writable, zeros when the daemon allocated it).
struct StateView {
  std::string name;
  DType dtype = DType::kFloat32;
  StateShape shape = StateShape::kShard;
  int64_t numel = 0;  // shard_numel for kShard, 1 for kScalar
  void* data = nullptr;
  int device = -1;  // CUDA ordinal (in this process) of `data`; -1: host memory
};

// One unit's shard on this rank: shard_numel elements of the unit's padded flat buffer,
// starting at element shard_offset. Writable (the optimizer updates shards in place).
struct UnitShardView {
  int32_t unit = -1;
  DType dtype = DType::kFloat32;
  int64_t shard_numel = 0;
  int64_t shard_offset = 0;  // ShardRank(rank) * shard_numel
  void* data = nullptr;
  void* grad = nullptr;  // the gradient shard; nullptr until a gradient exists
  int device = -1;       // CUDA ordinal (in this process) of `data` and `grad`; -1: host
  // The optimizer state buffers of the unit, in the order of ShardViews::state_specs();
  // empty while the module has no state registered (Client::RegisterState).
  std::vector<StateView> states;
  // The state named `name`; nullptr when there is none.
  const StateView* state(absl::string_view name) const {
    for (const StateView& v : states) {
      if (v.name == name) return &v;
    }
    return nullptr;
  }
};

// This rank's shards of a registered module, sorted by unit. Keeps the mappings alive.
class ShardViews {
 public:
  ShardViews();
  ShardViews(ShardViews&&) noexcept;
  ShardViews& operator=(ShardViews&&) noexcept;
  ShardViews(const ShardViews&) = delete;
  ShardViews& operator=(const ShardViews&) = delete;
  ~ShardViews();

  // nullptr when this rank holds no shard of `unit`.
  const UnitShardView* Find(int32_t unit) const;
  const std::vector<UnitShardView>& units() const { return units_; }
  std::vector<UnitShardView>::const_iterator begin() const { return units_.begin(); }
  std::vector<UnitShardView>::const_iterator end() const { return units_.end(); }
  // The mappings the views point into (see ParamViews::mappings).
  const std::vector<std::shared_ptr<const void>>& mappings() const { return keepalive_; }

  // The committed generation the shards held when the daemon answered (0: the initial
  // values; see Client::Commit).
  uint64_t generation() const { return generation_; }
  // The module's optimizer state spec (Client::RegisterState): the order of each unit's
  // states. Empty when no state is registered on this rank's daemon.
  const std::vector<StateSpec>& state_specs() const { return state_specs_; }

 private:
  friend class internal::ClientCore;
  friend class internal::ShardViewsBuilder;
  std::vector<UnitShardView> units_;
  uint64_t generation_ = 0;
  std::vector<StateSpec> state_specs_;
  std::vector<std::shared_ptr<const void>> keepalive_;
};

struct RegisteredModule {
  std::string module;  // the path given to Register
  // The plan every rank agreed on (fingerprints compared by the daemons), in the internal
  // type of the source tree (common/plan.h); installed headers do not define it.
  std::shared_ptr<const Plan> plan;
  // The same plan as public values, seen from this session's rank: units, parameters with
  // offsets, sizes and every rank's shard range (<flatshard/plan.h>). Never null after a
  // successful Register.
  std::shared_ptr<const PlanLayout> layout;
  ShardViews shards;
  // kFromEveryRank, kFromRank0: the registration left an init summon open (writeback on):
  // fill the views (on rank 0 only, for kFromRank0), then End() it on every rank. nullptr
  // for kZeros.
  std::unique_ptr<SummonedParams> init_summon;
  // The committed generation the shards hold (0: the initial values; see Client::Commit).
  // A re-attaching trainer resumes from this step.
  uint64_t generation = 0;
};

// ---- Published weights (README "Publishing weights") ----
// A training group publishes its committed step (Client::Publish) as version V of a name;
// readers that are not members of the group (WeightsReader) open it read-only and zero-copy.

// How Client::Publish builds and grants a version.
struct PublishOptions {
  // Cast floating parameters to this dtype (kFloat32, kFloat16 or kBFloat16); nullopt: each
  // tensor keeps the dtype it trains in.
  std::optional<DType> dtype;
  // uids besides the publisher's own (the group's) that may open the versions.
  std::vector<int64_t> reader_uids;
  // Non-empty: a reader presenting it (OpenWeightsOptions::token) may open them, whatever
  // its uid, also over TCP.
  std::string reader_token;
  // >= 0: the version goes to device memory of the daemon's GPU with this ordinal (as the
  // daemon numbers its GPUs: --gpus, --simulate_gpus) instead of host shared memory; readers
  // open it through CUDA IPC (README "Versions in GPU memory"). Such a version is read by the
  // publisher's uid only (reader_uids and reader_token must be empty), counts against the
  // uid's --gpu_memory_quota_mib_per_uid and does not survive a daemon restart. A group on
  // several daemons gets it in this GPU of each of its daemons. -1: host.
  int device = -1;
};

// One published version; also what WeightsReader::WaitForVersion and List report.
struct PublishedVersion {
  std::string name;
  int64_t owner_uid = -1;   // names are scoped by their publisher's uid
  uint64_t version = 0;     // 1, 2, ... per (owner_uid, name); never reused
  uint64_t generation = 0;  // the module's committed generation it holds
  int64_t bytes = 0;        // the version's segment: tensors and alignment
  int32_t tensors = 0;      // state_dict keys (tied parameters count under every key)
  int device = -1;          // the daemon's GPU holding it (PublishOptions::device); -1: host
};

// A connection to one daemon. Thread-safe. One gRPC channel and stub per Client, one
// session (group, rank) at a time.
class Client {
 public:
  // Creates the channel and waits up to call_timeout until it connects.
  // Errors: INVALID_ARGUMENT for an empty or malformed address (see ClientOptions::address),
  // non-positive timeouts or max_attempts < 1;
  // UNAVAILABLE when the daemon cannot be reached in time.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  // Closes the lease (the daemon ends the session's open summons without writeback; the
  // shards stay) and waits until the daemon confirms the session ended, at most
  // min(call_timeout, 5 s), so a new Client may Join the same rank at once. Makes no other
  // call to the daemon.
  ~Client();

  // Joins rank `rank` of `group`; waits (join_timeout) until every rank has joined, then
  // opens the lease, whose first message carries the session's Caller. Forgets the cached
  // mappings of an earlier session. A daemon that refuses the lease later ends it: later
  // calls then fail as described at the top.
  // Errors: INVALID_ARGUMENT for an empty group, world_size < 1 or rank outside
  // [0, world_size); FAILED_PRECONDITION when already joined (Leave first); the RPC's,
  // e.g. DEADLINE_EXCEEDED naming the missing ranks, PERMISSION_DENIED for a bad token,
  // FAILED_PRECONDITION naming two daemons of the group started with different
  // --ucx_hierarchical (every rank's Join fails so); the lease's when the daemon refused it at
  // once.
  // Multi-daemon groups (ranks on several nodes, each joining through its node's daemon):
  // `coordinator` is the peer address (host:port, the daemon's --peer_address) of the
  // group's coordinator daemon, normally rank 0's, the same on every rank. Empty: every rank
  // of the group joins this client's daemon.
  absl::Status Join(std::string group, int world_size, int rank, std::string token,
                    std::string coordinator = "");

  // Module paths the group had registered before this session joined (re-attach after a
  // crash: Register them again to get their plans and views). Empty before Join.
  std::vector<std::string> registered_modules() const;
  // Groups over several daemons: modules whose shards a daemon of the group lost (it was
  // restarted), one line each naming the ranks and daemons; they were dropped on every daemon
  // and must be registered afresh (Register then initialises them again). Empty before Join.
  // A daemon killed during a module's initialisation (before any step was committed) loses
  // nothing: the initialisation is undone on every daemon, the module is not listed here, and
  // every rank's next Register runs it again (an init summon for the FROM_* modes), also on a
  // rank whose init End or kZeros Register was answered before the kill (README "Restarts").
  std::vector<std::string> lost_modules() const;

  // Collective: registers a model at `module` ("" = whole model) with a manifest and policy
  // in their JSON forms (spec/formats.md). Both are parsed here first, so bad input fails
  // with the same INVALID_ARGUMENT message as `flatshardctl plan`, before any RPC.
  // HYBRID_SHARD and _HYBRID_SHARD_ZERO2 shard within a node, the ranks of one daemon (the
  // plan's shard_world_size: the group's ranks per daemon; a group on one daemon is one node).
  // Errors: INVALID_ARGUMENT for bad JSON; FAILED_PRECONDITION when not joined, or for a
  // HYBRID_* policy on a group whose daemons host unequal numbers of ranks or ranks that are
  // not consecutive (naming the group, the nodes and their ranks); the RPC's
  // (ALREADY_EXISTS, plan mismatch across ranks, RESOURCE_EXHAUSTED, ...); INTERNAL when the
  // daemon's reply is unusable (bad plan or memory handles).
  absl::StatusOr<RegisteredModule> Register(std::string module, absl::string_view manifest_json,
                                            absl::string_view policy_json, InitMode init);

  // Collective: unshards the units at `path` inside `registered_module` (spec/semantics.md
  // §3) and returns their views. The result ends the summon when destroyed.
  // REQUIRES: this client registered `registered_module` in the current session.
  // Errors: NOT_FOUND for a module this client did not register; FAILED_PRECONDITION when
  // not joined, or from the daemon (unit in forward/backward, already summoned); the RPC's;
  // errors mapping the daemon's segments (the summon is then ended before returning);
  // device memory: FAILED_PRECONDITION / NOT_FOUND naming the GPU this process cannot use,
  // and CUDA's errors recording `written` (before the RPC) or waiting on `ready`.
  absl::StatusOr<std::unique_ptr<SummonedParams>> Summon(const std::string& registered_module,
                                                         const std::string& path,
                                                         const SummonOptions& options = {});

  // One round trip per unit transition (FSDP's reshard of the unit that ran, then unshard of
  // the next): ends `end_first`, then summons as above, in one request; the End rides on the
  // Summon (SummonRequest.end_first) and the daemon frees its buffers before this summon
  // takes buffers of its own. Summons travel as messages on the Client's transition lane (one
  // gRPC stream, proto/flatshard/v1/transition_lane.proto; README "The transition lane"),
  // else as unary calls; the daemon runs both alike.
  // `end_first` is ended whatever the outcome: its views are
  // dropped here, before the RPC, and if the Summon fails the client ends it on its own (a
  // plain End, whose error is only logged) unless the daemon already did.
  // Only a read-only summon of this Client's current session rides along. A writeback one
  // (whose End is a collective with a result of its own) is ended by its own End() first,
  // and that End's error is returned without summoning; a read-only one of another Client or
  // an earlier session is ended by its End() (an error only logged). nullptr or an ended
  // summon: the same as Summon(registered_module, path, options).
  // Errors: Summon's, and the End's of `end_first`, which then fails the summon too (the
  // daemon starts no summon after a failed End).
  absl::StatusOr<std::unique_ptr<SummonedParams>> Summon(const std::string& registered_module,
                                                         const std::string& path,
                                                         const SummonOptions& options,
                                                         std::unique_ptr<SummonedParams> end_first);
  // The same with several summons to end first (e.g. a unit and the root unit that holds it,
  // whose forwards finished together), in their order; at most kMaxEndFirst (64) ride on the
  // RPC, the rest are ended on their own first. Null entries are skipped.
  absl::StatusOr<std::unique_ptr<SummonedParams>> Summon(const std::string& registered_module,
                                                         const std::string& path,
                                                         const SummonOptions& options,
                                                         SummonedList end_first);

  // Collective, asynchronous: starts Summon(registered_module, path, options) and returns at
  // once; PendingSummon::Wait() gives its result. Use it to prefetch: start the next unit's
  // all-gather, compute, then wait (FSDP's forward and backward prefetch).
  // Order: every rank must issue its collectives in one order, so the calls this client makes
  // after StartSummon that act on the group (Summon, StartSummon, StartFinish,
  // PendingReduceScatter::Finish, a writeback SummonedParams::End, Commit, Register,
  // RegisterState, Join, Leave, SaveCheckpoint, LoadCheckpoint, AllReduce, Broadcast) go after
  // the calls started before them: the started ones run after them, the others first wait
  // for them. BeginReduceScatter waits only for its unit's started phase two (see there); a
  // read-only End (local to the daemon), GetShardViews, Ping-like reads and the views
  // themselves never wait.
  // Device shards: `written` is recorded on cuda_stream here, at the start; the trainer's
  // stream is made to wait for the daemon's `ready` before Wait() returns.
  // Errors: those Summon finds before any RPC are returned here (NOT_FOUND for a module this
  // client did not register, FAILED_PRECONDITION when not joined, INVALID_ARGUMENT for a path
  // over the limit, CUDA's recording `written`); everything else arrives at Wait().
  absl::StatusOr<std::unique_ptr<PendingSummon>> StartSummon(const std::string& registered_module,
                                                             const std::string& path,
                                                             const SummonOptions& options = {});
  // StartSummon with `end_first` ended by the same RPC, as Summon(..., end_first) (its views
  // are dropped here; the End goes with the started summon, in order).
  absl::StatusOr<std::unique_ptr<PendingSummon>> StartSummon(
      const std::string& registered_module, const std::string& path, const SummonOptions& options,
      std::unique_ptr<SummonedParams> end_first);
  absl::StatusOr<std::unique_ptr<PendingSummon>> StartSummon(const std::string& registered_module,
                                                             const std::string& path,
                                                             const SummonOptions& options,
                                                             SummonedList end_first);

  // Phase one of a gradient reduce-scatter for plan unit `unit`: returns where to write the
  // full gradient. `op` and `accumulate` (add into the sharded gradient instead of
  // overwriting it) are sent with both phases. With NO_SHARD (a plan whose shard_world_size
  // is 1) the reduction is an all-reduce over the group: every rank's gradient shard, the
  // whole unit, holds the sum (or average) of every rank's gradient. With HYBRID_* over
  // several daemons (1 < shard_world_size < world size) every rank's gradient shard holds
  // the sum over every rank of the group of its gradient restricted to that shard (FSDP's
  // reduce-scatter within the node then all-reduce across nodes); AVG divides by the world
  // size. The full gradient is the whole padded unit in every case.
  // Order: phase one runs no collective, so it does not wait for the summons and other units'
  // phase twos started before it (StartSummon, StartFinish): their all-gathers and
  // reduce-scatters go on while the trainer writes this gradient. It waits only for the last
  // phase two of the same module and unit started before it (and, as started calls complete
  // in order, for the calls started before that one), so the buffer it returns is never one
  // a running phase two still reads: that reduce-scatter's values are never mixed with this
  // gradient's.
  // Errors: NOT_FOUND for an unknown module or unit; FAILED_PRECONDITION when not joined;
  // the RPC's.
  absl::StatusOr<std::unique_ptr<PendingReduceScatter>> BeginReduceScatter(
      const std::string& registered_module, int32_t unit, ReduceOp op, bool accumulate);

  // Phase two, asynchronously (collective): starts `pending`->Finish() and returns at once;
  // FinishingReduceScatter::Wait() gives its result. The gradient shard is updated once Wait()
  // returned OK (read it, or step the optimizer, only then). Ordered with this client's other
  // group calls as StartSummon: it is sent after the calls started before it, and later calls
  // that act on the group wait for it; a later BeginReduceScatter only if it is of the same
  // module and unit. Device memory: `written` is recorded on cuda_stream when the
  // RPC is sent, and cuda_stream waits for the daemon's `ready` before Wait() returns.
  // Errors: FAILED_PRECONDITION for a null or already finished `pending` (at once).
  absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> StartFinish(
      std::unique_ptr<PendingReduceScatter> pending);

  // Both phases: BeginReduceScatter, `fill` writes the gradient, Finish. When `fill` fails,
  // returns its error and does not reduce (see ~PendingReduceScatter).
  absl::Status ReduceScatterGrads(const std::string& registered_module, int32_t unit, ReduceOp op,
                                  bool accumulate,
                                  absl::FunctionRef<absl::Status(PendingReduceScatter&)> fill);

  // Local: this rank's shards and gradient shards of `registered_module`, for the optimizer,
  // and the committed generation they hold (ShardViews::generation()). Each unit's `states`
  // are its optimizer state buffers when the module has state (RegisterState), in the order
  // of ShardViews::state_specs(); Register's re-attach returns them the same way.
  // Errors: as BeginReduceScatter; FAILED_PRECONDITION for a module whose initialisation did
  // not commit on every rank (Register it again on every rank); UNAVAILABLE while the
  // shards are being rolled back. After a failure, the shards roll back when every rank has
  // joined again: read the views again after that (before committing, see Commit).
  absl::StatusOr<ShardViews> GetShardViews(const std::string& registered_module);

  // Collective: closes the current training step of `registered_module` (call it on every
  // rank after the optimizer updated the shards in place). Returns the generation just
  // committed. Crash consistency (spec/semantics.md §3a):
  // - A step commits on every rank or on none. After any failure of the group's collectives
  //   (a rank died or left, a deadline, a daemon lost), the group re-forms once every rank
  //   has joined again and every rank's shards are rolled back to the last committed
  //   generation; Register (re-attach) and GetShardViews report it (generation()). A step
  //   another rank committed while this rank's answer was lost (its daemon was killed after
  //   the agreement) is that generation: this rank's shards, which voted for it, are rolled
  //   forward to it. So after a failed Commit do not write the shards before re-joining.
  // - An End() with writeback also commits (the writeback applies on every rank or none).
  // - After a failure, every rank (also the survivors) reads its views again with
  //   GetShardViews or Register before it commits, and redoes the steps since the reported
  //   generation. A Commit from a rank that did not is refused on every rank and rolls
  //   every rank back, so in-place writes that straddle a rollback are never committed.
  // - GPU daemons (kill -9): a daemon killed before its host copy of the last committed
  //   generation G was complete comes back at G-1; a group of GPU daemons then re-forms with
  //   every rank at G-1 (restored from their host copies), so the reported generation may be
  //   one before the last Commit answered: redo step G (README "Restarts", GPU daemons).
  // Errors: UNAVAILABLE naming the rank whose session ended (at once, not at the deadline);
  // DEADLINE_EXCEEDED naming the ranks that did not call; FAILED_PRECONDITION for a stale
  // rank (named), an uninitialised module, or when not joined; NOT_FOUND for a module this
  // client did not register. No rank commits when the agreement refuses the step (a refusal
  // names the refusing rank); when the agreement itself fails (a daemon killed), the step
  // may have committed elsewhere: generation() after the re-form says which.
  absl::StatusOr<uint64_t> Commit(const std::string& registered_module);

  // Local (not collective): the optimizer state of `registered_module` for this rank. The
  // daemon allocates, per unit and state of `specs`, a buffer next to this rank's shard (same
  // memory kind and GPU; kShard: shard_numel elements, kScalar: one), zero-filled, and keeps
  // it as long as the shard: it survives this process (a restarted trainer calls
  // RegisterState with the same spec and gets the same buffers and values back), is never
  // decommitted, and is freed with the module. State is part of the committed step like the
  // shards: Commit (and an End with writeback) commits it, a rollback restores it; a Commit
  // before this rank registered state commits none of it, and state registered after the
  // last commit rolls back to zeros. Returns the shard views with their states (as
  // GetShardViews, except that it does not count as reading the views again after a
  // rollback: call GetShardViews or Register for that, see Commit).
  // The first RegisterState of the module on this rank's daemon fixes its spec for every rank
  // there; later calls must pass the same spec.
  // Errors: INVALID_ARGUMENT naming the bad field (specs[i].name, an empty spec), before any
  // RPC; FAILED_PRECONDITION naming the first differing state and field when the module has
  // another spec; otherwise those of GetShardViews; RESOURCE_EXHAUSTED when the daemon
  // cannot allocate the buffers (it keeps none).
  absl::StatusOr<ShardViews> RegisterState(const std::string& registered_module,
                                           const std::vector<StateSpec>& specs);

  // ---- Group collectives (README "Group collectives") ----
  // Collective over every rank of the group (each rank calls it; the daemons answer every
  // rank alike): `values` replaced by their element-wise reduction over the ranks. The
  // ranks' values are reduced in rank order, so every rank gets bit-identical results (e.g.
  // a global gradient norm). For small inputs: at most 1 MiB per rank. Ordered with this
  // client's other group calls (see StartSummon).
  // Errors: INVALID_ARGUMENT on every rank naming the rank that passed another count, value
  // type or op than rank 0 (or over 1 MiB); DEADLINE_EXCEEDED naming the ranks that did not
  // call within ClientOptions::call_timeout; FAILED_PRECONDITION when not joined; the group's
  // error (UNAVAILABLE, ABORTED) when a rank's session ended meanwhile.
  absl::Status AllReduce(float* values, size_t count, ValuesReduceOp op = ValuesReduceOp::kSum);
  absl::Status AllReduce(double* values, size_t count, ValuesReduceOp op = ValuesReduceOp::kSum);
  // Collective: `data` (`bytes` bytes on every rank) replaced by rank `root`'s on every rank
  // (e.g. module buffers of FSDP's sync_module_states). At most 64 MiB. Errors as AllReduce
  // (a `root` out of range or differing between ranks is named).
  absl::Status Broadcast(void* data, size_t bytes, int root);

  // ---- Published weights (README "Publishing weights") ----
  // Collective (every rank of the group calls it with the same arguments, like Commit):
  // publishes the last *committed* generation of `registered_module` as the next version of
  // `name` (scoped by the group's uid). The daemon builds the version from the committed
  // copies, not the live shards, so the trainer may go on at once after it returns: the full
  // unsharded parameters in the unwrapped module's state_dict layout (FQN -> tensor, padding
  // dropped, tied parameters under every key, sharing bytes), cast to options.dtype, in one
  // read-only shared-memory segment. The version becomes visible only once complete; a
  // publisher or daemon killed mid-publish leaves no part of it. The daemon keeps the newest
  // --weights_keep versions of each name plus those a reader holds.
  // Errors: INVALID_ARGUMENT for an empty or over-long name, a non-floating options.dtype or
  // ranks passing different arguments (naming the rank and field); NOT_FOUND for a module
  // the group has not registered; FAILED_PRECONDITION when not joined; RESOURCE_EXHAUSTED
  // naming the uid, the quota and its usage when the version does not fit the uid's quota or
  // the daemon's memory limit (nothing is published); DEADLINE_EXCEEDED naming the ranks that
  // did not call (a group on several daemons: naming the daemon whose ranks did not call, or
  // the leader, rank 0's daemon, that did not read this daemon's shards). A group on several
  // daemons gets the version on every one of them (README "Published weights across
  // daemons"). options.device (a version in GPU memory): INVALID_ARGUMENT for a negative
  // ordinal or non-empty reader_uids/reader_token; FAILED_PRECONDITION naming the GPU when
  // the daemon does not use it (a group on several daemons: on every rank, naming the daemon
  // that lacks it; nothing is published anywhere); RESOURCE_EXHAUSTED naming the uid for
  // --gpu_memory_quota_mib_per_uid (and the GPU's pool limit).
  absl::StatusOr<PublishedVersion> Publish(const std::string& registered_module,
                                           const std::string& name,
                                           const PublishOptions& options = {});

  // Leaves the group (the shards stay; the rank can join again) and closes the lease. The
  // session is over even when the RPC fails; its error is returned.
  // Errors: FAILED_PRECONDITION when not joined; the RPC's.
  absl::Status Leave();

  // True between a successful Join and Leave, also when the lease has since broken.
  bool joined() const;
  // OK while the lease is open (or before Join); why it ended otherwise.
  absl::Status lease_status() const;
  // Segments mapped by this client so far (an mmap each). Steady state: constant.
  int64_t segment_map_calls() const;
  // Device allocations of the daemon opened through CUDA IPC by this client so far (one per
  // allocation, shared by every view into it). Steady state: constant.
  int64_t ipc_open_calls() const;
  const ClientOptions& options() const;

  // ---- Checkpoints (README "Checkpoints") ----
  // What a save or load did.
  struct CheckpointInfo {
    uint64_t generation = 0;  // saved: the checkpoint's; loaded: the module's from now on
    int64_t bytes = 0;
    int32_t files = 0;
    int32_t ranks = 0;           // the daemon's ranks saved or loaded
    int64_t unused_tensors = 0;  // load: tensors of the source the module does not have
    std::string path;
  };
  // Called with (bytes done, bytes in all) while a checkpoint runs (on the calling thread).
  using CheckpointProgressFn = std::function<void(int64_t done, int64_t total)>;
  // Asks this client's daemon to write the committed step of `registered_module` of the
  // joined group to directory `dir` (absolute, on the daemon's host; created if missing):
  // flatshard.checkpoint/1, every rank's file in parallel, metadata.json last. Not
  // collective: one rank asks (e.g. rank 0); the others may go on training (a commit that
  // lands during the write waits for it). Errors: the daemon's (AdminService.SaveCheckpoint),
  // FAILED_PRECONDITION when not joined.
  absl::StatusOr<CheckpointInfo> SaveCheckpoint(const std::string& registered_module,
                                                const std::string& dir,
                                                const CheckpointProgressFn& progress = nullptr);
  // Loads checkpoint directory `dir` into `registered_module` (any world size or wrap policy:
  // resharded by parameter FQN). A committed step: every rank must read its views again
  // (GetShardViews or Register) before it commits. Not collective: one rank asks, with no
  // summon of the module open on any rank.
  absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& registered_module,
                                                const std::string& dir,
                                                const CheckpointProgressFn& progress = nullptr);
  // As LoadCheckpoint from a safetensors file of the full model (keys: the unwrapped module's
  // state_dict FQNs): initial values, or a full state dict.
  absl::StatusOr<CheckpointInfo> ImportSafetensors(const std::string& registered_module,
                                                   const std::string& file,
                                                   const CheckpointProgressFn& progress = nullptr);

 private:
  friend class internal::ClientCore;  // creates Clients with test doubles of the GPU APIs
  explicit Client(std::shared_ptr<internal::ClientCore> core);

  std::shared_ptr<internal::ClientCore> core_;
};

// One tensor of an open version: read-only bytes in the version's mapping.
struct WeightsTensor {
  std::string name;  // the state_dict key (FQN)
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;  // empty for a scalar
  // Host versions: mapped PROT_READ (writes fault). Device versions: a device pointer into
  // the daemon's memory mapped through CUDA IPC, which cannot be write-protected: never write.
  const void* data = nullptr;
  int64_t bytes = 0;
  int device = -1;  // CUDA ordinal in this process of a device version's GPU; -1: host memory
};

// An open version (WeightsReader::Open): holds the reader's lease on it and the read-only
// mapping while alive, so its tensors stay valid and the daemon never frees or changes the
// bytes. Thread-compatible: const methods may run concurrently; Release needs exclusive access.
class WeightsVersion {
 public:
  WeightsVersion(const WeightsVersion&) = delete;
  WeightsVersion& operator=(const WeightsVersion&) = delete;
  // Releases (see Release).
  ~WeightsVersion();

  const PublishedVersion& info() const { return info_; }
  // In the order the daemon built them: plan units in order, each unit's parameters in flat
  // order, then the tied aliases.
  const std::vector<WeightsTensor>& tensors() const { return tensors_; }
  // The tensor of state_dict key `fqn`; nullptr when there is none.
  const WeightsTensor* Find(absl::string_view fqn) const;
  // The mapping the tensors point into: sharing it keeps the bytes mapped after Release
  // (e.g. for a language binding's arrays, which then do not crash); the lease still ends at
  // Release, and the daemon may then copy a newer version of the name into the same segment
  // (it reuses the segments of versions no reader holds): read only while the lease is held.
  const std::shared_ptr<const void>& mapping() const { return mapping_; }

  // Ends the lease (the daemon may then free the version once it is no longer among the
  // newest) and drops this object's hold on the mapping; tensors() stay valid only while
  // mapping() is shared elsewhere. Idempotent. Errors: none today (OK).
  absl::Status Release();

 private:
  friend class WeightsReader;
  WeightsVersion() = default;
  struct Lease;

  PublishedVersion info_;
  std::vector<WeightsTensor> tensors_;
  std::shared_ptr<const void> mapping_;
  std::unique_ptr<Lease> lease_;
};

// Which version WeightsReader opens or watches.
struct OpenWeightsOptions {
  std::optional<uint64_t> version;  // nullopt: the latest
  int64_t owner_uid = -2;           // the publisher's uid; -2: the caller's own uid
  std::string token;                // a reader token the publisher granted (TCP readers too)
};

// A reader of published weights: a connection to the node's daemon that is no member of any
// group (no Join). Thread-safe.
class WeightsReader {
 public:
  // Creates the channel and waits up to call_timeout until it connects. Errors: as
  // Client::Connect.
  static absl::StatusOr<std::unique_ptr<WeightsReader>> Connect(ClientOptions options);
  WeightsReader(const WeightsReader&) = delete;
  WeightsReader& operator=(const WeightsReader&) = delete;
  // Open versions stay open (they hold their own lease stream).
  ~WeightsReader();

  // Opens a version of `name` (latest, or options.version) read-only: maps its segment once
  // (O_RDONLY, PROT_READ) and holds a lease on it until the returned object is released or
  // destroyed, or this process dies (SIGTERM of the daemon ends the lease's stream at once;
  // the mapping stays valid until released). No bytes are copied. A version in the daemon's
  // GPU memory (PublishedVersion::device >= 0) is opened through CUDA IPC instead: its
  // tensors are device pointers on this process's ordinal of that GPU (WeightsTensor::device);
  // the reader opens each pool slab once while versions in it are open.
  // Errors: NOT_FOUND naming the owner uid and name, or the version (and which versions
  // exist); PERMISSION_DENIED when the caller's uid or token is not granted; the RPC's;
  // the mapping's (e.g. PERMISSION_DENIED, NOT_FOUND naming the segment); for a device
  // version, FAILED_PRECONDITION naming the version and GPU when this process has no usable
  // GPU (or was built without CUDA), NOT_FOUND when it cannot see that GPU.
  absl::StatusOr<std::unique_ptr<WeightsVersion>> Open(const std::string& name,
                                                       const OpenWeightsOptions& options = {});
  // Blocks until a version of `name` newer than `after` exists and returns it (at once when
  // one already does); options.version is ignored. With --weights_sources the daemon follows
  // the name at its sources meanwhile; the version returned is copied there (README "Readers
  // on other nodes"). Errors: DEADLINE_EXCEEDED after `timeout`; PERMISSION_DENIED as Open;
  // UNAVAILABLE "flatshardd is shutting down" at once if SIGTERM stops it; the RPC's.
  absl::StatusOr<PublishedVersion> WaitForVersion(const std::string& name, uint64_t after,
                                                  absl::Duration timeout,
                                                  const OpenWeightsOptions& options = {});
  // Every version this caller may open (its own uid's, and those granted to its uid), newest
  // last per name. Errors: the RPC's.
  absl::StatusOr<std::vector<PublishedVersion>> List();

  const ClientOptions& options() const { return options_; }

 private:
  friend struct internal::WeightsReaderAccess;  // tests: another DeviceMemoryOpener
  struct Channel;
  WeightsReader(ClientOptions options, std::unique_ptr<Channel> channel);
  static absl::StatusOr<std::unique_ptr<WeightsReader>> Connect(
      ClientOptions options, std::unique_ptr<internal::DeviceMemoryOpener> opener);

  ClientOptions options_;
  std::unique_ptr<Channel> channel_;
};

}  // namespace client
}  // namespace flatshard
