#include "server/shard_store.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/gpu/device_context.h"
#include "server/gpu/device_pool.h"

namespace flatshard::server {
namespace internal {

// The accounting of one ShardStore, shared with its Buffers so that a Buffer dropped after
// the store is gone still has somewhere to return its bytes.
class StoreState {
 public:
  explicit StoreState(const ShardStoreOptions& options)
      : limit_bytes_(options.memory_limit_bytes),
        uid_quota_bytes_(options.memory_quota_bytes_per_uid),
        max_segments_(options.max_segments),
        uid_quota_segments_(options.max_segments_per_uid),
        uid_quota_device_bytes_(options.device_quota_bytes_per_uid) {}

  // Adds `bytes` of `kind` for `uid` unless that would exceed the limit, the uid's memory
  // quota or (`new_segment`: one more segment, i.e. one more open descriptor) the segment
  // budget or the uid's segment quota, or the store is shut down. Nothing changes on refusal.
  // `recommit`: the bytes belong to a decommitted buffer being committed again.
  absl::Status Charge(BufferKind kind, int64_t bytes, absl::string_view label, bool recommit,
                      int64_t uid, bool new_segment) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (shutdown_) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot allocate ", bytes, " bytes of ", BufferKindName(kind), " memory",
                       LabelSuffix(label), ": the shard store is shut down"));
    }
    if (bytes > limit_bytes_ - total_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of ", BufferKindName(kind), " memory",
                       LabelSuffix(label), ": ", total_bytes_, " bytes in use, limit ",
                       limit_bytes_, " (", UsageLocked().DebugString(), ")"));
    }
    auto found = by_uid_.find(uid);
    const UidUsage mine = found == by_uid_.end() ? UidUsage{} : found->second;
    if (uid_quota_bytes_ > 0 && bytes > uid_quota_bytes_ - mine.bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "uid ", UidText(uid), " cannot allocate ", bytes, " bytes of ", BufferKindName(kind),
          " memory", LabelSuffix(label), ": it uses ", mine.bytes, " bytes of its memory quota of ",
          uid_quota_bytes_, " bytes (--memory_quota_mib_per_uid)"));
    }
    if (new_segment && max_segments_ > 0 && segments_ >= max_segments_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", BufferKindName(kind), " memory", LabelSuffix(label),
          ": flatshardd has ", segments_, " shared-memory segments open, its budget is ",
          max_segments_, " (its descriptor limit minus --fd_reserve; raise LimitNOFILE=)"));
    }
    if (new_segment && uid_quota_segments_ > 0 && mine.segments >= uid_quota_segments_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("uid ", UidText(uid), " cannot allocate ", BufferKindName(kind), " memory",
                       LabelSuffix(label), ": it has ", mine.segments,
                       " shared-memory segments open, its segment quota is ", uid_quota_segments_,
                       " (--max_segments_per_uid)"));
    }
    bytes_by_kind_[static_cast<int>(kind)] += bytes;
    total_bytes_ += bytes;
    UidUsage& usage = by_uid_[uid];
    usage.bytes += bytes;
    if (new_segment) {
      ++segments_;
      ++usage.segments;
    }
    if (recommit) --decommitted_buffers_;
    return absl::OkStatus();
  }

  // Undoes Charge; `to_decommitted`: the buffer is (again) decommitted; `segment`: the
  // charge took a segment that is not kept.
  void Uncharge(BufferKind kind, int64_t bytes, bool to_decommitted, int64_t uid, bool segment)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    bytes_by_kind_[static_cast<int>(kind)] -= bytes;
    total_bytes_ -= bytes;
    UncountLocked(uid, bytes, segment);
    if (to_decommitted) ++decommitted_buffers_;
  }

  // The usage of one uid (tests, status).
  std::pair<int64_t, int64_t> UidBytesAndSegments(int64_t uid) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = by_uid_.find(uid);
    if (it == by_uid_.end()) return {0, 0};
    return {it->second.bytes, it->second.segments};
  }

  // Records a new live segment. FAILED_PRECONDITION when Shutdown() ran since Charge: the
  // caller then drops the segment (which unlinks it) and uncharges.
  absl::Status Register(const std::string& name, BufferKind kind = BufferKind::kStaging)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (shutdown_) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm segment ", name, ": the shard store shut down meanwhile"));
    }
    live_segments_[name] = kind;
    return absl::OkStatus();
  }

  // A buffer is gone: forget its segment and return its committed bytes.
  void Release(const std::string& name, BufferKind kind, int64_t committed_bytes, bool decommitted,
               int64_t uid) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    live_segments_.erase(name);
    UncountLocked(uid, committed_bytes, /*segment=*/true);
    bytes_by_kind_[static_cast<int>(kind)] -= committed_bytes;
    total_bytes_ -= committed_bytes;
    if (decommitted) --decommitted_buffers_;
  }

  MemoryUsage Usage() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return UsageLocked();
  }

  // Device buffers: counted here for Usage() and for `uid`'s device quota (each GPU's pool
  // limits its own bytes). `buffers`: 1 for a new buffer. Nothing changes on refusal.
  absl::Status ChargeDevice(int64_t uid, int64_t bytes, int64_t buffers, BufferKind kind,
                            absl::string_view label) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto found = device_by_uid_.find(uid);
    const int64_t mine = found == device_by_uid_.end() ? 0 : found->second;
    if (uid_quota_device_bytes_ > 0 && bytes > uid_quota_device_bytes_ - mine) {
      return absl::ResourceExhaustedError(
          absl::StrCat("uid ", UidText(uid), " cannot allocate ", bytes, " bytes of ",
                       BufferKindName(kind), " device memory", LabelSuffix(label), ": it uses ",
                       mine, " bytes of its GPU memory quota of ", uid_quota_device_bytes_,
                       " bytes (--gpu_memory_quota_mib_per_uid)"));
    }
    device_by_uid_[uid] += bytes;
    device_bytes_ += bytes;
    device_buffers_ += buffers;
    return absl::OkStatus();
  }
  // Undoes ChargeDevice (`buffers`: 1 when the buffer is gone).
  void UnchargeDevice(int64_t uid, int64_t bytes, int64_t buffers) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    device_bytes_ -= bytes;
    device_buffers_ -= buffers;
    auto it = device_by_uid_.find(uid);
    if (it != device_by_uid_.end() && (it->second -= bytes) == 0) device_by_uid_.erase(it);
  }
  int64_t DeviceBytesOf(int64_t uid) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = device_by_uid_.find(uid);
    return it == device_by_uid_.end() ? 0 : it->second;
  }
  bool shut_down() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return shutdown_;
  }

  // Marks the store shut down and returns the names still alive, but those of kShard and
  // kGradShard buffers when `keep_durable` (they are kept: KeepsName).
  std::vector<std::string> Shutdown(bool keep_durable = false) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    std::vector<std::string> out;
    for (const auto& [name, kind] : live_segments_) {
      if (keep_durable && (kind == BufferKind::kShard || kind == BufferKind::kGradShard)) {
        kept_names_.insert(name);
      } else {
        out.push_back(name);
      }
    }
    return out;
  }
  // The segment outlives its buffer (Shutdown with keep_durable, Buffer::Disown).
  void Keep(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    kept_names_.insert(name);
  }
  bool KeepsName(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return kept_names_.contains(name);
  }
  int64_t kept_count() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(kept_names_.size());
  }

 private:
  struct UidUsage {
    int64_t bytes = 0;     // committed host bytes
    int64_t segments = 0;  // live host segments
  };

  static std::string UidText(int64_t uid) {
    return uid < 0 ? std::string("(remote)") : absl::StrCat(uid);
  }

  void UncountLocked(int64_t uid, int64_t bytes, bool segment) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (segment) --segments_;
    auto it = by_uid_.find(uid);
    if (it == by_uid_.end()) return;
    it->second.bytes -= bytes;
    if (segment) --it->second.segments;
    if (it->second.bytes == 0 && it->second.segments == 0) by_uid_.erase(it);
  }

  static std::string LabelSuffix(absl::string_view label) {
    return label.empty() ? "" : absl::StrCat(" (", label, ")");
  }

  MemoryUsage UsageLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    MemoryUsage usage;
    usage.bytes_by_kind = bytes_by_kind_;
    usage.total_bytes = total_bytes_;
    usage.limit_bytes = limit_bytes_;
    usage.buffers = static_cast<int64_t>(live_segments_.size()) + device_buffers_;
    usage.device_bytes = device_bytes_;
    usage.decommitted_buffers = decommitted_buffers_;
    return usage;
  }

  const int64_t limit_bytes_;
  const int64_t uid_quota_bytes_;         // 0: none
  const int64_t max_segments_;            // 0: none
  const int64_t uid_quota_segments_;      // 0: none
  const int64_t uid_quota_device_bytes_;  // 0: none
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, int64_t> device_by_uid_ ABSL_GUARDED_BY(mu_);  // committed
  int64_t segments_ ABSL_GUARDED_BY(mu_) = 0;  // charged host segments (live or being made)
  absl::flat_hash_map<int64_t, UidUsage> by_uid_ ABSL_GUARDED_BY(mu_);
  std::array<int64_t, kNumBufferKinds> bytes_by_kind_ ABSL_GUARDED_BY(mu_){};
  int64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t decommitted_buffers_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t device_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t device_buffers_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, BufferKind> live_segments_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> kept_names_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace internal

