#pragma once
// Kept buffers: the unsharded and staging buffers of a registered module, kept across summons
// and decommitted while unused, so that a trainer maps each segment once (steady state: no
// mmap and no page faults per summon) while an idle job holds only its shards.
//
// A KeptBuffers is one module's cache; a KeptBufferPool ties a daemon's caches together so
// that idle buffers are decommitted everywhere (on a timer, and before retrying an allocation
// refused with RESOURCE_EXHAUSTED).
//
// A buffer is "in use" while anyone besides the cache holds a reference to it (a summon's
// views, a trainer's pending answer, a collective): the cache hands out a kept buffer only
// when it alone holds it, and then marks it in use until Release() finds it unused again.
//
// Thread-safe. Each cache has its own mutex, a leaf lock held only for bookkeeping: never
// across ShardStore::Allocate (shm creation, fchown, cudaHostRegister) nor Buffer::Commit,
// which run without it. Lock order: KeptBufferPool's mutex, then a KeptBuffers' mutex.

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/shard_store.h"

namespace flatshard::server {

// Whose buffer it is.
enum class KeptOwner : uint8_t {
  // One rank's own unsharded buffer (its views; its full gradient for a reduce-scatter).
  // Under rank0_only, rank 0's views are this too.
  kRank = 0,
  // The node's one read-only copy of a unit that every local rank maps (writeback=false,
  // host daemons).
  kNodeShared = 1,
  // The node's copy of rank 0's buffer received by a rank0_only writeback broadcast, shared by
  // the local ranks (host daemons, rank 0 elsewhere).
  kNodeRank0Copy = 2,
  // One GPU rank's own copy of rank 0's broadcast, on its device.
  kRankRank0Copy = 3,
};

// Which buffer of the unit it is.
enum class KeptUse : uint8_t {
  kParams = 0,         // the full padded parameters
  kGrads = 1,          // the full padded gradient (summons with_grads)
  kGradInput = 2,      // the full gradient a trainer writes for ReduceScatterGrads
  kComputeParams = 3,  // the full padded parameters in the unit's compute dtype
  kGradScratch = 4,    // the reduced gradient shard before it is applied (ReduceScatterGrads)
};

struct KeptKey {
  KeptOwner owner = KeptOwner::kRank;
  int32_t rank = -1;  // kRank, kRankRank0Copy: whose; -1 for the node's buffers
  int32_t unit = 0;
  KeptUse use = KeptUse::kParams;

  static KeptKey Rank(int32_t rank, int32_t unit, KeptUse use) {
    return {KeptOwner::kRank, rank, unit, use};
  }
  static KeptKey NodeShared(int32_t unit, KeptUse use) {
    return {KeptOwner::kNodeShared, -1, unit, use};
  }
  static KeptKey NodeRank0Copy(int32_t unit, KeptUse use) {
    return {KeptOwner::kNodeRank0Copy, -1, unit, use};
  }
  static KeptKey RankRank0Copy(int32_t rank, int32_t unit, KeptUse use) {
    return {KeptOwner::kRankRank0Copy, rank, unit, use};
  }
  friend auto operator<=>(const KeptKey&, const KeptKey&) = default;
};

class KeptBufferPool;

// One registered module's kept buffers. Create through KeptBufferPool::NewSet.
class KeptBuffers {
 public:
  // Up to four buffers are kept per key (made only when the others are in use). EndSummon is
  // not collective, so a fast rank's next summon often arrives while a slower rank still holds
  // the previous summon's buffer (a read-only summon's node-shared copy above all). With one
  // kept buffer that summon got a fresh, unkept one: a new segment for every client to map,
  // every other summon. For one unit two suffice: a rank's summon k+2 of a unit starts after
  // its summon k+1 completed, which every rank joined only after ending summon k. Units of
  // one size share their keys (Modules::KeptUnit), and a training step holds a few of them
  // at once (the unit computing, the one prefetched, a slower rank's previous one): four.
  static constexpr int kCopies = 4;

  KeptBuffers(std::shared_ptr<KeptBufferPool> pool, ShardStore* store, Clock* clock);
  KeptBuffers(const KeptBuffers&) = delete;
  KeptBuffers& operator=(const KeptBuffers&) = delete;

