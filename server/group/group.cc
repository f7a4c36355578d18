#include "server/group/group.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/group/access.h"

namespace flatshard::server {

using internal::CheckUid;
using internal::TokensEqual;

absl::Status CheckCallerLocked(const Group& g, const Caller& caller) {
  if (g.removed) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  FS_RETURN_IF_ERROR(CheckUid(g, caller.uid));
  if (!TokensEqual(g.token, caller.token)) {
    return absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
  }
  if (caller.rank < 0 || caller.rank >= g.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("group ", g.id, ": rank ", caller.rank,
                                                   " is out of range [0, ", g.world_size, ")"));
  }
  if (caller.session == 0 || g.session_of_rank[caller.rank] != caller.session) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, " rank ", caller.rank, ": session ", caller.session,
                     " is not the rank's current session (join first)"));
  }
  if (g.coll == nullptr) {
    // A session of a join still pending (the group forms once every rank has joined).
    return absl::FailedPreconditionError(absl::StrCat("group ", g.id, " rank ", caller.rank,
                                                      ": the group has not formed yet (its join is "
                                                      "still waiting for the other ranks)"));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
