#include "server/rank_devices.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/cast.h"
#include "server/collective/reduce.h"

namespace flatshard::server {

RankDevices::RankDevices(std::vector<std::shared_ptr<gpu::DeviceContext>> gpus,
                         bool device_ordering)
    : gpus_(std::move(gpus)), device_ordering_(device_ordering) {
  for (const auto& d : gpus_) {
    FS_CHECK(d != nullptr) << "RankDevices: null GPU context";
    lanes_.push_back(std::make_unique<Lane>());
  }
}

RankDevices::~RankDevices() { Stop(); }

void RankDevices::Stop() {
  {
    // From now on no lane thread starts and Post runs jobs inline (a job that posts more
    // work while the lanes drain), so the threads read below are final.
    absl::MutexLock lock(&lanes_mu_);
    destroying_ = true;
  }
  for (auto& lane : lanes_) {
    {
      absl::MutexLock lock(&lane->mu);
      lane->stop = true;
    }
    // The lane drains its queue before it returns: every queued callback runs.
    if (lane->thread.joinable()) lane->thread.join();
  }
}

gpu::DeviceContext* RankDevices::DeviceOf(int32_t rank) const {
  if (gpus_.empty()) return nullptr;
  return gpus_[static_cast<size_t>(rank) % gpus_.size()].get();
}

Placement RankDevices::PlacementOf(int32_t rank) const {
  const gpu::DeviceContext* d = DeviceOf(rank);
  return d == nullptr ? Placement::Host() : Placement::Device(d->device());
}

void RankDevices::LaneLoop(Lane* lane) {
  for (;;) {
    absl::AnyInvocable<void()> job;
    {
      absl::MutexLock lock(&lane->mu);
      auto ready = [lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane->mu) {
        return lane->stop || !lane->jobs.empty();
      };
      lane->mu.Await(absl::Condition(&ready));
      if (lane->jobs.empty()) return;  // stopped and drained
      job = std::move(lane->jobs.front());
      lane->jobs.pop_front();
    }
    job();
  }
}

void RankDevices::Post(int32_t rank, absl::AnyInvocable<void()> job) {
  Lane* lane = lanes_[static_cast<size_t>(rank) % lanes_.size()].get();
  absl::ReleasableMutexLock lock(&lanes_mu_);
  if (destroying_) {
    // Only while the lanes drain (the owner's own calls have ended): run it here rather than
    // drop a callback that must run exactly once.
    lock.Release();
    job();
    return;
  }
  {
    absl::MutexLock lane_lock(&lane->mu);
    lane->jobs.push_back(std::move(job));
  }
  if (!lane->thread.joinable()) lane->thread = std::thread(&RankDevices::LaneLoop, lane);
}

void RankDevices::AfterTrainerWrites(int32_t rank, const gpu::IpcEventRef& written,
                                     absl::AnyInvocable<void(absl::Status)> done) {
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr || written.id == 0) {
    done(absl::OkStatus());
    return;
  }
  if (absl::Status s = CheckStream(rank); !s.ok()) {
    done(std::move(s));
    return;
  }
  // The host waits on the event itself (a stream wait on an interprocess event plus a stream
  // synchronize took about 200 us on an H100 even for a completed event). Usually it has
  // completed already: one query on the caller's thread, no thread hop.
  if (absl::Status s = d->WaitOnHost(written, absl::ZeroDuration()); !absl::IsDeadlineExceeded(s)) {
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat("rank ", rank, ": waiting for the trainer's event ",
                                              written.id, ": ", s.message()));
    }
    done(std::move(s));
    return;
  }
  Post(rank, [d, rank, written, done = std::move(done)]() mutable {
    const uint64_t id = written.id;
    absl::Status s = d->WaitOnHost(written);
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat("rank ", rank, ": waiting for the trainer's event ",
                                              id, ": ", s.message()));
    }
    done(std::move(s));
  });
}

absl::Status RankDevices::CheckStream(int32_t rank) const {
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr) return absl::OkStatus();
  absl::Status s = d->StreamError();
  if (s.ok()) return s;
  return absl::FailedPreconditionError(
      absl::StrCat("rank ", rank, ": work on GPU ", d->device(), " (", d->uuid(),
                   ") that was answered already failed: ", s.message()));
}

absl::Status RankDevices::OrderOnDevice(int32_t rank, const gpu::IpcEventRef& written) {
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr) return absl::OkStatus();
  FS_RETURN_IF_ERROR(CheckStream(rank));
  if (written.id == 0) return absl::OkStatus();
  absl::Status s = d->WaitFor(written);  // a stream wait: no host wait
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("rank ", rank, ": ordering after the trainer's event ",
                                             written.id, ": ", s.message()));
}

absl::Status RankDevices::CopyAsync(int32_t rank, void* dst, const void* src, size_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  return d->CopyAsync(dst, src, bytes);
}

void RankDevices::ReleaseAfterStream(int32_t rank, std::shared_ptr<void> keep) {
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr) return;
  Post(rank, [d, keep = std::move(keep)]() mutable {
    d->Synchronize().IgnoreError();
    keep.reset();
  });
}

void RankDevices::RunBlocking(int32_t rank, absl::AnyInvocable<absl::Status()> work,
                              absl::AnyInvocable<void(absl::Status)> done) {
  if (DeviceOf(rank) == nullptr) {
    done(work());
    return;
  }
  Post(rank, [work = std::move(work), done = std::move(done)]() mutable { done(work()); });
}

gpu::IpcEventRef RankDevices::RecordReady(int32_t rank) const {
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr) return {};
  absl::StatusOr<gpu::IpcEventRef> ready = d->RecordReady();
  if (!ready.ok()) {
    // The collective already completed on the host's watch, so the bytes are in place; the
    // trainer only loses the device-side ordering hint.
    FS_LOG(WARNING) << "rank " << rank << ": recording the ready event: " << ready.status();
    return {};
  }
  return *ready;
}