absl::string_view BufferKindName(BufferKind kind) {
  switch (kind) {
    case BufferKind::kShard:
      return "shard";
    case BufferKind::kGradShard:
      return "grad_shard";
    case BufferKind::kUnsharded:
      return "unsharded";
    case BufferKind::kStaging:
      return "staging";
  }
  return "unknown";
}

std::string MemoryUsage::DebugString() const {
  std::string out;
  for (int k = 0; k < kNumBufferKinds; ++k) {
    absl::StrAppend(&out, BufferKindName(static_cast<BufferKind>(k)), "=", bytes_by_kind[k], " ");
  }
  absl::StrAppend(&out, "total=", total_bytes, " limit=", limit_bytes, " buffers=", buffers);
  if (device_bytes > 0) absl::StrAppend(&out, " device=", device_bytes);
  if (decommitted_buffers > 0) absl::StrAppend(&out, " decommitted=", decommitted_buffers);
  return out;
}

Buffer::Buffer(std::shared_ptr<internal::StoreState> state, BufferKind kind, Placement placement,
               int64_t bytes, ShmSegment segment, std::shared_ptr<gpu::DeviceBlock> block,
               std::shared_ptr<gpu::DevicePool> pool, std::string label, int64_t owner_uid)
    : state_(std::move(state)),
      kind_(kind),
      placement_(placement),
      bytes_(bytes),
      owner_uid_(owner_uid),
      segment_(std::move(segment)),
      pool_(std::move(pool)),
      label_(std::move(label)),
      block_(std::move(block)) {}

