#include "server/collective/staging/staging_communicator.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace flatshard::collective {
namespace {

// Idle staging buffers kept per (kind, device, bytes): enough for every local rank of a node.
constexpr size_t kMaxIdlePerSize = 8;
// Idle staging bytes kept in all; beyond this, released buffers are freed.
constexpr size_t kMaxIdleBytes = size_t{4} << 30;

// Reuses staging buffers across ops: a training loop issues the same sizes every step, and
// cudaHostAlloc/cudaMalloc per op would cost more than the copies.
class StagingCache : public std::enable_shared_from_this<StagingCache> {
 public:
  explicit StagingCache(std::shared_ptr<DeviceCopier> copier) : copier_(std::move(copier)) {}

  // A buffer of exactly `bytes` (> 0); when its last reference drops it returns to the cache.
  absl::StatusOr<std::shared_ptr<void>> Acquire(MemoryKind kind, int device, size_t bytes) {
    const Key key{kind, device, bytes};
    std::shared_ptr<void> raw;
    {
      absl::MutexLock lock(&mu_);
      auto it = idle_.find(key);
      if (it != idle_.end() && !it->second.empty()) {
        raw = std::move(it->second.back());
        it->second.pop_back();
        idle_bytes_ -= bytes;
      }
    }
    if (raw == nullptr) {
      absl::StatusOr<std::shared_ptr<void>> fresh = copier_->AllocateStaging(kind, device, bytes);
      if (!fresh.ok()) {
        return absl::Status(
            fresh.status().code(),
            absl::StrCat("staging buffer of ", bytes, " bytes (", MemoryKindName(kind), ", device ",
                         device, "): ", fresh.status().message()));
      }
      raw = *std::move(fresh);
    }
    void* data = raw.get();
    std::weak_ptr<StagingCache> weak = weak_from_this();
    return std::shared_ptr<void>(data, [weak, key, raw = std::move(raw)](void*) mutable {
      if (std::shared_ptr<StagingCache> cache = weak.lock()) cache->Release(key, std::move(raw));
    });
  }

 private:
  using Key = std::tuple<MemoryKind, int, size_t>;

  void Release(const Key& key, std::shared_ptr<void> raw) {
    {
      absl::MutexLock lock(&mu_);
      std::vector<std::shared_ptr<void>>& list = idle_[key];
      if (list.size() < kMaxIdlePerSize && idle_bytes_ + std::get<2>(key) <= kMaxIdleBytes) {
        idle_bytes_ += std::get<2>(key);
        list.push_back(std::move(raw));
      }
    }
    // A buffer not kept is freed here, outside the lock (cudaFreeHost / cudaFree).
  }

  const std::shared_ptr<DeviceCopier> copier_;
  absl::Mutex mu_;
  std::map<Key, std::vector<std::shared_ptr<void>>> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// One copy-out a rank's op owes after the inner op succeeded.
struct CopyOut {
  void* dst = nullptr;
  MemoryKind dst_kind = MemoryKind::kHost;
  const void* src = nullptr;
  MemoryKind src_kind = MemoryKind::kHost;
  size_t bytes = 0;
};

// A staging buffer shared by the local ranks that pass the same output for one op_seq.
struct SharedStage {
  std::shared_ptr<void> staging;
  CopyOut out;     // the whole buffer, staged -> user's
  int device = 0;  // `staging`'s, the first member's
  // Device staging (NCCL): members on other GPUs get a buffer of their own device, since NCCL
  // ranks cannot share one; after the op every copy holds the same bytes, and `staging` is the
  // one copied out. Host staging is shared by every member (one assembled copy per node).
  absl::flat_hash_map<int, std::shared_ptr<void>> other_devices;
  int members = 0;        // ranks that joined
  int completed = 0;      // of them, whose inner op completed (or failed before it)
  bool copy_out = false;  // some member's buffer is written by the op (not Broadcast's root)
  absl::Status first_error;
  std::vector<std::pair<DoneCallback, absl::Status>> finished;  // waiting for the last member
};

struct SharedKey {
  uint64_t op_seq;
  const void* data;
  size_t bytes;
  bool operator==(const SharedKey& o) const {
    return op_seq == o.op_seq && data == o.data && bytes == o.bytes;
  }
  template <typename H>
  friend H AbslHashValue(H h, const SharedKey& k) {
    return H::combine(std::move(h), k.op_seq, k.data, k.bytes);
  }
};

// One rank's staged op, from issue to its callback.
struct StagedCall {
  DoneCallback done;
  int device = 0;
  std::vector<std::shared_ptr<void>> keep;  // its own staging buffers
  std::vector<CopyOut> outs;                // its own copy-outs
  std::shared_ptr<SharedStage> shared;      // its shared output, if any
  SharedKey shared_key{};
};

// What the inner op's callbacks need, alive as long as any of them may run.
struct State {
  State(std::shared_ptr<DeviceCopier> c, MemoryKind k)
      : copier(std::move(c)),
        staging_kind(k == MemoryKind::kCuda ? MemoryKind::kCuda : MemoryKind::kHostPinned),
        cache(std::make_shared<StagingCache>(copier)) {}

