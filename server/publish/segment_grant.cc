#include "server/publish/segment_grant.h"

#include <sys/stat.h>
#include <sys/xattr.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace flatshard::server {
namespace {

// The kernel's xattr form of an access ACL (linux/posix_acl_xattr.h).
constexpr uint32_t kAclVersion = 2;
constexpr uint16_t kUserObj = 0x01, kUser = 0x02, kGroupObj = 0x04, kMask = 0x10, kOther = 0x20;
constexpr uint16_t kRead = 4;
constexpr uint32_t kUndefinedId = 0xffffffffu;

void Put(std::string* out, uint16_t tag, uint16_t perm, uint32_t id) {
  char e[8];
  std::memcpy(e, &tag, 2);
  std::memcpy(e + 2, &perm, 2);
  std::memcpy(e + 4, &id, 4);
  out->append(e, 8);
}

absl::Status Errno(const char* what) {
  const int e = errno;
  const std::string text =
      absl::StrCat(what, " of a published version's segment: ", std::strerror(e));
  if (e == ENOTSUP || e == EOPNOTSUPP) return absl::FailedPreconditionError(text);
  if (e == EPERM || e == EACCES) return absl::PermissionDeniedError(text);
  return absl::InternalError(text);
}

}  // namespace

absl::Status SealReadOnly(int fd) {
  if (::fchmod(fd, 0400) != 0) return Errno("fchmod");
  return absl::OkStatus();
}

absl::Status GrantRead(int fd, const std::vector<int64_t>& uids) {
  std::string acl;
  acl.append(reinterpret_cast<const char*>(&kAclVersion), 4);
  Put(&acl, kUserObj, kRead, kUndefinedId);
  std::vector<int64_t> sorted(uids);
  std::sort(sorted.begin(), sorted.end());  // the kernel wants them by id
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (int64_t uid : sorted) Put(&acl, kUser, kRead, static_cast<uint32_t>(uid));
  Put(&acl, kGroupObj, 0, kUndefinedId);
  Put(&acl, kMask, kRead, kUndefinedId);
  Put(&acl, kOther, 0, kUndefinedId);
  if (::fsetxattr(fd, "system.posix_acl_access", acl.data(), acl.size(), 0) != 0) {
    return Errno("setting the read ACL");
  }
  return absl::OkStatus();
}

absl::Status GrantReadToAll(int fd) {
  if (::fchmod(fd, 0444) != 0) return Errno("fchmod");
  return absl::OkStatus();
}

absl::Status Unseal(int fd) {
  if (::fremovexattr(fd, "system.posix_acl_access") != 0 && errno != ENODATA && errno != ENOTSUP &&
      errno != EOPNOTSUPP) {
    return Errno("removing the read ACL");
  }
  if (::fchmod(fd, 0600) != 0) return Errno("fchmod");
  return absl::OkStatus();
}

}  // namespace flatshard::server