Buffer::~Buffer() {
  bool committed;
  {
    absl::MutexLock lock(&mu_);
    committed = committed_;
    block_.reset();  // back to its pool
  }
  if (on_device()) {
    state_->UnchargeDevice(owner_uid_, committed ? bytes_ : 0, 1);
    FS_VLOG(2) << "freed kind=" << BufferKindName(kind_) << " bytes=" << bytes_
               << " device=" << placement_.device << " " << label_;
    return;
  }
  if (pinned_) gpu::UnpinHostMemory(segment_.data());
  if (state_->KeepsName(segment_.name())) segment_.Disown();  // left for the next daemon
  // Forget the name first: a concurrent Shutdown() then no longer unlinks it, and the
  // segment's destructor below does (ENOENT, silently, if Shutdown() got there first).
  state_->Release(segment_.name(), kind_, committed ? bytes() : 0, !committed, owner_uid_);
  FS_VLOG(2) << "freed kind=" << BufferKindName(kind_) << " bytes=" << bytes()
             << " segment=" << segment_.name() << " " << label_;
}

collective::MutableBuffer Buffer::view(DType dtype) const {
  return collective::MutableBuffer{data(), static_cast<size_t>(bytes_), dtype, placement_.kind};
}

std::string Buffer::segment_name() const {
  if (!on_device()) return segment_.name();
  absl::MutexLock lock(&mu_);
  return block_ == nullptr ? std::string() : absl::StrCat("cuda-slab-", block_->slab_id());
}

int64_t Buffer::segment_bytes() const {
  if (!on_device()) return bytes_;
  absl::MutexLock lock(&mu_);
  return block_ == nullptr ? 0 : static_cast<int64_t>(block_->slab_bytes());
}

int64_t Buffer::offset() const {
  if (!on_device()) return 0;
  absl::MutexLock lock(&mu_);
  return block_ == nullptr ? 0 : static_cast<int64_t>(block_->offset());
}

void* Buffer::data() const {
  if (!on_device()) return segment_.data();
  absl::MutexLock lock(&mu_);
  return block_ == nullptr ? nullptr : block_->data();
}

std::string Buffer::ipc_handle() const {
  if (!on_device()) return "";
  absl::MutexLock lock(&mu_);
  return block_ == nullptr ? std::string() : block_->ipc_handle();
}