  absl::Status Copy(const CopyOut& c, int device) {
    return copier->Copy(c.dst, c.dst_kind, c.src, c.src_kind, c.bytes, device);
  }

  // Finishes `call` with the inner op's (or staging's) status `s`: copies out, then runs the
  // callback, or for a shared output leaves it to the last member. No lock is held here.
  void Complete(std::unique_ptr<StagedCall> call, absl::Status s) {
    if (s.ok()) {
      for (const CopyOut& c : call->outs) {
        absl::Status copied = Copy(c, call->device);
        if (!copied.ok()) {
          s = absl::Status(copied.code(), absl::StrCat("copying out the ", c.bytes,
                                                       "-byte output: ", copied.message()));
          SetPendingAbort(s);
          break;
        }
      }
    }
    call->keep.clear();
    if (call->shared == nullptr) {
      call->done(std::move(s));
      return;
    }
    std::shared_ptr<SharedStage> stage = std::move(call->shared);
    std::vector<std::pair<DoneCallback, absl::Status>> finished;
    {
      absl::MutexLock lock(&mu);
      ++stage->completed;
      if (!s.ok() && stage->first_error.ok()) stage->first_error = s;
      stage->finished.emplace_back(std::move(call->done), std::move(s));
      if (stage->completed < stage->members) return;
      auto it = shared.find(call->shared_key);
      if (it != shared.end() && it->second == stage) shared.erase(it);
      finished = std::move(stage->finished);
    }
    // The last member: every rank sharing the buffer is done with the staging copy.
    absl::Status result = stage->first_error;
    if (result.ok() && stage->copy_out) {
      absl::Status copied = Copy(stage->out, stage->device);
      if (!copied.ok()) {
        result = absl::Status(
            copied.code(),
            absl::StrCat(
                "copying out the ", stage->out.bytes, "-byte output",
                stage->members > 1 ? absl::StrCat(" (shared by ", stage->members, " ranks)") : "",
                ": ", copied.message()));
        SetPendingAbort(result);
      }
    }
    stage->staging.reset();
    stage->other_devices.clear();
    for (auto& [done, own] : finished) done(own.ok() ? result : own);
  }

  // A copy-out failed on a callback thread: the inner communicator is aborted by the next call
  // into the staging communicator (a callback must not race the communicator's destruction).
  void SetPendingAbort(const absl::Status& s) {
    absl::MutexLock lock(&mu);
    if (pending_abort.ok()) pending_abort = s;
  }

  const std::shared_ptr<DeviceCopier> copier;
  const MemoryKind staging_kind;
  const std::shared_ptr<StagingCache> cache;

  absl::Mutex mu;
  absl::flat_hash_map<SharedKey, std::shared_ptr<SharedStage>> shared ABSL_GUARDED_BY(mu);
  absl::Status pending_abort ABSL_GUARDED_BY(mu);
};

class StagingCommunicator final : public Communicator {
 public:
  StagingCommunicator(std::unique_ptr<Communicator> inner, MemoryKind inner_kind,
                      const GroupSpec& spec, std::shared_ptr<DeviceCopier> copier)
      : inner_(std::move(inner)),
        inner_kind_(inner_kind),
        // NCCL moves device memory itself (staging only serves the odd host buffer); a host
        // backend moves device memory only through staging, which the label says.
        backend_name_(inner_kind != MemoryKind::kCuda
                          ? absl::StrCat(inner_->backend_name(), "+staging")
                          : std::string(inner_->backend_name())),
        state_(std::make_shared<State>(std::move(copier), inner_kind)) {
    for (size_t i = 0; i < spec.local_ranks.size(); ++i) {
      devices_[spec.local_ranks[i]] = i < spec.local_devices.size() ? spec.local_devices[i] : 0;
    }
  }

