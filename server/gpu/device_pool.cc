#include "server/gpu/device_pool.h"

#include <atomic>
#include <iterator>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace flatshard::gpu {
namespace internal {

struct SlabRecord {
  Slab slab;
  std::map<size_t, size_t> free;  // offset -> length; disjoint, never adjacent (coalesced)
  int64_t live_blocks = 0;
};

struct PoolState {
  PoolState(DevicePoolOptions o, std::unique_ptr<SlabAllocator> a)
      : options(std::move(o)), allocator(std::move(a)) {}
  // Only slabs whose blocks all died with the pool's last reference are left here.
  ~PoolState() {
    for (auto& [id, rec] : slabs) allocator->Free(rec.slab);
  }

  const DevicePoolOptions options;
  const std::unique_ptr<SlabAllocator> allocator;

  mutable absl::Mutex mu;
  std::map<uint64_t, SlabRecord> slabs ABSL_GUARDED_BY(mu);  // by id, i.e. creation order
  // Includes slabs being allocated right now, so concurrent Allocate calls respect the limit.
  int64_t reserved_bytes ABSL_GUARDED_BY(mu) = 0;
  int64_t in_use_bytes ABSL_GUARDED_BY(mu) = 0;
  int64_t blocks ABSL_GUARDED_BY(mu) = 0;
  bool pool_alive ABSL_GUARDED_BY(mu) = true;

  std::string Where() const {
    return absl::StrCat(
        "device ", options.device,
        options.device_uuid.empty() ? "" : absl::StrCat(" (", options.device_uuid, ")"));
  }

  // Removes every slab without blocks (at most `want` bytes' worth unless `want` < 0, oldest
  // first) from the pool; the caller frees them after unlocking.
  std::vector<Slab> TakeEmptySlabs(int64_t want) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<Slab> taken;
    int64_t got = 0;
    for (auto it = slabs.begin(); it != slabs.end() && (want < 0 || got < want);) {
      if (it->second.live_blocks == 0) {
        got += static_cast<int64_t>(it->second.slab.bytes);
        reserved_bytes -= static_cast<int64_t>(it->second.slab.bytes);
        taken.push_back(std::move(it->second.slab));
        it = slabs.erase(it);
      } else {
        ++it;
      }
    }
    return taken;
  }

  int64_t EmptySlabBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    int64_t bytes = 0;
    for (const auto& [id, rec] : slabs) {
      if (rec.live_blocks == 0) bytes += static_cast<int64_t>(rec.slab.bytes);
    }
    return bytes;
  }

  void FreeSlabs(const std::vector<Slab>& taken) {
    for (const Slab& s : taken) allocator->Free(s);
  }

  // Returns [offset, offset + length) of slab `id` and coalesces it with its neighbours.
  void ReturnRange(SlabRecord& rec, size_t offset, size_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto next = rec.free.lower_bound(offset);
    if (next != rec.free.begin()) {
      auto prev = std::prev(next);
      FS_CHECK(prev->first + prev->second <= offset) << "double free in slab " << rec.slab.id;
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        length += prev->second;
        rec.free.erase(prev);
      }
    }
    if (next != rec.free.end()) {
      FS_CHECK(offset + length <= next->first) << "double free in slab " << rec.slab.id;
      if (offset + length == next->first) {
        length += next->second;
        rec.free.erase(next);
      }
    }
    rec.free.emplace(offset, length);
  }
};

}  // namespace internal

namespace {

using internal::PoolState;
using internal::SlabRecord;

std::atomic<uint64_t> next_slab_id{1};

}  // namespace

std::string DevicePoolUsage::DebugString() const {
  return absl::StrCat("reserved=", reserved_bytes, " in_use=", in_use_bytes, " limit=", limit_bytes,
                      " slabs=", slabs, " blocks=", blocks);
}

// --- DeviceBlock -----------------------------------------------------------------------------

DeviceBlock::DeviceBlock(std::shared_ptr<internal::PoolState> state, Slab slab, size_t offset,
                         size_t bytes, size_t reserved_bytes, std::string label)
    : state_(std::move(state)),
      slab_(std::move(slab)),
      offset_(offset),
      bytes_(bytes),
      reserved_bytes_(reserved_bytes),
      label_(std::move(label)) {}