std::string Buffer::device_uuid() const {
  if (!on_device()) return "";
  absl::MutexLock lock(&mu_);
  return block_ == nullptr ? std::string() : block_->device_uuid();
}

bool Buffer::committed() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

absl::Status Buffer::Decommit() {
  if (kind_ != BufferKind::kUnsharded && kind_ != BufferKind::kStaging) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot decommit a ", BufferKindName(kind_), " buffer (", label_,
                     "): only unsharded and staging buffers give their pages back"));
  }
  absl::MutexLock lock(&mu_);
  if (!committed_) return absl::OkStatus();
  if (on_device()) {
    block_.reset();  // the slab stays in the pool: trainers' IPC mappings stay valid
    committed_ = false;
    state_->UnchargeDevice(owner_uid_, bytes_, 0);
    return absl::OkStatus();
  }
  absl::Status status = segment_.Decommit(0, segment_.size());
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("decommit ", BufferKindName(kind_), " buffer (",
                                                    label_, "): ", status.message()));
  }
  committed_ = false;
  state_->Uncharge(kind_, bytes(), /*to_decommitted=*/true, owner_uid_, /*segment=*/false);
  return absl::OkStatus();
}

absl::Status Buffer::Commit() {
  absl::MutexLock lock(&mu_);
  if (committed_) return absl::OkStatus();
  if (on_device()) {
    if (state_->shut_down()) {
      return absl::FailedPreconditionError(absl::StrCat("commit ", BufferKindName(kind_),
                                                        " buffer (", label_,
                                                        "): the shard store is shut down"));
    }
    FS_RETURN_IF_ERROR(state_->ChargeDevice(owner_uid_, bytes_, 0, kind_, label_));
    absl::StatusOr<std::shared_ptr<gpu::DeviceBlock>> block =
        pool_->Allocate(static_cast<size_t>(bytes_), label_);
    if (!block.ok()) {
      state_->UnchargeDevice(owner_uid_, bytes_, 0);
      return block.status();
    }
    block_ = *std::move(block);
    committed_ = true;
    return absl::OkStatus();
  }
  FS_RETURN_IF_ERROR(state_->Charge(kind_, bytes(), label_, /*recommit=*/true, owner_uid_,
                                    /*new_segment=*/false));
  absl::Status status = segment_.Commit(0, segment_.size());
  if (!status.ok()) {
    state_->Uncharge(kind_, bytes(), /*to_decommitted=*/true, owner_uid_, /*segment=*/false);
    return absl::Status(status.code(), absl::StrCat("commit ", BufferKindName(kind_), " buffer (",
                                                    label_, "): ", status.message()));
  }
  committed_ = true;
  return absl::OkStatus();
}

absl::Status ShardStore::ValidateOptions(const ShardStoreOptions& options) {
  FS_RETURN_IF_ERROR(ValidateSegmentPrefix(options.segment_prefix));
  if (options.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory limit must be >= 0 bytes, got ", options.memory_limit_bytes));
  }
  if (options.memory_quota_bytes_per_uid < 0 || options.max_segments < 0 ||
      options.max_segments_per_uid < 0 || options.device_quota_bytes_per_uid < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quotas must be >= 0 (0: none), got memory_quota_bytes_per_uid=",
                     options.memory_quota_bytes_per_uid, " max_segments=", options.max_segments,
                     " max_segments_per_uid=", options.max_segments_per_uid,
                     " device_quota_bytes_per_uid=", options.device_quota_bytes_per_uid));
  }
  return absl::OkStatus();
}

ShardStore::ShardStore(ShardStoreOptions options)
    : options_(std::move(options)),
      options_status_(ValidateOptions(options_)),
      state_(std::make_shared<internal::StoreState>(options_)) {}

ShardStore::~ShardStore() = default;