  // The inner communicator fails its pending ops; their callbacks only need `state_`.
  ~StagingCommunicator() override { inner_.reset(); }

  void AllGather(ConstBuffer in, MutableBuffer out, const OpOptions& options,
                 DoneCallback done) override {
    ApplyPendingAbort();
    auto call = Begin(options.rank, std::move(done));
    if (call == nullptr || (!Staged(in.kind, in.bytes) && !Staged(out.kind, out.bytes))) {
      return inner_->AllGather(Relabel(in), Relabel(out), options, Done(std::move(call), done));
    }
    MutableBuffer staged_out = Relabel(out);
    if (Staged(out.kind, out.bytes)) {
      absl::StatusOr<void*> s = JoinShared(*call, options.op_seq, out, /*writes=*/true);
      if (!s.ok()) return Fail(std::move(call), s.status());
      staged_out.data = *s;
    }
    ConstBuffer staged_in = Relabel(in);
    if (Staged(in.kind, in.bytes)) {
      const auto* ib = static_cast<const uint8_t*>(in.data);
      const auto* ob = static_cast<const uint8_t*>(out.data);
      void* slot = nullptr;
      if (Staged(out.kind, out.bytes) && ib >= ob && ib + in.bytes <= ob + out.bytes) {
        slot = static_cast<uint8_t*>(staged_out.data) + (ib - ob);  // in place
      } else {
        absl::StatusOr<void*> s = Own(*call, in.bytes);
        if (!s.ok()) return Fail(std::move(call), s.status());
        slot = *s;
      }
      absl::Status copied = CopyIn(*call, slot, in);
      if (!copied.ok()) return Fail(std::move(call), copied);
      staged_in.data = slot;
    }
    inner_->AllGather(staged_in, staged_out, options, Done(std::move(call), done));
  }

  void ReduceScatter(ConstBuffer in, MutableBuffer out, ReduceOp op, const OpOptions& options,
                     DoneCallback done) override {
    ApplyPendingAbort();
    auto call = Begin(options.rank, std::move(done));
    if (call == nullptr || (!Staged(in.kind, in.bytes) && !Staged(out.kind, out.bytes))) {
      return inner_->ReduceScatter(Relabel(in), Relabel(out), op, options,
                                   Done(std::move(call), done));
    }
    absl::StatusOr<ConstBuffer> staged_in_or = StageIn(*call, in);
    if (!staged_in_or.ok()) return Fail(std::move(call), staged_in_or.status());
    const ConstBuffer staged_in = *staged_in_or;
    MutableBuffer staged_out = Relabel(out);
    if (Staged(out.kind, out.bytes)) {
      const auto* ib = static_cast<const uint8_t*>(in.data);
      const auto* ob = static_cast<const uint8_t*>(out.data);
      if (Staged(in.kind, in.bytes) && ob >= ib && ob + out.bytes <= ib + in.bytes) {
        // `out` is this rank's slice of `in`: reduce into the same slice of the staged input.
        staged_out.data =
            const_cast<uint8_t*>(static_cast<const uint8_t*>(staged_in.data)) + (ob - ib);
      } else {
        absl::StatusOr<void*> s = Own(*call, out.bytes);
        if (!s.ok()) return Fail(std::move(call), s.status());
        staged_out.data = *s;
      }
      call->outs.push_back(
          CopyOut{out.data, out.kind, staged_out.data, state_->staging_kind, out.bytes});
    }
    inner_->ReduceScatter(staged_in, staged_out, op, options, Done(std::move(call), done));
  }

  void Broadcast(MutableBuffer buf, int root, const OpOptions& options,
                 DoneCallback done) override {
    ApplyPendingAbort();
    auto call = Begin(options.rank, std::move(done));
    if (call == nullptr || !Staged(buf.kind, buf.bytes)) {
      return inner_->Broadcast(Relabel(buf), root, options, Done(std::move(call), done));
    }
    const bool is_root = options.rank == root;
    absl::StatusOr<void*> s = JoinShared(*call, options.op_seq, buf, /*writes=*/!is_root);
    if (!s.ok()) return Fail(std::move(call), s.status());
    if (is_root) {
      absl::Status copied = CopyIn(*call, *s, buf.AsConst());
      if (!copied.ok()) return Fail(std::move(call), copied);
    }
    MutableBuffer staged = Relabel(buf);
    staged.data = *s;
    inner_->Broadcast(staged, root, options, Done(std::move(call), done));
  }

