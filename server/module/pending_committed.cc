#include "server/module/pending_committed.h"

#include <utility>

namespace flatshard::server {

std::vector<absl::AnyInvocable<void()>> PendingCommitted::Done(int32_t rank) {
  auto it = in_flight_.find(rank);
  if (it != in_flight_.end() && --it->second == 0) in_flight_.erase(it);
  // All of them: an operation of another rank may wait only because it was queued behind one.
  return std::exchange(waiting_, {});
}

}  // namespace flatshard::server