absl::StatusOr<std::shared_ptr<Buffer>> ShardStore::Allocate(BufferKind kind, int64_t bytes,
                                                             absl::string_view label,
                                                             int64_t owner_uid,
                                                             Placement placement) {
  FS_RETURN_IF_ERROR(options_status_);
  if (bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot allocate ", bytes, " bytes of ",
                                                   BufferKindName(kind), " memory (", label,
                                                   "): negative size"));
  }
  if (placement.on_device()) return AllocateOnDevice(kind, bytes, label, placement, owner_uid);
  // Charge first so concurrent allocations can never overshoot the limit together; the
  // syscalls (fallocate of a large segment is slow) then run without the lock.
  FS_RETURN_IF_ERROR(
      state_->Charge(kind, bytes, label, /*recommit=*/false, owner_uid, /*new_segment=*/true));
  absl::StatusOr<ShmSegment> segment =
      ShmSegment::Create(MakeSegmentName(options_.segment_prefix), static_cast<size_t>(bytes));
  // A restarted daemon may have the pid of the one whose segments it adopted (containers):
  // their names can come up again; take the next one.
  for (int i = 0; i < 1024 && !segment.ok() && absl::IsAlreadyExists(segment.status()); ++i) {
    segment =
        ShmSegment::Create(MakeSegmentName(options_.segment_prefix), static_cast<size_t>(bytes));
  }
  if (!segment.ok()) {
    state_->Uncharge(kind, bytes, /*to_decommitted=*/false, owner_uid, /*segment=*/true);
    return absl::Status(segment.status().code(),
                        absl::StrCat("cannot allocate ", bytes, " bytes of ", BufferKindName(kind),
                                     " memory (", label, "): ", segment.status().message()));
  }
  if (owner_uid >= 0 && static_cast<uid_t>(owner_uid) != ::geteuid() &&
      ::fchown(segment->fd(), static_cast<uid_t>(owner_uid), static_cast<gid_t>(-1)) != 0) {
    const int err = errno;
    state_->Uncharge(kind, bytes, /*to_decommitted=*/false, owner_uid, /*segment=*/true);
    return absl::PermissionDeniedError(
        absl::StrCat("cannot give segment ", segment->name(), " (", label, ") to uid ", owner_uid,
                     ": fchown: ", std::strerror(err),
                     " (flatshardd needs CAP_CHOWN to serve trainers of "
                     "another uid; run it as root or run the trainers as uid ",
                     ::geteuid(), ")"));
  }
  const bool pin = placement.kind == collective::MemoryKind::kHostPinned && bytes > 0 &&
                   options_.pin_host_memory;
  if (pin) {
    // Page-locked so the device copies of offload_to_cpu run at DMA speed.
    if (absl::Status pin = gpu::PinHostMemory(segment->data(), static_cast<size_t>(bytes));
        !pin.ok()) {
      state_->Uncharge(kind, bytes, /*to_decommitted=*/false, owner_uid, /*segment=*/true);
      return absl::Status(pin.code(),
                          absl::StrCat("cannot pin ", bytes, " bytes of ", BufferKindName(kind),
                                       " memory (", label, "): ", pin.message()));
    }
  }
  if (absl::Status status = state_->Register(segment->name(), kind); !status.ok()) {
    if (pin) gpu::UnpinHostMemory(segment->data());
    state_->Uncharge(kind, bytes, /*to_decommitted=*/false, owner_uid, /*segment=*/true);
    return status;  // `segment` goes out of scope: unmapped and unlinked
  }
  FS_VLOG(2) << "allocated kind=" << BufferKindName(kind) << " bytes=" << bytes
             << " segment=" << segment->name() << " " << label;
  auto buffer =
      std::shared_ptr<Buffer>(new Buffer(state_, kind, placement, bytes, *std::move(segment),
                                         nullptr, nullptr, std::string(label), owner_uid));
  buffer->pinned_ = pin;
  return buffer;
}

absl::StatusOr<std::shared_ptr<Buffer>> ShardStore::AllocateOnDevice(BufferKind kind, int64_t bytes,
                                                                     absl::string_view label,
                                                                     Placement placement,
                                                                     int64_t owner_uid) {
  const int device = placement.device;
  if (device < 0 || device >= static_cast<int>(options_.device_pools.size()) ||
      options_.device_pools[device] == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot allocate ", bytes, " bytes of ", BufferKindName(kind), " memory (", label,
        ") on GPU ", device, ": this daemon does not use that GPU (see --gpus)"));
  }
  if (state_->shut_down()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot allocate ", bytes, " bytes of ",
                                                      BufferKindName(kind), " memory (", label,
                                                      "): the shard store is shut down"));
  }
  const std::shared_ptr<gpu::DevicePool>& pool = options_.device_pools[device];
  FS_RETURN_IF_ERROR(state_->ChargeDevice(owner_uid, bytes, 1, kind, label));
  absl::StatusOr<std::shared_ptr<gpu::DeviceBlock>> block =
      pool->Allocate(static_cast<size_t>(bytes), label);
  if (!block.ok()) {
    state_->UnchargeDevice(owner_uid, bytes, 1);
    return block.status();
  }
  FS_VLOG(2) << "allocated kind=" << BufferKindName(kind) << " bytes=" << bytes
             << " device=" << device << " slab=" << (*block)->slab_id() << "+" << (*block)->offset()
             << " " << label;
  return std::shared_ptr<Buffer>(new Buffer(state_, kind, placement, bytes, ShmSegment(),
                                            *std::move(block), pool, std::string(label),
                                            owner_uid));
}