  void Gather(ConstBuffer in, MutableBuffer out, int root, const OpOptions& options,
              DoneCallback done) override {
    ApplyPendingAbort();
    // Other ranks' `out` is ignored: never staged, and passed empty when unreachable.
    if (options.rank != root && Staged(out.kind, out.bytes)) {
      out = MutableBuffer{nullptr, 0, out.dtype, state_->staging_kind};
    }
    auto call = Begin(options.rank, std::move(done));
    if (call == nullptr || (!Staged(in.kind, in.bytes) && !Staged(out.kind, out.bytes))) {
      return inner_->Gather(Relabel(in), Relabel(out), root, options, Done(std::move(call), done));
    }
    absl::StatusOr<ConstBuffer> staged_in_or = StageIn(*call, in);
    if (!staged_in_or.ok()) return Fail(std::move(call), staged_in_or.status());
    const ConstBuffer staged_in = *staged_in_or;
    MutableBuffer staged_out = Relabel(out);
    if (Staged(out.kind, out.bytes)) {
      absl::StatusOr<void*> s = Own(*call, out.bytes);
      if (!s.ok()) return Fail(std::move(call), s.status());
      staged_out.data = *s;
      call->outs.push_back(CopyOut{out.data, out.kind, *s, state_->staging_kind, out.bytes});
    }
    inner_->Gather(staged_in, staged_out, root, options, Done(std::move(call), done));
  }

  void Abort(absl::Status reason) override {
    ApplyPendingAbort();
    inner_->Abort(std::move(reason));
  }

  absl::Status status() const override {
    ApplyPendingAbort();
    return inner_->status();
  }

  std::vector<PendingOpInfo> PendingOps() const override {
    ApplyPendingAbort();
    return inner_->PendingOps();
  }
  absl::string_view backend_name() const override { return backend_name_; }

 private:
  // Host kinds are one for host backends; device memory only reaches a device backend.
  bool Reachable(MemoryKind kind) const {
    return inner_kind_ == MemoryKind::kCuda ? kind == MemoryKind::kCuda : kind != MemoryKind::kCuda;
  }
  bool Staged(MemoryKind kind, size_t bytes) const { return bytes > 0 && !Reachable(kind); }

  // Empty buffers of an unreachable kind travel as the staging kind (nothing to copy).
  template <typename Buffer>
  Buffer Relabel(Buffer b) const {
    if (!Reachable(b.kind)) b.kind = state_->staging_kind;
    return b;
  }

  // A call record for a local rank; null for a rank this daemon does not host (the inner
  // communicator rejects it without staging anything). `done` stays with the caller then.
  std::unique_ptr<StagedCall> Begin(int rank, DoneCallback&& done) {
    auto it = devices_.find(rank);
    if (it == devices_.end()) return nullptr;
    auto call = std::make_unique<StagedCall>();
    call->done = std::move(done);
    call->device = it->second;
    return call;
  }

  // The inner op's callback: `call` (null for pass-through, then `done` is used as is).
  DoneCallback Done(std::unique_ptr<StagedCall> call, DoneCallback& done) {
    if (call == nullptr) return std::move(done);
    if (call->keep.empty() && call->outs.empty() && call->shared == nullptr) {
      return std::move(call->done);  // a pass-through op of a local rank
    }
    return [state = state_, call = std::move(call)](absl::Status s) mutable {
      state->Complete(std::move(call), std::move(s));
    };
  }

  // Staging failed before the inner op was issued: abort the group (the other ranks would
  // otherwise wait for this one until their deadline) and finish this rank with the sticky
  // status.
  void Fail(std::unique_ptr<StagedCall> call, absl::Status error) {
    inner_->Abort(error);
    absl::Status sticky = inner_->status();
    state_->Complete(std::move(call), sticky.ok() ? error : sticky);
  }

  // `in` as the inner backend reads it: relabelled, or copied into a staging buffer of `call`.
  absl::StatusOr<ConstBuffer> StageIn(StagedCall& call, ConstBuffer in) {
    ConstBuffer staged = Relabel(in);
    if (!Staged(in.kind, in.bytes)) return staged;
    absl::StatusOr<void*> s = Own(call, in.bytes);
    if (!s.ok()) return s.status();
    if (absl::Status copied = CopyIn(call, *s, in); !copied.ok()) return copied;
    staged.data = *s;
    return staged;
  }

