#include "server/access/access_control.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/access/unix_socket_acceptor.h"

namespace flatshard::server::access {

absl::StatusOr<std::vector<uid_t>> ParseUidList(absl::string_view list) {
  std::vector<uid_t> uids;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    uint32_t uid = 0;
    if (!absl::SimpleAtoi(part, &uid)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--allowed_uids: \"", part, "\" is not a numeric uid"));
    }
    uids.push_back(static_cast<uid_t>(uid));
  }
  return uids;
}

AccessControl::AccessControl(const UnixSocketAcceptor* acceptor, std::vector<uid_t> allowed_uids)
    : acceptor_(acceptor), allowed_uids_(std::move(allowed_uids)), self_uid_(::geteuid()) {}

absl::StatusOr<int64_t> AccessControl::CallerUid(absl::string_view peer) const {
  if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) return kRemoteUid;
  std::optional<PeerCredentials> cred;
  if (acceptor_ != nullptr) cred = acceptor_->Lookup(peer);
  if (!cred.has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat("flatshardd does not know the credentials of peer ", peer));
  }
  if (!allowed_uids_.empty() && cred->uid != self_uid_ &&
      std::find(allowed_uids_.begin(), allowed_uids_.end(), cred->uid) == allowed_uids_.end()) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", cred->uid, " (pid ", cred->pid,
                                                    ") is not in flatshardd's --allowed_uids"));
  }
  return static_cast<int64_t>(cred->uid);
}

}  // namespace flatshard::server::access