MemoryUsage ShardStore::Usage() const { return state_->Usage(); }

ShardStore::UidUsage ShardStore::UsageOf(int64_t uid) const {
  const auto [bytes, segments] = state_->UidBytesAndSegments(uid);
  return UidUsage{bytes, segments, state_->DeviceBytesOf(uid)};
}

void Buffer::Disown() {
  if (!on_device()) state_->Keep(segment_.name());
}

absl::StatusOr<std::shared_ptr<Buffer>> ShardStore::Adopt(BufferKind kind,
                                                          const std::string& segment_name,
                                                          int64_t bytes, absl::string_view label,
                                                          int64_t owner_uid, bool populate) {
  FS_RETURN_IF_ERROR(options_status_);
  const std::string prefix = absl::StrCat("/", options_.segment_prefix, ".");
  if (segment_name.compare(0, prefix.size(), prefix) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment ", segment_name, " (", label, ") does not have this daemon's prefix ", prefix));
  }
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment ", segment_name, " (", label, "): negative size ", bytes));
  }
  FS_RETURN_IF_ERROR(
      state_->Charge(kind, bytes, label, /*recommit=*/false, owner_uid, /*new_segment=*/true));
  absl::StatusOr<ShmSegment> segment =
      ShmSegment::Adopt(segment_name, static_cast<size_t>(bytes), populate);
  if (segment.ok()) {
    // Allocate gives a segment to its owner uid (remote callers: the daemon's uid keeps it).
    const uid_t expected = owner_uid >= 0 ? static_cast<uid_t>(owner_uid) : ::geteuid();
    struct stat st = {};
    if (::fstat(segment->fd(), &st) != 0 || st.st_uid != expected) {
      segment->Disown();  // not ours: leave it as it is
      segment = absl::FailedPreconditionError(absl::StrCat("shm segment ", segment_name,
                                                           " belongs to uid ", st.st_uid,
                                                           ", the record says uid ", expected));
    }
  }
  if (!segment.ok()) {
    state_->Uncharge(kind, bytes, /*to_decommitted=*/false, owner_uid, /*segment=*/true);
    return absl::Status(segment.status().code(),
                        absl::StrCat("cannot adopt ", BufferKindName(kind), " segment (", label,
                                     "): ", segment.status().message()));
  }
  if (absl::Status status = state_->Register(segment->name(), kind); !status.ok()) {
    segment->Disown();  // not ours to remove
    state_->Uncharge(kind, bytes, /*to_decommitted=*/false, owner_uid, /*segment=*/true);
    return status;
  }
  FS_VLOG(2) << "adopted kind=" << BufferKindName(kind) << " bytes=" << bytes
             << " segment=" << segment->name() << " " << label;
  return std::shared_ptr<Buffer>(new Buffer(state_, kind, Placement::Host(), bytes,
                                            *std::move(segment), nullptr, nullptr,
                                            std::string(label), owner_uid));
}

void ShardStore::Shutdown() { Shutdown(/*keep_durable=*/false); }

void ShardStore::Shutdown(bool keep_durable) {
  const std::vector<std::string> names = state_->Shutdown(keep_durable);
  int unlinked = 0;
  for (const std::string& name : names) {
    // ENOENT: the buffer was dropped meanwhile and unlinked its own name.
    if (::shm_unlink(name.c_str()) == 0) {
      ++unlinked;
    } else if (errno != ENOENT) {
      FS_LOG(WARNING) << "shm_unlink " << name << " at shutdown: errno " << errno;
    }
  }
  FS_LOG(INFO) << "shard store shut down: unlinked " << unlinked
               << " shm segments with prefix=" << options_.segment_prefix
               << (keep_durable ? absl::StrCat(", kept ", state_->kept_count(),
                                               " (shards, gradient shards, committed copies)")
                                : std::string())
               << "; " << state_->Usage().DebugString();
}

}  // namespace flatshard::server
