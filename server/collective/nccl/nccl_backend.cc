#include "server/collective/nccl/nccl_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/gpu/cuda_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/op_descriptor.h"

namespace flatshard::collective {

absl::Status NcclStatus(int result, absl::string_view what, absl::string_view last_error) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(r));
  if (!last_error.empty()) absl::StrAppend(&message, ": ", last_error);
  switch (r) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<std::string> MakeNcclUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclStatus(r, "ncclGetUniqueId", ncclGetLastError(nullptr));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

namespace {

constexpr size_t kWire = sizeof(WireDescriptor);

// `r` as a status, with the communicator's last error text.
absl::Status NcclCheck(ncclResult_t r, absl::string_view what, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return NcclStatus(r, what, ncclGetLastError(comm));
}

std::optional<ncclDataType_t> NcclFloatType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat64:
      return ncclFloat64;
    default:
      return std::nullopt;
  }
}

// Host buffers are refused when the op arrives, so a wrong kind never reaches NCCL.
absl::Status CheckCudaKinds(const OpCall& call, int rank, uint64_t op_seq) {
  const bool needs_out = call.desc.kind != CollectiveKind::kGather || rank == call.desc.root;
  auto refuse = [&](absl::string_view which, MemoryKind kind) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " op_seq ", op_seq, " ", FormatOp(call.desc),
        ": the NCCL backend needs cuda memory, but the ", which, " is ", MemoryKindName(kind)));
  };
  if (call.in.bytes > 0 && call.in.kind != MemoryKind::kCuda) return refuse("input", call.in.kind);
  if (needs_out && call.out.bytes > 0 && call.out.kind != MemoryKind::kCuda) {
    return refuse("output", call.out.kind);
  }
  return absl::OkStatus();
}

// One rank's call waiting for, or taking part in, its op.
struct Arrival {
  int rank = 0;
  OpCall call;
  DoneCallback done;
  absl::Time arrived_at;
  absl::Time deadline;
};

// Every local rank's call at one op_seq.
struct Slot {
  OpDescriptor desc;  // the first arrival's
  int first_rank = 0;
  std::string name;
  absl::Time first_arrival;
  std::vector<std::optional<Arrival>> arrivals;  // by local index
  int arrived = 0;
  bool running = false;  // taken by the group's thread
};

// An op the group's thread runs: every local rank's call, by local index.
struct Batch {
  uint64_t op_seq = 0;
  OpDescriptor desc;
  std::string name;
  std::vector<Arrival> arrivals;
  absl::Time deadline = absl::InfiniteFuture();  // the earliest of the arrivals'
  absl::Duration budget;                         // that arrival's deadline - its arrival
};

// What one local rank owns on its GPU. Thread-only state of NcclCore.
struct Device {
  int rank = 0;
  int ordinal = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  uint8_t* scratch = nullptr;  // device: world_size WireDescriptors
  uint8_t* host = nullptr;     // pinned host: the same
};

absl::Status NotCompleted(uint64_t op_seq, const OpDescriptor& desc, absl::string_view name,
                          absl::Duration budget, bool init_done) {
  std::string what = desc.unit >= 0 ? absl::StrCat("unit ", desc.unit, ", '", name, "'")
                                    : absl::StrCat("'", name, "'");
  return absl::DeadlineExceededError(absl::StrCat(
      "NCCL ", CollectiveKindName(desc.kind), " op_seq ", op_seq, " (", what,
      ") did not complete within ", absl::FormatDuration(absl::Ceil(budget, absl::Milliseconds(1))),
      init_done ? "" : " (NCCL init had not completed)", "; communicator aborted"));
}

// The state of one group. Shared by the Communicator and the group's thread, so that the
// Communicator may be destroyed from a callback running on that thread.
class NcclCore {
 public:
  NcclCore(GroupSpec spec, std::string unique_id, NcclBackendOptions options)
      : spec_(std::move(spec)),
        unique_id_(std::move(unique_id)),
        options_(options),
        comm_name_(absl::StrCat("flatshard:", spec_.group_id, " epoch ", spec_.epoch)),
        init_deadline_(absl::Now() + options.init_timeout),
        last_seq_(spec_.local_ranks.size()) {}

  static void Start(const std::shared_ptr<NcclCore>& core) {
    core->thread_ = std::thread([self = core] { self->Run(); });
  }

