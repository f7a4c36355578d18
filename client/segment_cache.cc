#include "client/segment_cache.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/gpu/cuda_util.h"
#include "common/status_macros.h"

namespace flatshard::client {

// ParamViews lives in the public header; its lookup needs ModuleLayout, defined here.
ParamViews::ParamViews() = default;
ParamViews::ParamViews(ParamViews&&) noexcept = default;
ParamViews& ParamViews::operator=(ParamViews&&) noexcept = default;
ParamViews::~ParamViews() = default;

const ParamView* ParamViews::Find(absl::string_view fqn) const {
  if (layout_ == nullptr) return nullptr;
  const std::pair<int32_t, int32_t>* where = layout_->FindFqn(fqn);
  if (where == nullptr) return nullptr;
  const int32_t first = first_view_[where->first];
  if (first < 0) return nullptr;
  return &views_[first + where->second];
}

namespace internal {
namespace {

// stat(2) of the shm segment `name` ("/x" is /dev/shm/x, where glibc's shm_open keeps it):
// 0 and its identity, or the errno.
int StatSegment(const std::string& name, uint64_t* dev, uint64_t* ino) {
  struct stat st;
  if (::stat(absl::StrCat("/dev/shm", name).c_str(), &st) != 0) return errno;
  *dev = static_cast<uint64_t>(st.st_dev);
  *ino = static_cast<uint64_t>(st.st_ino);
  return 0;
}

}  // namespace

SegmentCache::SegmentCache(size_t max_entries, std::unique_ptr<DeviceMemoryOpener> opener)
    : max_entries_(max_entries),
      opener_(opener != nullptr ? std::move(opener) : NewCudaIpcOpener()),
      evict_above_(max_entries) {}

SegmentCache::~SegmentCache() {
  // Device mappings close (a CUDA call) as their last holder drops them; none is held by a
  // thread still inside Map, since Map cannot run concurrently with destruction.
  Clear();
}

absl::StatusOr<MappedRange> SegmentCache::Map(const SegmentRange& range, bool writable) {
  if (range.segment.empty()) return absl::InternalError("memory handle names no segment");
  if (range.bytes > range.segment_bytes || range.offset > range.segment_bytes - range.bytes) {
    return absl::InternalError(absl::StrCat("memory handle [", range.offset, ", +", range.bytes,
                                            ") does not fit in ", range.cuda ? "device " : "",
                                            "segment ", range.segment, " of ", range.segment_bytes,
                                            " bytes"));
  }
  return range.cuda ? MapDevice(range, writable) : MapHost(range, writable);
}

absl::StatusOr<MappedRange> SegmentCache::MapHost(const SegmentRange& range, bool writable) {
  std::shared_ptr<const ShmSegment> mapping;
  std::vector<std::shared_ptr<const void>> dropped;  // destroyed after unlocking
  {
    // Mapping under the lock makes concurrent first uses of a segment map it once; it only
    // happens the first time a segment shows up.
    absl::MutexLock lock(&mu_);
    Entry& entry = entries_[range.segment];
    std::shared_ptr<const ShmSegment>& slot = writable ? entry.read_write : entry.read_only;
    if (slot == nullptr || slot->size() < range.segment_bytes) {
      absl::StatusOr<ShmSegment> opened =
          ShmSegment::Open(range.segment, range.segment_bytes, writable);
      if (!opened.ok()) {
        if (entry.read_only == nullptr && entry.read_write == nullptr) {
          entries_.erase(range.segment);
        }
        return opened.status();
      }
      // A smaller cached mapping stays valid for the ranges that hold it.
      slot = std::make_shared<const ShmSegment>(*std::move(opened));
      ++map_calls_;
      if (entry.ino == 0) StatSegment(range.segment, &entry.dev, &entry.ino);
    }
    mapping = slot;
    if (entries_.size() + device_entries_.size() > evict_above_) EvictUnusedLocked(dropped);
  }
  MappedRange mapped;
  mapped.data = mapping->data() == nullptr || range.bytes == 0
                    ? nullptr
                    : static_cast<char*>(mapping->data()) + range.offset;
  mapped.bytes = range.bytes;
  mapped.writable = writable;
  mapped.mapping = std::move(mapping);
  return mapped;
}

absl::StatusOr<MappedRange> SegmentCache::MapDevice(const SegmentRange& range, bool writable) {
  const auto where = [&range] {
    return absl::StrCat("device segment ", range.segment, " on GPU ", range.device_uuid, ": ");
  };
  if (range.cuda_ipc_handle.size() != gpu::kIpcHandleBytes) {
    return absl::InternalError(
        absl::StrCat(where(), "CUDA IPC handle has the wrong size: ", range.cuda_ipc_handle.size(),
                     " bytes, want ", gpu::kIpcHandleBytes));
  }
  // Opening is a CUDA call, so it runs outside mu_; `opening_` makes other threads wanting
  // the same slab wait for it rather than open it a second time.
  constexpr absl::Duration kOpenWait = absl::Minutes(1);
  std::shared_ptr<const DeviceMapping> mapping;
  std::shared_ptr<const void> replaced;  // destroyed after unlocking
  {
    absl::MutexLock lock(&mu_);
    const auto not_opening = [this, &range]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::find(opening_.begin(), opening_.end(), range.segment) == opening_.end();
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&not_opening), kOpenWait)) {
      return absl::DeadlineExceededError(
          absl::StrCat(where(), "another thread's CUDA IPC open did not finish within ",
                       absl::FormatDuration(kOpenWait)));
    }
    const auto it = device_entries_.find(range.segment);
    if (it != device_entries_.end() && it->second.ipc_handle == range.cuda_ipc_handle) {
      mapping = it->second.mapping;
    } else {
      opening_.push_back(range.segment);
    }
  }
  if (mapping == nullptr) {
    absl::StatusOr<std::unique_ptr<DeviceMapping>> opened =
        opener_->Open(range.cuda_ipc_handle, range.device_uuid);
    std::vector<std::shared_ptr<const void>> dropped;
    absl::MutexLock lock(&mu_);
    opening_.erase(std::find(opening_.begin(), opening_.end(), range.segment));
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat(where(), opened.status().message()));
    }
    mapping = std::shared_ptr<const DeviceMapping>(*std::move(opened));
    ++ipc_open_calls_;
    // A slab id seen with another handle: ranges already handed out keep the old mapping.
    DeviceEntry& entry = device_entries_[range.segment];
    replaced = std::move(entry.mapping);
    entry.ipc_handle = range.cuda_ipc_handle;
    entry.mapping = mapping;
    if (entries_.size() + device_entries_.size() > evict_above_) EvictUnusedLocked(dropped);
  }
  MappedRange mapped;
  mapped.data = mapping->data() == nullptr || range.bytes == 0
                    ? nullptr
                    : static_cast<char*>(mapping->data()) + range.offset;
  mapped.bytes = range.bytes;
  mapped.writable = writable;
  mapped.device = mapping->device();
  mapped.mapping = std::move(mapping);
  return mapped;
}

