#include "server/collective/nccl/nccl_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
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
#include "server/collective/deadline_timer.h"
#include "server/collective/local_rendezvous.h"
#include "server/collective/nccl/nccl_library.h"
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
  FS_RETURN_IF_ERROR(NcclAvailable());
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
// Communicator may be destroyed from a callback running on that thread. The local ranks' calls
// meet in a LocalRendezvous (local_rendezvous.h), which owns the sticky status, deadlines of
// waiting calls and the pending listing; the thread takes complete ops from it in op_seq order.
class NcclCore {
 public:
  NcclCore(GroupSpec spec, std::string unique_id, NcclBackendOptions options,
           std::shared_ptr<DeadlineTimer> timer)
      : spec_(std::move(spec)),
        unique_id_(std::move(unique_id)),
        options_(options),
        comm_name_(absl::StrCat("flatshard:", spec_.group_id, " epoch ", spec_.epoch)),
        init_deadline_(absl::Now() + options.init_timeout),
        init_done_(std::make_shared<std::atomic<bool>>(false)),
        rendezvous_(std::make_shared<LocalRendezvous>(
            spec_, RendezvousOptionsFor(spec_, options, init_done_, std::move(timer)))) {}

  static void Start(const std::shared_ptr<NcclCore>& core) {
    core->thread_ = std::thread([self = core] { self->Run(); });
  }

  void Arrive(OpCall call, const OpOptions& o, DoneCallback done) {
    // Never hands an op over (the thread takes them); `done` runs later or has failed.
    rendezvous_->Arrive(std::move(call), o, std::move(done));
  }
  // The group's thread sees the sticky error, aborts the NCCL communicators and fails the
  // running op; waiting ops fail here.
  void Abort(absl::Status reason) { rendezvous_->Fail(std::move(reason)).IgnoreError(); }
  // Fails pending ops, stops the thread (joins it unless called from it).
  void Shutdown();
  absl::Status status() const { return rendezvous_->status(); }
  std::vector<PendingOpInfo> PendingOps() const { return rendezvous_->PendingOps(); }

 private:
  static LocalRendezvousOptions RendezvousOptionsFor(const GroupSpec& spec,
                                                     const NcclBackendOptions& options,
                                                     std::shared_ptr<std::atomic<bool>> init_done,
                                                     std::shared_ptr<DeadlineTimer> timer) {
    LocalRendezvousOptions o;
    o.log_name = absl::StrCat("group=", spec.group_id, " epoch=", spec.epoch, " NCCL communicator");
    o.host_only = false;
    // Host buffers are refused when the op arrives, so a wrong kind never reaches NCCL.
    o.check_call = [](const OpCall& call, int rank, uint64_t op_seq) {
      return CheckCudaKinds(call, rank, op_seq);
    };
    // With fingerprints on, the exchange reports a mismatch identically on every daemon;
    // without, at least the local ranks are compared.
    o.compare_descriptors = !options.fingerprint;
    o.hand_over_on_arrival = false;
    // Every local rank arrived but an earlier op still runs. Holds the flag, not the core: the
    // timer may run this after the core is gone.
    o.overdue = [init_done = std::move(init_done)](uint64_t op_seq, const OpDescriptor& desc,
                                                   const std::string& name, absl::Duration budget) {
      return NotCompleted(op_seq, desc, name, budget, init_done->load());
    };
    o.timer = std::move(timer);
    return o;
  }

  std::string GroupName() const { return absl::StrCat(spec_.group_id, " epoch ", spec_.epoch); }

  // Why the thread must stop waiting: the sticky error, destruction, or a deadline that
  // passed (of `running`, of init). OK otherwise. Deadlines of waiting ops are the
  // rendezvous' (they become the sticky error).
  absl::Status Interruption(absl::Time now, const RendezvousOp* running) const;