  void Arrive(OpCall call, const OpOptions& o, DoneCallback done);
  void Abort(absl::Status reason);
  // Fails pending ops, stops the thread (joins it unless called from it).
  void Shutdown();
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return sticky_;
  }
  std::vector<PendingOpInfo> PendingOps() const;

 private:
  int LocalIndex(int rank) const {
    for (size_t i = 0; i < spec_.local_ranks.size(); ++i) {
      if (spec_.local_ranks[i] == rank) return static_cast<int>(i);
    }
    return -1;
  }
  int local_count() const { return static_cast<int>(spec_.local_ranks.size()); }
  std::string GroupName() const { return absl::StrCat(spec_.group_id, " epoch ", spec_.epoch); }

  // Records the first error and moves the callbacks of every op not yet running into `out`.
  void SetStickyLocked(absl::Status status, std::vector<DoneCallback>* out, bool quiet = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the thread must stop waiting: the sticky error, destruction, or a deadline that
  // passed (of `running`, of a queued op, of init). OK otherwise.
  absl::Status InterruptionLocked(absl::Time now, const Batch* running) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Time NextDeadlineLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !slots_.empty() && !slots_.begin()->second.running &&
           slots_.begin()->second.arrived == local_count();
  }

  // --- the group's thread only ---
  void Run();
  absl::Status InitDevices();
  absl::Status InitComms();
  // Calls `progress` until it reports true or an error; between calls sleeps poll_interval and
  // stops at InterruptionLocked's reason.
  absl::Status Poll(absl::FunctionRef<absl::StatusOr<bool>()> progress, const Batch* running);
  // False while any communicator still reports ncclInProgress; an async error as a status.
  absl::StatusOr<bool> CommsSettled(absl::string_view what);
  // Waits until NCCL has enqueued the group's calls, runs `after_enqueue` (more stream work),
  // records an event per stream and waits for all of them.
  absl::Status Await(const Batch& b, absl::string_view what,
                     absl::FunctionRef<absl::Status()> after_enqueue);
  absl::Status Execute(const Batch& b);
  absl::Status CheckBuffers(const Batch& b);
  absl::Status ExchangeFingerprints(const Batch& b);
  absl::Status LaunchData(const Batch& b);
  // Makes `status` sticky, aborts the NCCL communicators and fails every op with it.
  void Fail(absl::Status status, std::vector<Arrival>* running);
  void AbortComms();
  // ncclCommFinalize + ncclCommDestroy; aborts instead on error or after finalize_timeout.
  void FinalizeComms();
  void FreeDevices();

  const GroupSpec spec_;
  const std::string unique_id_;
  const NcclBackendOptions options_;
  // ncclConfig_t::commName; kept for the communicators' lifetime since init runs on.
  const std::string comm_name_;
  const absl::Time init_deadline_;
  std::thread thread_;
  std::vector<Device> devices_;  // by local index; the thread's

  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool init_done_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<uint64_t>> last_seq_ ABSL_GUARDED_BY(mu_);  // by local index
};

void NcclCore::SetStickyLocked(absl::Status status, std::vector<DoneCallback>* out, bool quiet) {
  if (!sticky_.ok()) return;  // the first error wins
  sticky_ = std::move(status);
  const size_t before = out->size();
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.running) {
      ++it;
      continue;
    }
    for (std::optional<Arrival>& a : it->second.arrivals) {
      if (a) out->push_back(std::move(a->done));
    }
    it = slots_.erase(it);
  }
  const size_t failed = out->size() - before;
  if (!quiet || failed > 0) {
    FS_LOG(WARNING) << "group=" << spec_.group_id << " epoch=" << spec_.epoch
                    << " NCCL communicator failed (" << failed
                    << " waiting calls fail with it): " << sticky_;
  }
}

void NcclCore::Arrive(OpCall call, const OpOptions& o, DoneCallback done) {
  const int rank = o.rank;
  if (absl::Status s = CheckRank(rank, spec_); !s.ok()) {
    std::move(done)(s);  // not a member: nobody waits for this call, so not sticky
    return;
  }
  const int index = LocalIndex(rank);
  const uint64_t op_seq = o.op_seq;
  absl::Status bad = ValidateCall(call, rank, spec_.world_size, op_seq, /*host_only=*/false);
  if (bad.ok()) bad = CheckCudaKinds(call, rank, op_seq);
  FS_VLOG(2) << "group=" << spec_.group_id << " rank=" << rank << " op_seq=" << op_seq << " "
             << FormatOp(call.desc) << " arrived";

  std::vector<DoneCallback> failed;
  absl::Status fail;
  bool taken = false;
  {
    absl::MutexLock lock(&mu_);
    if (sticky_.ok() && !bad.ok()) SetStickyLocked(bad, &failed);
    if (sticky_.ok() && last_seq_[index] && op_seq <= *last_seq_[index]) {
      SetStickyLocked(OpSeqOrderError(rank, op_seq, call.desc, *last_seq_[index]), &failed);
    }
    if (sticky_.ok()) {
      last_seq_[index] = op_seq;
      Slot& slot = slots_[op_seq];
      if (slot.arrived == 0) {
        slot.desc = call.desc;
        slot.first_rank = rank;
        slot.name = o.name;
        slot.first_arrival = absl::Now();
        slot.arrivals.resize(local_count());
      }
      // With fingerprints on, the exchange reports a mismatch identically on every daemon;
      // without, at least the local ranks are compared.
      if (!options_.fingerprint && call.desc != slot.desc) {
        const OpDescriptor first = slot.desc;
        const int first_rank = slot.first_rank;
        SetStickyLocked(MismatchError(op_seq, first_rank, first, rank, call.desc), &failed);
      } else {
        Arrival& a = slot.arrivals[index].emplace();
        a.rank = rank;
        a.call = call;
        a.done = std::move(done);
        a.arrived_at = absl::Now();
        a.deadline = o.deadline;
        taken = true;
        ++slot.arrived;
      }
    }
    if (!sticky_.ok()) fail = sticky_;
  }
  if (fail.ok()) return;
  if (!taken) std::move(done)(fail);
  for (DoneCallback& cb : failed) std::move(cb)(fail);
}