  absl::StatusOr<void*> Own(StagedCall& call, size_t bytes) {
    absl::StatusOr<std::shared_ptr<void>> buf =
        state_->cache->Acquire(state_->staging_kind, call.device, bytes);
    if (!buf.ok()) return buf.status();
    call.keep.push_back(*std::move(buf));
    return call.keep.back().get();
  }

  absl::Status CopyIn(StagedCall& call, void* staged, ConstBuffer in) {
    absl::Status s =
        state_->copier->Copy(staged, state_->staging_kind, in.data, in.kind, in.bytes, call.device);
    if (s.ok()) return s;
    return absl::Status(s.code(),
                        absl::StrCat("copying in ", in.bytes, " bytes of ", MemoryKindName(in.kind),
                                     " memory (device ", call.device, "): ", s.message()));
  }

  // Joins (or starts) the staging buffer shared by the local ranks passing `buf` for op_seq.
  // `writes`: this rank's buffer is written by the op, so the result must be copied out.
  absl::StatusOr<void*> JoinShared(StagedCall& call, uint64_t op_seq, MutableBuffer buf,
                                   bool writes) {
    const SharedKey key{op_seq, buf.data, buf.bytes};
    call.shared_key = key;
    const bool per_device = state_->staging_kind == MemoryKind::kCuda;
    std::shared_ptr<void> unused;  // a buffer that lost a race; freed outside the lock
    for (int attempt = 0; attempt < 2; ++attempt) {
      {
        absl::MutexLock lock(&state_->mu);
        auto it = state_->shared.find(key);
        if (it != state_->shared.end() || unused != nullptr) {
          std::shared_ptr<SharedStage>& stage = state_->shared[key];
          if (stage == nullptr) {
            stage = std::make_shared<SharedStage>();
            stage->staging = std::move(unused);
            stage->out =
                CopyOut{buf.data, buf.kind, stage->staging.get(), state_->staging_kind, buf.bytes};
            stage->device = call.device;
          }
          void* mine = stage->staging.get();
          if (per_device && call.device != stage->device) {
            auto own = stage->other_devices.find(call.device);
            if (own != stage->other_devices.end()) {
              mine = own->second.get();
            } else if (unused != nullptr) {
              mine = unused.get();
              stage->other_devices.emplace(call.device, std::move(unused));
            } else {
              mine = nullptr;  // allocate one on this rank's device, without the lock
            }
          }
          if (mine != nullptr) {
            ++stage->members;
            stage->copy_out = stage->copy_out || writes;
            call.shared = stage;
            return mine;
          }
        }
      }
      // Allocated without the lock; another rank may start the same stage meanwhile.
      absl::StatusOr<std::shared_ptr<void>> fresh =
          state_->cache->Acquire(state_->staging_kind, call.device, buf.bytes);
      if (!fresh.ok()) return fresh.status();
      unused = *std::move(fresh);
    }
    return absl::InternalError("unreachable");
  }

  void ApplyPendingAbort() const {
    absl::Status pending;
    {
      absl::MutexLock lock(&state_->mu);
      pending = std::exchange(state_->pending_abort, absl::OkStatus());
    }
    if (!pending.ok()) inner_->Abort(pending);
  }

  std::unique_ptr<Communicator> inner_;
  const MemoryKind inner_kind_;
  const std::string backend_name_;
  const std::shared_ptr<State> state_;
  absl::flat_hash_map<int, int> devices_;  // local rank -> device; immutable after construction
};

}  // namespace

std::unique_ptr<Communicator> MakeStagingCommunicator(std::unique_ptr<Communicator> inner,
                                                      MemoryKind inner_kind, const GroupSpec& spec,
                                                      std::shared_ptr<DeviceCopier> copier) {
  FS_CHECK(inner != nullptr && copier != nullptr) << "MakeStagingCommunicator needs both";
  return std::make_unique<StagingCommunicator>(std::move(inner), inner_kind, spec,
                                               std::move(copier));
}

}  // namespace flatshard::collective

namespace flatshard::collective {
namespace {

class SimulatedDeviceCopier final : public DeviceCopier {
 public:
  absl::StatusOr<std::shared_ptr<void>> AllocateStaging(MemoryKind, int, size_t bytes) override {
    return std::shared_ptr<void>(std::malloc(std::max<size_t>(bytes, 1)), std::free);
  }
  absl::Status Copy(void* dst, MemoryKind, const void* src, MemoryKind, size_t bytes,
                    int) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

std::shared_ptr<DeviceCopier> MakeSimulatedDeviceCopier() {
  return std::make_shared<SimulatedDeviceCopier>();
}

}  // namespace flatshard::collective