  // --- the group's thread only ---
  void Run();
  absl::Status InitDevices();
  absl::Status InitComms();
  // Calls `progress` until it reports true or an error; between calls sleeps poll_interval and
  // stops at Interruption's reason.
  absl::Status Poll(absl::FunctionRef<absl::StatusOr<bool>()> progress,
                    const RendezvousOp* running);
  // False while any communicator still reports ncclInProgress; an async error as a status.
  absl::StatusOr<bool> CommsSettled(absl::string_view what);
  // Waits until NCCL has enqueued the group's calls, runs `after_enqueue` (more stream work),
  // records an event per stream and waits for all of them.
  absl::Status Await(const RendezvousOp& b, absl::string_view what,
                     absl::FunctionRef<absl::Status()> after_enqueue);
  absl::Status Execute(const RendezvousOp& b);
  absl::Status CheckBuffers(const RendezvousOp& b);
  absl::Status ExchangeFingerprints(const RendezvousOp& b);
  absl::Status LaunchData(const RendezvousOp& b);
  // Makes `status` sticky, aborts the NCCL communicators and fails every op with it; `running`
  // (may be empty) holds the calls of the op the thread was running.
  void Fail(absl::Status status, std::vector<RendezvousCall>* running);
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
  // Set by the thread once every local NCCL communicator is initialised.
  const std::shared_ptr<std::atomic<bool>> init_done_;
  const std::shared_ptr<LocalRendezvous> rendezvous_;
  std::thread thread_;
  std::vector<Device> devices_;  // by local index; the thread's
};

void NcclCore::Shutdown() {
  // Pending ops, or an init still running, make this an abort rather than a finalize.
  rendezvous_->Close(absl::AbortedError("NCCL communicator destroyed"),
                     /*fail=*/!init_done_->load());
  if (std::this_thread::get_id() == thread_.get_id()) {
    thread_.detach();  // destroyed from its own callback: Run() ends after it returns
  } else if (thread_.joinable()) {
    thread_.join();
  }
}

absl::Status NcclCore::Interruption(absl::Time now, const RendezvousOp* running) const {
  FS_RETURN_IF_ERROR(rendezvous_->status());
  if (rendezvous_->closed()) return absl::AbortedError("NCCL communicator destroyed");
  if (running != nullptr && now >= running->deadline) {
    return NotCompleted(running->op_seq, running->desc, running->name, running->budget,
                        init_done_->load());
  }
  if (!init_done_->load() && now >= init_deadline_) {
    return absl::DeadlineExceededError(
        absl::StrCat("NCCL init of group ", GroupName(), " (", FormatRanks(spec_.local_ranks),
                     " of world_size ", spec_.world_size, " here) did not complete within ",
                     absl::FormatDuration(options_.init_timeout), "; communicator aborted"));
  }
  return absl::OkStatus();
}

void NcclCore::Run() {
  absl::Status s = InitDevices();
  if (s.ok()) s = InitComms();
  if (s.ok()) {
    init_done_->store(true);
    FS_LOG(INFO) << "group=" << spec_.group_id << " epoch=" << spec_.epoch << " NCCL "
                 << FormatRanks(spec_.local_ranks) << " of world_size " << spec_.world_size
                 << " initialised";
  }
  bool clean = false;
  std::optional<RendezvousOp> op;
  while (s.ok()) {
    // Wakes for a complete op at the front, the sticky error (deadlines of waiting ops
    // included) or Close.
    rendezvous_->WaitForWork(absl::InfiniteFuture());
    s = rendezvous_->status();
    if (!s.ok()) break;
    if (rendezvous_->closed()) {  // closed with nothing pending (else the status says so)
      clean = true;
      break;
    }
    op = rendezvous_->TakeReady();
    if (!op) continue;
    s = Execute(*op);
    if (!s.ok()) break;
    FS_VLOG(2) << "group=" << spec_.group_id << " op_seq=" << op->op_seq << " "
               << FormatOp(op->desc) << " done";
    rendezvous_->Finish(op->op_seq, absl::OkStatus()).IgnoreError();  // OK stays OK
    for (RendezvousCall& c : op->calls) std::move(c.done)(absl::OkStatus());
    op.reset();
  }
  if (clean) {
    FinalizeComms();
  } else {
    std::vector<RendezvousCall> running;
    if (op) running = std::move(op->calls);
    Fail(s, &running);
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
                            const RendezvousOp* running) {
  while (true) {
    FS_ASSIGN_OR_RETURN(bool done, progress());
    if (done) return absl::OkStatus();
    FS_RETURN_IF_ERROR(Interruption(absl::Now(), running));
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
      return NcclCheck(async, absl::StrCat(what, ": rank ", d.rank, " on GPU ", d.ordinal), d.comm);
    }
  }
  return settled;
}