void NcclCore::Abort(absl::Status reason) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  std::vector<DoneCallback> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    SetStickyLocked(std::move(reason), &failed);
    status = sticky_;
  }
  // The group's thread sees the sticky error, aborts the NCCL communicators and fails the
  // running op.
  for (DoneCallback& cb : failed) std::move(cb)(status);
}

void NcclCore::Shutdown() {
  std::vector<DoneCallback> failed;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    // Pending ops, or an init still running, make this an abort rather than a finalize.
    if (!slots_.empty() || !init_done_) {
      SetStickyLocked(absl::AbortedError("NCCL communicator destroyed"), &failed, /*quiet=*/true);
    }
    status = sticky_;
  }
  for (DoneCallback& cb : failed) std::move(cb)(status);
  if (std::this_thread::get_id() == thread_.get_id()) {
    thread_.detach();  // destroyed from its own callback: Run() ends after it returns
  } else if (thread_.joinable()) {
    thread_.join();
  }
}

std::vector<PendingOpInfo> NcclCore::PendingOps() const {
  std::vector<PendingOpInfo> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  for (const auto& [op_seq, slot] : slots_) {
    PendingOpInfo& p = out.emplace_back(PendingOpOf(op_seq, slot.desc, slot.name));
    p.age = now - slot.first_arrival;
    p.running = slot.running;
    for (int i = 0; i < local_count(); ++i) {
      const bool present = slot.running || slot.arrivals[i].has_value();
      (present ? p.arrived_ranks : p.missing_ranks).push_back(spec_.local_ranks[i]);
    }
  }
  return out;
}

absl::Status NcclCore::InterruptionLocked(absl::Time now, const Batch* running) const {
  if (!sticky_.ok()) return sticky_;
  if (shutdown_) return absl::AbortedError("NCCL communicator destroyed");
  if (running != nullptr && now >= running->deadline) {
    return NotCompleted(running->op_seq, running->desc, running->name, running->budget,
                        init_done_);
  }
  for (const auto& [op_seq, slot] : slots_) {
    if (slot.running) continue;
    for (const std::optional<Arrival>& a : slot.arrivals) {
      if (!a || now < a->deadline) continue;
      if (slot.arrived == local_count()) {
        return NotCompleted(op_seq, slot.desc, slot.name, a->deadline - a->arrived_at,
                            init_done_);
      }
      std::vector<int> missing;
      for (int i = 0; i < local_count(); ++i) {
        if (!slot.arrivals[i]) missing.push_back(spec_.local_ranks[i]);
      }
      return MissingRanksError(op_seq, slot.desc, missing, a->deadline - a->arrived_at);
    }
  }
  if (!init_done_ && now >= init_deadline_) {
    return absl::DeadlineExceededError(absl::StrCat(
        "NCCL init of group ", GroupName(), " (", FormatRanks(spec_.local_ranks),
        " of world_size ", spec_.world_size, " here) did not complete within ",
        absl::FormatDuration(options_.init_timeout), "; communicator aborted"));
  }
  return absl::OkStatus();
}

absl::Time NcclCore::NextDeadlineLocked() const {
  absl::Time next = init_done_ ? absl::InfiniteFuture() : init_deadline_;
  for (const auto& [op_seq, slot] : slots_) {
    if (slot.running) continue;
    for (const std::optional<Arrival>& a : slot.arrivals) {
      if (a) next = std::min(next, a->deadline);
    }
  }
  return next;
}