absl::Status RankDevices::CopyBytes(int32_t rank, void* dst, const void* src, size_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  gpu::DeviceContext* d = DeviceOf(rank);
  if (d == nullptr) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  return d->Copy(dst, src, bytes);  // cudaMemcpy with the default kind: any direction
}

absl::StatusOr<RankDevices::OwnRangeBytes> RankDevices::OwnRange(int32_t rank, const Plan& plan,
                                                                 const PlanUnit& unit, int32_t r,
                                                                 const Buffer& full,
                                                                 const Buffer& shard) {
  absl::StatusOr<FlatLayout> layout = UnitLayout(plan, unit);
  FS_CHECK(layout.ok()) << layout.status();  // the plan was validated when it was made
  const ElementRange range = layout->UnpaddedShardRange(r);
  if (range.empty()) return OwnRangeBytes{};
  const int64_t item = ItemSize(unit.dtype);
  const int64_t offset = (range.begin - layout->ShardRange(r).begin) * item;
  const int64_t bytes = range.size() * item;
  if (offset + bytes > shard.bytes() || (range.begin * item) + bytes > full.bytes()) {
    return absl::InternalError(
        absl::StrCat("rank ", rank, " unit ", unit.index, ": shard rank ", r, "'s range [",
                     range.begin, ", ", range.begin + range.size(), ") does not fit its buffers"));
  }
  return OwnRangeBytes{static_cast<char*>(shard.data()) + offset,
                       static_cast<const char*>(full.data()) + range.begin * item,
                       static_cast<size_t>(bytes)};
}

absl::Status RankDevices::CopyOwnRange(int32_t rank, const Plan& plan, const PlanUnit& unit,
                                       int32_t r, const Buffer& full, const Buffer& shard) const {
  FS_ASSIGN_OR_RETURN(OwnRangeBytes copy, OwnRange(rank, plan, unit, r, full, shard));
  return CopyBytes(rank, copy.dst, copy.src, copy.bytes);
}

absl::Status RankDevices::CastBytes(int32_t rank, const void* src, DType from, void* dst, DType to,
                                    int64_t count) const {
  if (count <= 0) return absl::OkStatus();
  const size_t n = static_cast<size_t>(count);
  if (DeviceOf(rank) == nullptr) {
    collective::CastInto(from, src, to, dst, n);
    return absl::OkStatus();
  }
  std::vector<char> in(n * ItemSize(from)), out(n * ItemSize(to));
  FS_RETURN_IF_ERROR(CopyBytes(rank, in.data(), src, in.size()));
  collective::CastInto(from, in.data(), to, out.data(), n);
  return CopyBytes(rank, dst, out.data(), out.size());
}

absl::Status RankDevices::ApplyReducedGrad(int32_t rank, collective::ConstBuffer reduced,
                                           Buffer& grad, DType dtype, bool accumulate) const {
  const size_t bytes = static_cast<size_t>(grad.bytes());
  std::vector<char> widened;
  if (reduced.dtype != dtype && IsFloatingPoint(reduced.dtype)) {
    // reduce_dtype: cast once into host memory (from the device for GPU ranks); the copy or
    // sum below then runs in the shard's dtype.
    const int64_t count = static_cast<int64_t>(bytes) / ItemSize(dtype);
    if (static_cast<int64_t>(reduced.bytes) != count * ItemSize(reduced.dtype)) {
      return absl::InternalError(absl::StrCat(
          "rank ", rank, ": a reduced gradient of ", reduced.bytes, " bytes of ",
          DTypeName(reduced.dtype), " for a shard of ", count, " ", DTypeName(dtype), " elements"));
    }
    widened.resize(bytes);
    FS_RETURN_IF_ERROR(CastBytes(rank, reduced.data, reduced.dtype, widened.data(), dtype, count));
    reduced = collective::ConstBuffer{widened.data(), bytes, dtype};
  }
  if (!accumulate) return CopyBytes(rank, grad.data(), reduced.data, bytes);
  if (!grad.on_device()) {
    const void* srcs[] = {grad.data(), reduced.data};
    collective::ReduceInto(dtype, srcs, grad.data(), bytes / ItemSize(dtype),
                           collective::ReduceOp::kSum, 1);
    return absl::OkStatus();
  }
  // Device shards accumulate through host memory: correct, not fast (no device kernels yet).
  std::vector<char> sum(bytes), add(bytes);
  FS_RETURN_IF_ERROR(CopyBytes(rank, sum.data(), grad.data(), bytes));
  FS_RETURN_IF_ERROR(CopyBytes(rank, add.data(), reduced.data, bytes));
  const void* srcs[] = {sum.data(), add.data()};
  collective::ReduceInto(dtype, srcs, sum.data(), bytes / ItemSize(dtype),
                         collective::ReduceOp::kSum, 1);
  return CopyBytes(rank, grad.data(), sum.data(), bytes);
}

absl::Status RankDevices::CopyEach(int32_t rank, const std::vector<const Buffer*>& from,
                                   const std::vector<const Buffer*>& to) const {
  for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
    if (from[i] == nullptr || to[i] == nullptr) continue;
    if (from[i]->bytes() != to[i]->bytes()) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": copy ", i, " of ", from.size(),
                                              ": ", from[i]->bytes(), " bytes into a buffer of ",
                                              to[i]->bytes()));
    }
    FS_RETURN_IF_ERROR(
        CopyBytes(rank, to[i]->data(), from[i]->data(), static_cast<size_t>(from[i]->bytes())));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