void SegmentCache::EvictUnusedLocked(std::vector<std::shared_ptr<const void>>& dropped) {
  // use_count() == 1: only the cache holds it. A count can only grow through the cache (under
  // mu_), so a mapping seen unused here cannot be in use by the time it is dropped.
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.read_only != nullptr && e.read_only.use_count() == 1) e.read_only.reset();
    if (e.read_write != nullptr && e.read_write.use_count() == 1) e.read_write.reset();
    if (e.read_only == nullptr && e.read_write == nullptr) {
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = device_entries_.begin(); it != device_entries_.end();) {
    if (it->second.mapping.use_count() == 1) {
      dropped.push_back(std::move(it->second.mapping));
      device_entries_.erase(it++);
    } else {
      ++it;
    }
  }
  // Everything may still be in use: sweep again only after the cache doubled.
  evict_above_ = std::max(max_entries_, (entries_.size() + device_entries_.size()) * 2);
}

size_t SegmentCache::DropUnlinked() {
  struct Candidate {
    std::string name;
    uint64_t dev, ino;
  };
  const auto unused = [](const Entry& e) {
    return (e.read_only == nullptr || e.read_only.use_count() == 1) &&
           (e.read_write == nullptr || e.read_write.use_count() == 1);
  };
  std::vector<Candidate> candidates;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, e] : entries_) {
      if (unused(e)) candidates.push_back({name, e.dev, e.ino});
    }
  }
  std::vector<std::string> gone;
  for (const Candidate& c : candidates) {
    uint64_t dev = 0, ino = 0;
    const int err = StatSegment(c.name, &dev, &ino);
    // ENOENT: unlinked. Another file under the name: the daemon reused it (a restarted one).
    if (err == ENOENT || (err == 0 && c.ino != 0 && (dev != c.dev || ino != c.ino))) {
      gone.push_back(c.name);
    }
  }
  if (gone.empty()) return 0;
  std::vector<Entry> dropped;  // unmapped after unlocking
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& name : gone) {
      const auto it = entries_.find(name);
      // Mapped again meanwhile (a range handed out since): not ours to drop now.
      if (it == entries_.end() || !unused(it->second)) continue;
      dropped.push_back(std::move(it->second));
      entries_.erase(it);
    }
  }
  return dropped.size();
}