void NcclCore::Run() {
  absl::Status s = InitDevices();
  if (s.ok()) s = InitComms();
  if (s.ok()) {
    absl::MutexLock lock(&mu_);
    init_done_ = true;
  }
  if (s.ok()) {
    FS_LOG(INFO) << "group=" << spec_.group_id << " epoch=" << spec_.epoch << " NCCL "
                 << FormatRanks(spec_.local_ranks) << " of world_size " << spec_.world_size
                 << " initialised";
  }
  bool clean = false;
  Batch batch;
  while (s.ok()) {
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return shutdown_ || !sticky_.ok() || ReadyLocked() || absl::Now() >= NextDeadlineLocked();
      };
      while (!wake()) mu_.AwaitWithDeadline(absl::Condition(&wake), NextDeadlineLocked());
      if (shutdown_ && sticky_.ok()) {
        clean = true;
        break;
      }
      s = InterruptionLocked(absl::Now(), nullptr);
      if (!s.ok()) break;
      if (!ReadyLocked()) continue;
      auto it = slots_.begin();
      Slot& slot = it->second;
      slot.running = true;
      batch = Batch();
      batch.op_seq = it->first;
      batch.desc = slot.desc;
      batch.name = slot.name;
      for (std::optional<Arrival>& a : slot.arrivals) {
        if (a->deadline < batch.deadline) {
          batch.deadline = a->deadline;
          batch.budget = a->deadline - a->arrived_at;
        }
        batch.arrivals.push_back(std::move(*a));
      }
      slot.arrivals.clear();
    }
    s = Execute(batch);
    if (!s.ok()) break;
    FS_VLOG(2) << "group=" << spec_.group_id << " op_seq=" << batch.op_seq << " "
               << FormatOp(batch.desc) << " done";
    {
      absl::MutexLock lock(&mu_);
      slots_.erase(batch.op_seq);
    }
    for (Arrival& a : batch.arrivals) std::move(a.done)(absl::OkStatus());
    batch.arrivals.clear();
  }
  if (clean) {
    FinalizeComms();
  } else {
    Fail(s, &batch.arrivals);
  }
  FreeDevices();
}

absl::Status NcclCore::InitDevices() {
  const size_t scratch = kWire * static_cast<size_t>(spec_.world_size);
  devices_.resize(spec_.local_ranks.size());
  for (size_t i = 0; i < devices_.size(); ++i) {
    Device& d = devices_[i];
    d.rank = spec_.local_ranks[i];
    d.ordinal = spec_.local_devices[i];
    const std::string where = absl::StrCat(" for rank ", d.rank, " on GPU ", d.ordinal);
    gpu::ScopedCudaDevice on(d.ordinal);
    FS_RETURN_IF_ERROR(on.status());
    FS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking),
                            absl::StrCat("cudaStreamCreateWithFlags", where));
    FS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&d.event, cudaEventDisableTiming),
                            absl::StrCat("cudaEventCreateWithFlags", where));
    FS_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&d.scratch), scratch),
                            absl::StrCat("cudaMalloc of the fingerprint buffer", where));
    FS_CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&d.host), scratch),
                            absl::StrCat("cudaMallocHost of the fingerprint buffer", where));
  }
  return absl::OkStatus();
}

absl::Status NcclCore::InitComms() {
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id_.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // never block this thread: deadlines and Abort must stay responsive
  config.commName = comm_name_.c_str();
  FS_RETURN_IF_ERROR(NcclCheck(ncclGroupStart(), "ncclGroupStart for init"));
  absl::Status first;
  for (Device& d : devices_) {
    gpu::ScopedCudaDevice on(d.ordinal);  // NCCL binds the communicator to the current device
    if (first.ok()) first = on.status();
    if (!first.ok()) break;
    first = NcclCheck(
        ncclCommInitRankConfig(&d.comm, spec_.world_size, id, d.rank, &config),
        absl::StrCat("ncclCommInitRankConfig for rank ", d.rank, " on GPU ", d.ordinal), d.comm);
  }
  absl::Status end = NcclCheck(ncclGroupEnd(), "ncclGroupEnd for init");
  FS_RETURN_IF_ERROR(first);
  FS_RETURN_IF_ERROR(end);
  return Poll([this] { return CommsSettled("NCCL init"); }, nullptr);
}

absl::Status NcclCore::Poll(absl::FunctionRef<absl::StatusOr<bool>()> progress,
                            const Batch* running) {
  while (true) {
    FS_ASSIGN_OR_RETURN(bool done, progress());
    if (done) return absl::OkStatus();
    {
      absl::MutexLock lock(&mu_);
      FS_RETURN_IF_ERROR(InterruptionLocked(absl::Now(), running));
    }
    absl::SleepFor(options_.poll_interval);
  }
}

