#pragma once
// Spare segments of published weights (README "Publishing weights"): the segment of a version
// that left the table with no reader holding it is kept for the next version of the same name
// instead of being freed, so that Publish copies into memory this daemon has already written
// (mapped and backed) rather than into a fresh segment, whose first touch of every page costs
// far more than the copy itself (a page fault per 4 KiB: 20x a memcpy on the VMs measured,
// README "Figures"). One spare per (owner uid, name), taken only by a version of exactly its
// size and with the same grants (reader uids and token): whoever might still map the old
// version's segment past its lease may open the new version too. A spare counts against its
// uid's quota and the memory limit like the version it was (the peak is unchanged: the next
// publish needs that memory anyway); it is freed when the name is dropped, when the next
// version has another size or other grants, and at shutdown.
//
// Thread safety: thread-safe; one leaf lock, never held while a buffer is freed.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::server {

class Buffer;

// Who may open a version: a spare is reused only under the same grants.
struct SegmentGrants {
  std::vector<int64_t> reader_uids;  // sorted, unique
  std::string token;
  bool world_readable = false;  // widened to 0444 for a reader of unknown uid (TCP)
  friend bool operator==(const SegmentGrants&, const SegmentGrants&) = default;
};

class SpareSegments {
 public:
  using Key = std::pair<int64_t, std::string>;  // (owner uid, name)

  // Keeps `buffer` (the sole owner hands it over) as the spare of `key`, replacing (freeing)
  // an older one. World-readable segments are freed instead.
  void Offer(const Key& key, std::shared_ptr<Buffer> buffer, SegmentGrants grants);
  // The spare of `key` if it has `bytes` bytes and `grants`, unsealed (mode 0600, no ACL) and
  // ready to be written; nullptr otherwise (a spare that does not fit is freed: the version
  // being built replaces it). A spare that cannot be unsealed is freed (logged).
  std::shared_ptr<Buffer> Take(const Key& key, int64_t bytes, const SegmentGrants& grants);
  // Frees the spare of `key` (the name was dropped).
  void Forget(const Key& key);
  // Frees every spare.
  void Clear();
  int64_t spares() const;
  int64_t bytes() const;  // of every spare

 private:
  struct Spare {
    std::shared_ptr<Buffer> buffer;
    SegmentGrants grants;
  };
  mutable absl::Mutex mu_;
  std::map<Key, Spare> spares_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server
