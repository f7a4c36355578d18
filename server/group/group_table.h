#pragma once
// GroupTable: the groups this daemon hosts, by id. Membership makes and removes them; every
// owner (modules, records, checkpoints) finds them here and then works under the group's own
// lock (Group::mu).
//
// Thread-safe. The table's lock is a leaf: held only for a lookup, an insert or a removal,
// never while waiting for a group's lock (a group's lock may be held while taking it). Groups
// are handed out as shared_ptrs: a caller keeps its group alive across its lock, so a group
// removed meanwhile is freed (its buffers unmapped) after that lock, never under it.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/group/group.h"

namespace flatshard::server {

class GroupTable {
 public:
  using Map = std::map<std::string, std::shared_ptr<Group>>;

  GroupTable();
  GroupTable(const GroupTable&) = delete;
  GroupTable& operator=(const GroupTable&) = delete;

  // The group `id` now (null: none). Its lock is not taken: the caller locks it and checks
  // `removed` (a removal between the two is seen there).
  std::shared_ptr<Group> Find(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Find, or when there is none a group that is always `removed` (never null), so that a
  // continuation finds, locks and checks its group in one shape: lock, then `g.removed`.
  std::shared_ptr<Group> FindOrGone(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every group now.
  std::vector<std::shared_ptr<Group>> All() const ABSL_LOCKS_EXCLUDED(mu_);
  // The group `id`; when there is none, the one `make` returns, inserted under the table's
  // lock (two joins of a new group make one). `make` sees the whole table (the per-uid quota)
  // and may refuse; it must not block.
  absl::StatusOr<std::shared_ptr<Group>> FindOrMake(
      const std::string& id,
      absl::FunctionRef<absl::StatusOr<std::shared_ptr<Group>>(const Map&)> make)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Adoption at start: puts `g` in place of any group of its id.
  void Insert(std::shared_ptr<Group> g) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `g` out of the table (nothing when another group of its id took its place). The
  // caller marked it removed under its lock and still holds a reference.
  void Erase(const Group& g) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether any group names `coordinator` (Group::coordinator never changes).
  bool AnyWithCoordinator(const std::string& coordinator) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  Map groups_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<Group> gone_;
};

}  // namespace flatshard::server