absl::StatusOr<bool> NcclCore::CommsSettled(absl::string_view what) {
  bool settled = true;
  for (Device& d : devices_) {
    ncclResult_t async = ncclSuccess;
    FS_RETURN_IF_ERROR(NcclCheck(ncclCommGetAsyncError(d.comm, &async),
                                 absl::StrCat("ncclCommGetAsyncError of rank ", d.rank), d.comm));
    if (async == ncclInProgress) {
      settled = false;
    } else if (async != ncclSuccess) {
      return NcclCheck(async, absl::StrCat(what, ": rank ", d.rank, " on GPU ", d.ordinal),
                       d.comm);
    }
  }
  return settled;
}

absl::Status NcclCore::Await(const Batch& b, absl::string_view what,
                             absl::FunctionRef<absl::Status()> after_enqueue) {
  // A non-blocking communicator may still be enqueueing after ncclGroupEnd returned; stream
  // work that depends on the NCCL calls must wait for that.
  FS_RETURN_IF_ERROR(Poll([&] { return CommsSettled(what); }, &b));
  FS_RETURN_IF_ERROR(after_enqueue());
  for (Device& d : devices_) {
    FS_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.event, d.stream),
                            absl::StrCat("cudaEventRecord for rank ", d.rank));
  }
  return Poll(
      [&]() -> absl::StatusOr<bool> {
        bool all = true;
        for (Device& d : devices_) {
          const cudaError_t e = cudaEventQuery(d.event);
          if (e == cudaErrorNotReady) {
            all = false;
          } else if (e != cudaSuccess) {
            return gpu::CudaStatus(e, absl::StrCat(what, ": rank ", d.rank, " on GPU ",
                                                   d.ordinal));
          }
        }
        // A peer that died leaves the kernels spinning; only the async error says so.
        FS_ASSIGN_OR_RETURN(bool settled, CommsSettled(what));
        (void)settled;
        return all;
      },
      &b);
}

absl::Status NcclCore::Execute(const Batch& b) {
  FS_RETURN_IF_ERROR(CheckBuffers(b));
  if (options_.fingerprint) FS_RETURN_IF_ERROR(ExchangeFingerprints(b));
  if (b.desc.bytes == 0) return absl::OkStatus();
  return LaunchData(b);
}