absl::Status NcclCore::Await(const RendezvousOp& b, absl::string_view what,
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
            return gpu::CudaStatus(e, absl::StrCat(what, ": rank ", d.rank, " on GPU ", d.ordinal));
          }
        }
        // A peer that died leaves the kernels spinning; only the async error says so.
        FS_ASSIGN_OR_RETURN(bool settled, CommsSettled(what));
        (void)settled;
        return all;
      },
      &b);
}

absl::Status NcclCore::Execute(const RendezvousOp& b) {
  FS_RETURN_IF_ERROR(CheckBuffers(b));
  if (options_.fingerprint) FS_RETURN_IF_ERROR(ExchangeFingerprints(b));
  if (b.desc.bytes == 0) return absl::OkStatus();
  return LaunchData(b);
}

absl::Status NcclCore::CheckBuffers(const RendezvousOp& b) {
  struct Out {
    uintptr_t begin, end;
    int rank;
  };
  std::vector<Out> outs;
  for (size_t i = 0; i < b.calls.size(); ++i) {
    const RendezvousCall& a = b.calls[i];
    const Device& d = devices_[i];
    const bool needs_out =
        a.call.desc.kind != CollectiveKind::kGather || a.rank == a.call.desc.root;
    auto check = [&](const void* p, size_t bytes, absl::string_view which) -> absl::Status {
      if (bytes == 0) return absl::OkStatus();
      cudaPointerAttributes attr{};
      FS_CUDA_RETURN_IF_ERROR(
          cudaPointerGetAttributes(&attr, p),
          absl::StrCat("cudaPointerGetAttributes of rank ", a.rank, "'s ", which));
      auto invalid = [&](absl::string_view why) {
        return absl::InvalidArgumentError(absl::StrCat("rank ", a.rank, " op_seq ", b.op_seq, " ",
                                                       FormatOp(a.call.desc), ": the ", which, " ",
                                                       why));
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
        return absl::InvalidArgumentError(
            absl::StrCat("op_seq ", b.op_seq, " ", FormatOp(b.desc), ": ranks ", outs[i].rank,
                         " and ", outs[j].rank,
                         " pass overlapping outputs; NCCL ranks live on different GPUs and "
                         "cannot share one"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status NcclCore::ExchangeFingerprints(const RendezvousOp& b) {
  const size_t all = kWire * static_cast<size_t>(spec_.world_size);
  for (size_t i = 0; i < devices_.size(); ++i) {
    Device& d = devices_[i];
    const WireDescriptor w = EncodeDescriptor(b.op_seq, b.calls[i].call.desc);
    std::memcpy(d.host + d.rank * kWire, &w, kWire);
    FS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.scratch + d.rank * kWire, d.host + d.rank * kWire,
                                            kWire, cudaMemcpyHostToDevice, d.stream),
                            absl::StrCat("fingerprint upload for rank ", d.rank));
  }
  FS_RETURN_IF_ERROR(NcclCheck(ncclGroupStart(), "ncclGroupStart for fingerprints"));
  absl::Status first;
  for (Device& d : devices_) {
    if (!first.ok()) break;
    first = NcclCheck(
        ncclAllGather(d.scratch + d.rank * kWire, d.scratch, kWire, ncclUint8, d.comm, d.stream),
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
      return absl::AbortedError(absl::StrCat("collective mismatch at op_seq ", b.op_seq, ": rank ",
                                             r, " sent an unreadable descriptor"));
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

absl::Status NcclCore::LaunchData(const RendezvousOp& b) {
  const OpDescriptor& desc = b.desc;
  const size_t s = desc.bytes;
  const std::string what = absl::StrCat("NCCL ", FormatOp(desc), " op_seq ", b.op_seq);
  // Gather: the root's own shard is a local copy, ordered before the receives on its stream.
  if (desc.kind == CollectiveKind::kGather) {
    for (size_t i = 0; i < devices_.size(); ++i) {
      const RendezvousCall& a = b.calls[i];
      if (a.rank != desc.root) continue;
      uint8_t* slot = a.call.out.begin() + static_cast<size_t>(desc.root) * s;
      if (slot == a.call.in.begin()) continue;
      FS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(slot, a.call.in.data, s, cudaMemcpyDeviceToDevice, devices_[i].stream),
          absl::StrCat(what, ": root's own shard"));
    }
  }
  FS_RETURN_IF_ERROR(NcclCheck(ncclGroupStart(), absl::StrCat("ncclGroupStart for ", what)));
  absl::Status first;
  for (size_t i = 0; i < devices_.size() && first.ok(); ++i) {
    const RendezvousCall& a = b.calls[i];
    Device& d = devices_[i];
    const std::string call = absl::StrCat(what, " rank ", d.rank);
    switch (desc.kind) {
      case CollectiveKind::kAllReduce:  // composed above the Communicator; ValidateCall refuses it
        first = absl::InvalidArgumentError(absl::StrCat(what, " reached the nccl backend"));
        break;
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
          first = NcclCheck(ncclRecv(a.call.out.begin() + static_cast<size_t>(k) * s, s, ncclUint8,
                                     k, d.comm, d.stream),
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

void NcclCore::Fail(absl::Status status, std::vector<RendezvousCall>* running) {
  // Waiting calls never reached NCCL: they fail at once. The running op's slot is dropped.
  status = rendezvous_->Fail(std::move(status), /*quiet=*/rendezvous_->closed(),
                             /*drop_running=*/true);
  // Before the running op's callbacks: callers free their buffers once told, and NCCL may
  // still use them.
  AbortComms();
  for (RendezvousCall& c : *running) std::move(c.done)(status);
  running->clear();
}

void NcclCore::AbortComms() {
  for (Device& d : devices_) {
    if (d.comm == nullptr) continue;
    gpu::ScopedCudaDevice on(d.ordinal);
    absl::Status s =
        NcclCheck(ncclCommAbort(d.comm), absl::StrCat("ncclCommAbort of rank ", d.rank));
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
      s = absl::DeadlineExceededError(
          absl::StrCat("ncclCommFinalize did not complete within ",
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
  explicit NcclBackend(NcclBackendOptions options)
      : options_(options), timer_(std::make_shared<DeadlineTimer>()) {}

  absl::string_view Name() const override { return "nccl"; }
  bool IsViable() const override { return gpu::ListGpus().ok(); }
  bool Supports(MemoryKind kind) const override { return kind == MemoryKind::kCuda; }
  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& spec) override;

 private:
  const NcclBackendOptions options_;
  // Deadlines of waiting ops; shared with communicators, which may outlive the backend.
  const std::shared_ptr<DeadlineTimer> timer_;
};

absl::StatusOr<std::unique_ptr<Communicator>> NcclBackend::Connect(const GroupSpec& spec) {
  FS_RETURN_IF_ERROR(CheckGroupSpec(spec));
  const std::string name = absl::StrCat("group ", spec.group_id, " epoch ", spec.epoch);
  if (spec.local_ranks.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no local ranks"));
  }
  if (spec.local_devices.size() != spec.local_ranks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": NCCL needs one GPU per local rank, got ", spec.local_devices.size(),
                     " local_devices for ", spec.local_ranks.size(), " local_ranks"));
  }
  for (size_t i = 0; i < spec.local_devices.size(); ++i) {
    if (spec.local_devices[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": rank ", spec.local_ranks[i], " has GPU ", spec.local_devices[i]));
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
  if (spec.nccl_unique_id.empty() && static_cast<int>(spec.local_ranks.size()) != spec.world_size) {
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
  auto core = std::make_shared<NcclCore>(spec, std::move(id), options_, timer_);
  NcclCore::Start(core);
  FS_LOG(INFO) << "group=" << spec.group_id << " epoch=" << spec.epoch << " NCCL communicator for "
               << FormatRanks(spec.local_ranks) << " of world_size " << spec.world_size
               << " connecting";
  return std::make_unique<NcclCommunicator>(std::move(core));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateNcclBackend(NcclBackendOptions options) {
  FS_RETURN_IF_ERROR(NcclAvailable());
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