void SegmentCache::Clear() {
  absl::flat_hash_map<std::string, DeviceEntry> devices;  // closed after unlocking
  absl::MutexLock lock(&mu_);
  entries_.clear();
  devices.swap(device_entries_);
  evict_above_ = max_entries_;
}

int64_t SegmentCache::map_calls() const {
  absl::MutexLock lock(&mu_);
  return map_calls_;
}

int64_t SegmentCache::ipc_open_calls() const {
  absl::MutexLock lock(&mu_);
  return ipc_open_calls_;
}

size_t SegmentCache::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size() + device_entries_.size();
}

absl::StatusOr<std::shared_ptr<const ModuleLayout>> ModuleLayout::Create(
    std::shared_ptr<const Plan> plan) {
  if (plan == nullptr) return absl::InvalidArgumentError("no plan");
  std::shared_ptr<ModuleLayout> layout(new ModuleLayout());
  layout->units_.reserve(plan->units.size());
  for (size_t pos = 0; pos < plan->units.size(); ++pos) {
    const PlanUnit& unit = plan->units[pos];
    const auto where = [&unit] { return absl::StrCat("plan unit ", unit.index); };
    if (!layout->position_by_index_.emplace(unit.index, static_cast<int32_t>(pos)).second) {
      return absl::InvalidArgumentError(absl::StrCat(where(), " appears twice"));
    }
    UnitTemplate t;
    t.index = unit.index;
    t.position = static_cast<int32_t>(pos);
    t.dtype = unit.dtype;
    t.item_size = ItemSize(unit.dtype);
    t.numel = unit.numel;
    t.padded_numel = unit.padded_numel;
    t.shard_numel = unit.shard_numel;
    if (unit.numel < 0 || unit.padded_numel < unit.numel || unit.shard_numel < 0 ||
        unit.padded_numel > std::numeric_limits<int64_t>::max() / t.item_size) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": bad sizes numel=", unit.numel,
                                                     " padded_numel=", unit.padded_numel,
                                                     " shard_numel=", unit.shard_numel));
    }
    // padded_numel * item_size fits in int64, so every offset below does too.
    t.views.reserve(unit.params.size() + unit.shared.size());
    for (const PlanParam& p : unit.params) {
      if (p.offset < 0 || p.numel < 0 || p.numel > unit.padded_numel ||
          p.offset > unit.padded_numel - p.numel) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), ": param \"", p.fqn, "\" at [", p.offset, ", +", p.numel,
                         ") lies outside the unit's ", unit.padded_numel, " elements"));
      }
      const auto [it, inserted] = layout->by_fqn_.try_emplace(p.fqn, static_cast<int32_t>(pos),
                                                              static_cast<int32_t>(t.views.size()));
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(where(), ": FQN \"", p.fqn,
                                                       "\" is already in plan unit ",
                                                       plan->units[it->second.first].index));
      }
      t.views.push_back({p.fqn, p.shape, p.numel, p.offset * t.item_size});
      t.extent_bytes = std::max(t.extent_bytes, (p.offset + p.numel) * t.item_size);
    }
    for (const SharedParam& s : unit.shared) {
      // `same_as` is a param of this unit or an earlier tied FQN of it (already indexed).
      const auto target = layout->by_fqn_.find(s.same_as);
      if (target == layout->by_fqn_.end() || target->second.first != static_cast<int32_t>(pos)) {
        return absl::InvalidArgumentError(absl::StrCat(where(), ": tied param \"", s.fqn,
                                                       "\" aliases \"", s.same_as,
                                                       "\", which is not in the unit"));
      }
      ViewTemplate alias = t.views[target->second.second];
      alias.fqn = s.fqn;
      const auto [it, inserted] = layout->by_fqn_.try_emplace(s.fqn, static_cast<int32_t>(pos),
                                                              static_cast<int32_t>(t.views.size()));
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(where(), ": FQN \"", s.fqn,
                                                       "\" is already in plan unit ",
                                                       plan->units[it->second.first].index));
      }
      t.views.push_back(std::move(alias));
    }
    layout->units_.push_back(std::move(t));
  }
  // Mixed precision: the same views over buffers of the compute (or reduce) dtypes. The
  // variant's plan has those dtypes as `dtype` and none set, so it has no variants itself.
  auto variant = [&](DType (PlanUnit::*pick)()
                         const) -> absl::StatusOr<std::shared_ptr<const ModuleLayout>> {
    bool differs = false;
    for (const PlanUnit& u : plan->units) differs |= (u.*pick)() != u.dtype;
    if (!differs) return std::shared_ptr<const ModuleLayout>();
    auto copy = std::make_shared<Plan>(*plan);
    for (PlanUnit& u : copy->units) {
      u.dtype = (u.*pick)();
      u.compute_dtype.reset();
      u.reduce_dtype.reset();
    }
    return Create(std::move(copy));
  };
  FS_ASSIGN_OR_RETURN(layout->compute_, variant(&PlanUnit::ComputeDType));
  FS_ASSIGN_OR_RETURN(layout->reduce_, variant(&PlanUnit::ReduceDType));
  layout->plan_ = std::move(plan);
  return std::shared_ptr<const ModuleLayout>(std::move(layout));
}