absl::Status NcclCore::CheckBuffers(const Batch& b) {
  struct Out {
    uintptr_t begin, end;
    int rank;
  };
  std::vector<Out> outs;
  for (size_t i = 0; i < b.arrivals.size(); ++i) {
    const Arrival& a = b.arrivals[i];
    const Device& d = devices_[i];
    const bool needs_out = a.call.desc.kind != CollectiveKind::kGather || a.rank == a.call.desc.root;
    auto check = [&](const void* p, size_t bytes, absl::string_view which) -> absl::Status {
      if (bytes == 0) return absl::OkStatus();
      cudaPointerAttributes attr{};
      FS_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, p),
                              absl::StrCat("cudaPointerGetAttributes of rank ", a.rank, "'s ",
                                           which));
      auto invalid = [&](absl::string_view why) {
        return absl::InvalidArgumentError(absl::StrCat("rank ", a.rank, " op_seq ", b.op_seq, " ",
                                                       FormatOp(a.call.desc), ": the ", which,
                                                       " ", why));
      };
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
        return invalid("is not device memory");
      }
      if (attr.type == cudaMemoryTypeDevice && attr.device != d.ordinal) {
        return invalid(absl::StrCat("is on GPU ", attr.device, " but rank ", a.rank,
                                    " runs on GPU ", d.ordinal));
      }
      return absl::OkStatus();
    };
    FS_RETURN_IF_ERROR(check(a.call.in.data, a.call.in.bytes, "input"));
    if (needs_out) {
      FS_RETURN_IF_ERROR(check(a.call.out.data, a.call.out.bytes, "output"));
      if (a.call.out.bytes > 0) {
        const auto p = reinterpret_cast<uintptr_t>(a.call.out.data);
        outs.push_back(Out{p, p + a.call.out.bytes, a.rank});
      }
    }
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t j = i + 1; j < outs.size(); ++j) {
      if (outs[i].begin < outs[j].end && outs[j].begin < outs[i].end) {
        return absl::InvalidArgumentError(absl::StrCat(
            "op_seq ", b.op_seq, " ", FormatOp(b.desc), ": ranks ", outs[i].rank, " and ",
            outs[j].rank, " pass overlapping outputs; NCCL ranks live on different GPUs and "
            "cannot share one"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status NcclCore::ExchangeFingerprints(const Batch& b) {
  const size_t all = kWire * static_cast<size_t>(spec_.world_size);
  for (size_t i = 0; i < devices_.size(); ++i) {
    Device& d = devices_[i];
    const WireDescriptor w = EncodeDescriptor(b.op_seq, b.arrivals[i].call.desc);
    std::memcpy(d.host + d.rank * kWire, &w, kWire);
    FS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.scratch + d.rank * kWire, d.host + d.rank * kWire,
                                            kWire, cudaMemcpyHostToDevice, d.stream),
                            absl::StrCat("fingerprint upload for rank ", d.rank));
  }
  FS_RETURN_IF_ERROR(NcclCheck(ncclGroupStart(), "ncclGroupStart for fingerprints"));
  absl::Status first;
  for (Device& d : devices_) {
    if (!first.ok()) break;
    first = NcclCheck(ncclAllGather(d.scratch + d.rank * kWire, d.scratch, kWire, ncclUint8,
                                    d.comm, d.stream),
                      absl::StrCat("fingerprint ncclAllGather of rank ", d.rank), d.comm);
  }
  absl::Status end = NcclCheck(ncclGroupEnd(), "ncclGroupEnd for fingerprints");
  FS_RETURN_IF_ERROR(first);
  FS_RETURN_IF_ERROR(end);
  FS_RETURN_IF_ERROR(Await(b, "NCCL fingerprint exchange", [&]() -> absl::Status {
    for (Device& d : devices_) {
      FS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(d.host, d.scratch, all, cudaMemcpyDeviceToHost, d.stream),
          absl::StrCat("fingerprint download for rank ", d.rank));
    }
    return absl::OkStatus();
  }));
  // Every local rank received the same bytes; every daemon derives the same verdict from them.
  const uint8_t* got = devices_[0].host;
  std::vector<WireDescriptor> wires(spec_.world_size);
  std::vector<OpDescriptor> descs(spec_.world_size);
  for (int r = 0; r < spec_.world_size; ++r) {
    std::memcpy(&wires[r], got + r * kWire, kWire);
    std::optional<OpDescriptor> d = DecodeDescriptor(wires[r]);
    if (!d) {
      return absl::AbortedError(absl::StrCat("collective mismatch at op_seq ", b.op_seq,
                                             ": rank ", r, " sent an unreadable descriptor"));
    }
    descs[r] = *d;
  }
  for (int r = 1; r < spec_.world_size; ++r) {
    if (wires[r].op_seq != wires[0].op_seq) {
      return absl::AbortedError(absl::StrCat("collective op_seq mismatch: rank 0 is at op_seq ",
                                             wires[0].op_seq, " but rank ", r, " at op_seq ",
                                             wires[r].op_seq));
    }
  }
  for (int r = 1; r < spec_.world_size; ++r) {
    if (descs[r] != descs[0]) return MismatchError(b.op_seq, 0, descs[0], r, descs[r]);
  }
  return absl::OkStatus();
}

absl::Status NcclCore::LaunchData(const Batch& b) {
  const OpDescriptor& desc = b.desc;
  const size_t s = desc.bytes;
  const std::string what = absl::StrCat("NCCL ", FormatOp(desc), " op_seq ", b.op_seq);
  // Gather: the root's own shard is a local copy, ordered before the receives on its stream.
  if (desc.kind == CollectiveKind::kGather) {
    for (size_t i = 0; i < devices_.size(); ++i) {
      const Arrival& a = b.arrivals[i];
      if (a.rank != desc.root) continue;
      uint8_t* slot = a.call.out.begin() + static_cast<size_t>(desc.root) * s;
      if (slot == a.call.in.begin()) continue;
      FS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot, a.call.in.data, s, cudaMemcpyDeviceToDevice,
                                              devices_[i].stream),
                              absl::StrCat(what, ": root's own shard"));
    }
  }
  FS_RETURN_IF_ERROR(NcclCheck(ncclGroupStart(), absl::StrCat("ncclGroupStart for ", what)));
  absl::Status first;
  for (size_t i = 0; i < devices_.size() && first.ok(); ++i) {
    const Arrival& a = b.arrivals[i];
    Device& d = devices_[i];
    const std::string call = absl::StrCat(what, " rank ", d.rank);
    switch (desc.kind) {
      case CollectiveKind::kAllGather:
        first = NcclCheck(
            ncclAllGather(a.call.in.data, a.call.out.data, s, ncclUint8, d.comm, d.stream),
            absl::StrCat("ncclAllGather: ", call), d.comm);
        break;
      case CollectiveKind::kReduceScatter: {
        std::optional<ncclDataType_t> type = NcclFloatType(desc.dtype);
        if (!type) {  // ValidateCall refused these already
          first = absl::InvalidArgumentError(absl::StrCat(call, ": no NCCL reduction type"));
          break;
        }
        const size_t count = s / static_cast<size_t>(ItemSize(desc.dtype));
        const ncclRedOp_t op = desc.reduce_op == ReduceOp::kAvg ? ncclAvg : ncclSum;
        first = NcclCheck(
            ncclReduceScatter(a.call.in.data, a.call.out.data, count, *type, op, d.comm, d.stream),
            absl::StrCat("ncclReduceScatter: ", call), d.comm);
        break;
      }
      case CollectiveKind::kBroadcast:
        first = NcclCheck(ncclBroadcast(a.call.out.data, a.call.out.data, s, ncclUint8, desc.root,
                                        d.comm, d.stream),
                          absl::StrCat("ncclBroadcast: ", call), d.comm);
        break;
      case CollectiveKind::kGather:
        if (a.rank != desc.root) {
          first = NcclCheck(ncclSend(a.call.in.data, s, ncclUint8, desc.root, d.comm, d.stream),
                            absl::StrCat("ncclSend: ", call), d.comm);
          break;
        }
        for (int k = 0; k < spec_.world_size && first.ok(); ++k) {
          if (k == desc.root) continue;
          first = NcclCheck(ncclRecv(a.call.out.begin() + static_cast<size_t>(k) * s, s,
                                     ncclUint8, k, d.comm, d.stream),
                            absl::StrCat("ncclRecv from rank ", k, ": ", call), d.comm);
        }
        break;
    }
  }
  absl::Status end = NcclCheck(ncclGroupEnd(), absl::StrCat("ncclGroupEnd for ", what));
  FS_RETURN_IF_ERROR(first);
  FS_RETURN_IF_ERROR(end);
  return Await(b, what, [] { return absl::OkStatus(); });
}