DeviceBlock::~DeviceBlock() {
  std::vector<Slab> to_free;
  {
    absl::MutexLock lock(&state_->mu);
    --state_->blocks;
    state_->in_use_bytes -= static_cast<int64_t>(bytes_);
    if (reserved_bytes_ == 0) return;  // zero-byte block: no slab
    auto it = state_->slabs.find(slab_.id);
    FS_CHECK(it != state_->slabs.end()) << "block of unknown slab " << slab_.id;
    SlabRecord& rec = it->second;
    state_->ReturnRange(rec, offset_, reserved_bytes_);
    // Without a pool nobody reuses an empty slab: give it back now.
    if (--rec.live_blocks == 0 && !state_->pool_alive) {
      state_->reserved_bytes -= static_cast<int64_t>(rec.slab.bytes);
      to_free.push_back(std::move(rec.slab));
      state_->slabs.erase(it);
    }
  }
  state_->FreeSlabs(to_free);
}

void* DeviceBlock::data() const {
  return reserved_bytes_ == 0 ? nullptr : static_cast<char*>(slab_.base) + offset_;
}
size_t DeviceBlock::bytes() const { return bytes_; }
int DeviceBlock::device() const { return state_->options.device; }
const std::string& DeviceBlock::device_uuid() const { return state_->options.device_uuid; }
uint64_t DeviceBlock::slab_id() const { return slab_.id; }
size_t DeviceBlock::slab_bytes() const { return slab_.bytes; }
size_t DeviceBlock::offset() const { return offset_; }
const std::string& DeviceBlock::ipc_handle() const { return slab_.ipc_handle; }
const std::string& DeviceBlock::label() const { return label_; }

// --- DevicePool ------------------------------------------------------------------------------

std::shared_ptr<DevicePool> DevicePool::Create(DevicePoolOptions options,
                                               std::unique_ptr<SlabAllocator> allocator) {
  FS_CHECK(allocator != nullptr) << "DevicePool needs a SlabAllocator";
  FS_CHECK(options.alignment > 0 && (options.alignment & (options.alignment - 1)) == 0)
      << "DevicePoolOptions::alignment " << options.alignment << " is not a power of two";
  return std::shared_ptr<DevicePool>(
      new DevicePool(std::make_shared<PoolState>(std::move(options), std::move(allocator))));
}

DevicePool::DevicePool(std::shared_ptr<internal::PoolState> state) : state_(std::move(state)) {}

DevicePool::~DevicePool() {
  std::vector<Slab> to_free;
  {
    absl::MutexLock lock(&state_->mu);
    state_->pool_alive = false;
    to_free = state_->TakeEmptySlabs(-1);
  }
  state_->FreeSlabs(to_free);
}

int DevicePool::device() const { return state_->options.device; }
const std::string& DevicePool::device_uuid() const { return state_->options.device_uuid; }