  // A buffer for `key`: a kept one nobody else holds (committed again if it was decommitted;
  // one of another placement, e.g. offload_to_cpu toggled, is dropped), else a fresh one from
  // the store, kept when one of the key's copies is vacant (otherwise it lives as long as its
  // users). RESOURCE_EXHAUSTED from the store or from re-committing is retried once after the
  // pool decommitted every idle buffer. Allocates: call it without locks other threads need.
  absl::StatusOr<std::shared_ptr<Buffer>> Get(const KeptKey& key, BufferKind kind, int64_t bytes,
                                              const std::string& label, int64_t owner_uid,
                                              Placement placement);
  // The steady state without a syscall: a kept buffer for `key` of `placement` that nobody
  // else holds and that is committed, now marked in use; else null, and nothing changes.
  // Never allocates nor commits, so it may be called under a caller's lock (GroupManager's
  // mu_) to skip the unlock / allocate / re-lock round trip when nothing must be allocated.
  std::shared_ptr<Buffer> TryGet(const KeptKey& key, Placement placement);
  // Marks the buffers nobody else holds any more as idle from now (the clock's).
  void Release();
  // Decommits the buffers idle for at least `idle_release`; every idle one when `now` is
  // InfiniteFuture. Returns how many it decommitted.
  int DecommitIdle(absl::Time now, absl::Duration idle_release);
  // Empties the cache and returns its buffers (the module is being removed; the caller drops
  // them after its locks).
  std::vector<std::shared_ptr<Buffer>> TakeAll();
  // Buffers held (for tests and status).
  int size() const;
  // The host buffers kept, with their keys: what the module's record lists, so that a restart
  // after kill -9 adopts their segments, pages and all (README "Restarts").
  std::vector<std::pair<KeptKey, std::shared_ptr<Buffer>>> HostBuffers() const;
  // Keeps `buffer`, adopted at a restart, under a vacant copy of `key`; in use until the next
  // Release, so its pages stay until the module's first summon after the restart.
  void Adopt(const KeptKey& key, const std::shared_ptr<Buffer>& buffer) { Keep(key, buffer); }

 private:
  struct Kept {
    std::shared_ptr<Buffer> buffer;
    absl::Time idle_since = absl::InfiniteFuture();  // in use until Release says otherwise
  };
  // Claims a kept buffer for `key` (its reference is taken, so no other Get nor DecommitIdle
  // touches it), or returns null and reserves nothing.
  std::shared_ptr<Buffer> Claim(const KeptKey& key, Placement placement);
  // Keeps `fresh` under a vacant copy of `key`, if one is left.
  void Keep(const KeptKey& key, const std::shared_ptr<Buffer>& fresh);

  const std::shared_ptr<KeptBufferPool> pool_;
  ShardStore* const store_;
  Clock* const clock_;
  mutable absl::Mutex mu_;
  std::map<std::pair<KeptKey, int>, Kept> kept_ ABSL_GUARDED_BY(mu_);  // (key, copy)
};

// The kept-buffer caches of one daemon.
class KeptBufferPool : public std::enable_shared_from_this<KeptBufferPool> {
 public:
  // A kept buffer idle this long gives its pages back: a training loop that summons every
  // step keeps its pages (no page faults per step), an idle job holds only its shards.
  static constexpr absl::Duration kIdleRelease = absl::Seconds(1);

  static std::shared_ptr<KeptBufferPool> Create(ShardStore* store, Clock* clock,
                                                absl::Duration idle_release = kIdleRelease);
  // A new, empty cache for one module; it leaves the pool when its last reference drops.
  std::shared_ptr<KeptBuffers> NewSet();
  // DecommitIdle on every live cache (see KeptBuffers::DecommitIdle).
  int DecommitIdle(absl::Time now);

 private:
  KeptBufferPool(ShardStore* store, Clock* clock, absl::Duration idle_release);

  ShardStore* const store_;
  Clock* const clock_;
  const absl::Duration idle_release_;
  absl::Mutex mu_;
  std::vector<std::weak_ptr<KeptBuffers>> sets_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server