void NcclCore::Fail(absl::Status status, std::vector<Arrival>* running) {
  std::vector<DoneCallback> failed;
  {
    absl::MutexLock lock(&mu_);
    SetStickyLocked(std::move(status), &failed, /*quiet=*/shutdown_);
    status = sticky_;
    slots_.clear();  // the running op's slot; SetStickyLocked took the others
  }
  // Before any callback: callers free their buffers once told, and NCCL may still use them.
  AbortComms();
  for (Arrival& a : *running) failed.push_back(std::move(a.done));
  running->clear();
  for (DoneCallback& cb : failed) std::move(cb)(status);
}

void NcclCore::AbortComms() {
  for (Device& d : devices_) {
    if (d.comm == nullptr) continue;
    gpu::ScopedCudaDevice on(d.ordinal);
    absl::Status s = NcclCheck(ncclCommAbort(d.comm), absl::StrCat("ncclCommAbort of rank ", d.rank));
    if (!s.ok()) FS_LOG(WARNING) << "group=" << spec_.group_id << " " << s;
    d.comm = nullptr;
  }
}

void NcclCore::FinalizeComms() {
  absl::Status s;
  for (Device& d : devices_) {
    if (s.ok() && d.comm != nullptr) {
      s = NcclCheck(ncclCommFinalize(d.comm), absl::StrCat("ncclCommFinalize of rank ", d.rank),
                    d.comm);
    }
  }
  const absl::Time give_up = absl::Now() + options_.finalize_timeout;
  while (s.ok()) {
    absl::StatusOr<bool> settled = CommsSettled("ncclCommFinalize");
    if (!settled.ok()) s = settled.status();
    if (!s.ok() || *settled) break;
    if (absl::Now() >= give_up) {
      s = absl::DeadlineExceededError(absl::StrCat("ncclCommFinalize did not complete within ",
                                                   absl::FormatDuration(options_.finalize_timeout)));
      break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (!s.ok()) {
    FS_LOG(WARNING) << "group=" << spec_.group_id << " epoch=" << spec_.epoch << " " << s
                    << "; aborting the NCCL communicators instead";
    AbortComms();
    return;
  }
  for (Device& d : devices_) {
    if (d.comm == nullptr) continue;
    absl::Status ds =
        NcclCheck(ncclCommDestroy(d.comm), absl::StrCat("ncclCommDestroy of rank ", d.rank));
    if (!ds.ok()) FS_LOG(WARNING) << "group=" << spec_.group_id << " " << ds;
    d.comm = nullptr;
  }
  FS_VLOG(1) << "group=" << spec_.group_id << " epoch=" << spec_.epoch << " NCCL finalized";
}

void NcclCore::FreeDevices() {
  for (Device& d : devices_) {
    gpu::ScopedCudaDevice on(d.ordinal);
    auto warn = [&](cudaError_t e, absl::string_view what) {
      if (e != cudaSuccess) {
        FS_LOG(WARNING) << "group=" << spec_.group_id << " "
                        << gpu::CudaStatus(e, absl::StrCat(what, " of rank ", d.rank));
      }
    };
    if (d.event != nullptr) warn(cudaEventDestroy(d.event), "cudaEventDestroy");
    if (d.stream != nullptr) warn(cudaStreamDestroy(d.stream), "cudaStreamDestroy");
    if (d.scratch != nullptr) warn(cudaFree(d.scratch), "cudaFree");
    if (d.host != nullptr) warn(cudaFreeHost(d.host), "cudaFreeHost");
    d = Device{};
  }
}

// ---------------------------------------------------------------------------------------------

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<NcclCore> core) : core_(std::move(core)) {}
  ~NcclCommunicator() override { core_->Shutdown(); }

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
  absl::string_view backend_name() const override { return "nccl"; }

 private:
  std::shared_ptr<NcclCore> core_;
};