std::shared_ptr<const ModuleLayout> ModuleLayout::Compute(
    const std::shared_ptr<const ModuleLayout>& layout) {
  return layout->compute_ ? layout->compute_ : layout;
}

std::shared_ptr<const ModuleLayout> ModuleLayout::Reduce(
    const std::shared_ptr<const ModuleLayout>& layout) {
  return layout->reduce_ ? layout->reduce_ : layout;
}

const UnitTemplate* ModuleLayout::FindUnit(int32_t index) const {
  const auto it = position_by_index_.find(index);
  return it == position_by_index_.end() ? nullptr : &units_[it->second];
}

const std::pair<int32_t, int32_t>* ModuleLayout::FindFqn(absl::string_view fqn) const {
  const auto it = by_fqn_.find(fqn);
  return it == by_fqn_.end() ? nullptr : &it->second;
}

ViewBuilder::ViewBuilder(std::shared_ptr<const ModuleLayout> layout) {
  views_.first_view_.assign(layout->units().size(), -1);
  views_.layout_ = std::move(layout);
}

absl::Status ViewBuilder::AddUnit(int32_t index, const MappedRange& range) {
  const UnitTemplate* unit = views_.layout_->FindUnit(index);
  if (unit == nullptr) {
    return absl::InternalError(
        absl::StrCat("the daemon's reply names unit ", index, ", which the plan does not have"));
  }
  int32_t& first = views_.first_view_[unit->position];
  if (first >= 0) {
    return absl::InternalError(absl::StrCat("the daemon's reply names unit ", index, " twice"));
  }
  if (range.bytes < static_cast<uint64_t>(unit->extent_bytes)) {
    return absl::InternalError(absl::StrCat("unit ", index, ": the daemon's buffer has ",
                                            range.bytes, " bytes, its parameters need ",
                                            unit->extent_bytes));
  }
  first = static_cast<int32_t>(views_.views_.size());
  char* const base = static_cast<char*>(range.data);
  for (const ViewTemplate& t : unit->views) {
    ParamView v;
    v.data = base == nullptr ? nullptr : base + t.byte_offset;
    v.shape = t.shape;
    v.dtype = unit->dtype;
    v.numel = t.numel;
    v.fqn = t.fqn;
    v.unit = index;
    v.writable = range.writable;
    v.device = range.device;
    views_.views_.push_back(std::move(v));
  }
  // Units of one summon usually share few segments; keep each mapping once per run.
  if (views_.keepalive_.empty() || views_.keepalive_.back() != range.mapping) {
    views_.keepalive_.push_back(range.mapping);
  }
  return absl::OkStatus();
}

ParamViews ViewBuilder::Build() { return std::move(views_); }

absl::Status CheckRangeHolds(const MappedRange& mapped, int64_t elements, DType dtype,
                             absl::string_view what) {
  const int64_t item = ItemSize(dtype);
  if (elements < 0 || elements > std::numeric_limits<int64_t>::max() / item ||
      static_cast<uint64_t>(elements * item) > mapped.bytes) {
    return absl::InternalError(absl::StrCat(what, ": the daemon's buffer has ", mapped.bytes,
                                            " bytes, want ", elements, " elements of ",
                                            DTypeName(dtype)));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace flatshard::client