absl::StatusOr<std::shared_ptr<DeviceBlock>> DevicePool::Allocate(size_t bytes,
                                                                  absl::string_view label) {
  PoolState& st = *state_;
  const DevicePoolOptions& o = st.options;
  if (bytes == 0) {
    absl::MutexLock lock(&st.mu);
    ++st.blocks;
    return std::shared_ptr<DeviceBlock>(
        new DeviceBlock(state_, Slab{}, 0, 0, 0, std::string(label)));
  }
  auto refuse = [&](absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
    return absl::ResourceExhaustedError(absl::StrCat(
        st.Where(), ": cannot allocate ", bytes, " bytes for '", label, "': ", why, " (reserved ",
        st.reserved_bytes, ", in use ", st.in_use_bytes, ", limit ", o.limit_bytes, ")"));
  };
  const size_t align = o.alignment;
  if (bytes > static_cast<size_t>(std::numeric_limits<int64_t>::max()) - align) {
    absl::MutexLock lock(&st.mu);
    return refuse("the request is larger than any device");
  }
  const size_t need = (bytes + align - 1) & ~(align - 1);

  std::shared_ptr<DeviceBlock> block;
  for (int attempt = 0; block == nullptr; ++attempt) {
    size_t slab_size = 0;
    std::vector<Slab> to_free;
    {
      absl::MutexLock lock(&st.mu);
      // Best fit over every free range keeps big (dedicated) slabs for big requests.
      SlabRecord* best = nullptr;
      std::map<size_t, size_t>::iterator best_range;
      for (auto& [id, rec] : st.slabs) {
        for (auto r = rec.free.begin(); r != rec.free.end(); ++r) {
          if (r->second >= need && (best == nullptr || r->second < best_range->second)) {
            best = &rec;
            best_range = r;
          }
        }
      }
      if (best != nullptr) {
        const size_t offset = best_range->first;
        const size_t left = best_range->second - need;
        best->free.erase(best_range);
        if (left > 0) best->free.emplace(offset + need, left);
        ++best->live_blocks;
        ++st.blocks;
        st.in_use_bytes += static_cast<int64_t>(bytes);
        block.reset(new DeviceBlock(state_, best->slab, offset, bytes, need, std::string(label)));
        break;
      }
      // A new slab: a standard one, or just the request when that is all the limit allows.
      const int64_t headroom = o.limit_bytes - st.reserved_bytes;
      const int64_t reclaimable = st.EmptySlabBytes();
      slab_size = need > o.slab_bytes ? need : o.slab_bytes;
      if (static_cast<int64_t>(slab_size) > headroom + reclaimable) slab_size = need;
      if (static_cast<int64_t>(need) > headroom + reclaimable) {
        return refuse(absl::StrCat("a new ", need,
                                   "-byte slab would pass the limit even after "
                                   "freeing ",
                                   reclaimable, " bytes of empty slabs"));
      }
      if (static_cast<int64_t>(slab_size) > headroom) {
        to_free = st.TakeEmptySlabs(static_cast<int64_t>(slab_size) - headroom);
      }
      st.reserved_bytes += static_cast<int64_t>(slab_size);
    }
    st.FreeSlabs(to_free);
    absl::StatusOr<Slab> slab = st.allocator->Allocate(slab_size);
    if (!slab.ok()) {
      bool retry = false;
      absl::Status error;
      {
        absl::MutexLock lock(&st.mu);
        st.reserved_bytes -= static_cast<int64_t>(slab_size);
        // Out of device memory while holding empty slabs: give them back and try once more.
        if (absl::IsResourceExhausted(slab.status()) && attempt == 0 && st.EmptySlabBytes() > 0) {
          to_free = st.TakeEmptySlabs(-1);
          retry = true;
        } else {
          error = absl::Status(
              slab.status().code(),
              absl::StrCat(st.Where(), ": cannot allocate ", bytes, " bytes for '", label,
                           "': new ", slab_size, "-byte slab: ", slab.status().message(),
                           " (reserved ", st.reserved_bytes, ", in use ", st.in_use_bytes,
                           ", limit ", o.limit_bytes, ")"));
        }
      }
      if (!retry) return error;
      st.FreeSlabs(to_free);
      continue;
    }
    absl::MutexLock lock(&st.mu);
    slab->id = next_slab_id.fetch_add(1);
    slab->bytes = slab_size;
    SlabRecord& rec = st.slabs[slab->id];
    rec.slab = *std::move(slab);
    if (slab_size > need) rec.free.emplace(need, slab_size - need);
    rec.live_blocks = 1;
    ++st.blocks;
    st.in_use_bytes += static_cast<int64_t>(bytes);
    block.reset(new DeviceBlock(state_, rec.slab, 0, bytes, need, std::string(label)));
  }
  // Outside the lock: a memset may take a while. On failure the block goes back to the pool.
  absl::Status zeroed = st.allocator->Zero(block->data(), bytes);
  if (!zeroed.ok()) return zeroed;
  return block;
}

DevicePoolUsage DevicePool::Usage() const {
  absl::MutexLock lock(&state_->mu);
  DevicePoolUsage u;
  u.reserved_bytes = state_->reserved_bytes;
  u.in_use_bytes = state_->in_use_bytes;
  u.limit_bytes = state_->options.limit_bytes;
  u.slabs = static_cast<int64_t>(state_->slabs.size());
  u.blocks = state_->blocks;
  return u;
}

int64_t DevicePool::Trim() {
  std::vector<Slab> to_free;
  {
    absl::MutexLock lock(&state_->mu);
    to_free = state_->TakeEmptySlabs(-1);
  }
  int64_t released = 0;
  for (const Slab& s : to_free) released += static_cast<int64_t>(s.bytes);
  state_->FreeSlabs(to_free);
  return released;
}

}  // namespace flatshard::gpu
