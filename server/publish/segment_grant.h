#pragma once
// Who may open a published version's segment: read-only for its owner (mode 0400), and for
// each further reader uid an entry of the segment's POSIX access ACL (user:<uid>:r), added
// when the daemon admits that reader (tmpfs keeps ACLs in memory). A reader whose uid the
// daemon cannot know (TCP) gets the segment readable to every local user (0444) instead.
// Thread-compatible: one caller per descriptor at a time (the publisher's lock).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace flatshard::server {

// Mode 0400 (read-only for the owner) and no ACL beyond it. Errors: the errno's, naming it.
absl::Status SealReadOnly(int fd);
// Sets the access ACL to the owner's read plus read for each of `uids`. Errors: the errno's
// (FAILED_PRECONDITION where the file system has no ACLs).
absl::Status GrantRead(int fd, const std::vector<int64_t>& uids);
// Mode 0444.
absl::Status GrantReadToAll(int fd);
// Back to a fresh segment's mode 0600 with no ACL, to be written again (spare_segments.h).
absl::Status Unseal(int fd);

}  // namespace flatshard::server
