#include "server/group/daemon_agreement.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard::server {
namespace {

std::string Describe(const peer::PeerTable& table, const peer::DaemonIdentity& d) {
  std::vector<int> ranks;
  for (size_t r = 0; r < table.rank_daemons.size(); ++r) {
    if (table.rank_daemons[r].daemon_id == d.daemon_id) ranks.push_back(static_cast<int>(r));
  }
  return absl::StrCat(
      "daemon ", d.node, " (", d.daemon_id, ", ", ranks.size() == 1 ? "rank " : "ranks ",
      absl::StrJoin(ranks, ", "), ") has ",
      d.collective_settings.empty() ? "no settings (an older flatshardd)" : d.collective_settings);
}

}  // namespace

absl::Status CheckDaemonsAgree(const peer::PeerTable& table) {
  if (table.rank_daemons.empty() || table.device_transport == "nccl") return absl::OkStatus();
  const peer::DaemonIdentity& first = table.rank_daemons[0];
  for (const peer::DaemonIdentity& d : table.rank_daemons) {
    if (d.collective_settings == first.collective_settings) continue;
    return absl::FailedPreconditionError(
        absl::StrCat("group ", table.group,
                     ": its daemons disagree on how the remote backend runs "
                     "all-gather and reduce-scatter: ",
                     Describe(table, first), ", ", Describe(table, d),
                     "; start every daemon of the group with the same --ucx_hierarchical"));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