class NcclBackend final : public CollectiveBackend {
 public:
  explicit NcclBackend(NcclBackendOptions options) : options_(options) {}

  absl::string_view Name() const override { return "nccl"; }
  bool IsViable() const override { return gpu::ListGpus().ok(); }
  bool Supports(MemoryKind kind) const override { return kind == MemoryKind::kCuda; }
  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& spec) override;

 private:
  const NcclBackendOptions options_;
};

absl::StatusOr<std::unique_ptr<Communicator>> NcclBackend::Connect(const GroupSpec& spec) {
  FS_RETURN_IF_ERROR(CheckGroupSpec(spec));
  const std::string name = absl::StrCat("group ", spec.group_id, " epoch ", spec.epoch);
  if (spec.local_ranks.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no local ranks"));
  }
  if (spec.local_devices.size() != spec.local_ranks.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": NCCL needs one GPU per local rank, got ", spec.local_devices.size(),
        " local_devices for ", spec.local_ranks.size(), " local_ranks"));
  }
  for (size_t i = 0; i < spec.local_devices.size(); ++i) {
    if (spec.local_devices[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": rank ", spec.local_ranks[i],
                                                     " has GPU ", spec.local_devices[i]));
    }
    for (size_t j = 0; j < i; ++j) {
      if (spec.local_devices[j] == spec.local_devices[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": NCCL cannot place ranks ", spec.local_ranks[j], " and ",
                         spec.local_ranks[i], " on the same GPU ", spec.local_devices[i]));
      }
    }
  }
  if (!spec.nccl_unique_id.empty() && spec.nccl_unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": nccl_unique_id has ",
                                                   spec.nccl_unique_id.size(), " bytes, want ",
                                                   NCCL_UNIQUE_ID_BYTES));
  }
  if (spec.nccl_unique_id.empty() &&
      static_cast<int>(spec.local_ranks.size()) != spec.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        name, ": only ", FormatRanks(spec.local_ranks), " of world_size ", spec.world_size,
        " are local, so NCCL needs the nccl_unique_id of rank 0's daemon"));
  }
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (!gpus.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": the NCCL backend needs a GPU: ", gpus.status().message()));
  }
  for (size_t i = 0; i < spec.local_devices.size(); ++i) {
    if (spec.local_devices[i] >= static_cast<int>(gpus->size())) {
      return absl::FailedPreconditionError(
          absl::StrCat(name, ": rank ", spec.local_ranks[i], "'s GPU ", spec.local_devices[i],
                       " is not visible here (", gpus->size(), " GPUs)"));
    }
  }
  std::string id = spec.nccl_unique_id;
  if (id.empty()) {
    FS_ASSIGN_OR_RETURN(id, MakeNcclUniqueId());  // every rank is local: nobody else needs it
  }
  auto core = std::make_shared<NcclCore>(spec, std::move(id), options_);
  NcclCore::Start(core);
  FS_LOG(INFO) << "group=" << spec.group_id << " epoch=" << spec.epoch << " NCCL communicator for "
               << FormatRanks(spec.local_ranks) << " of world_size " << spec.world_size
               << " connecting";
  return std::make_unique<NcclCommunicator>(std::move(core));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateNcclBackend(NcclBackendOptions options) {
  if (options.init_timeout <= absl::ZeroDuration() ||
      options.finalize_timeout < absl::ZeroDuration() ||
      options.poll_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "NCCL backend: init_timeout must be positive; finalize_timeout and poll_interval must "
        "not be negative");
  }
  return std::make_unique<NcclBackend>(options);
}

}  // namespace flatshard::collective
