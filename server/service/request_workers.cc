#include "server/service/request_workers.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flatshard::server {

void RequestWorkers::Post(const Caller& caller, absl::AnyInvocable<void()> body) {
  // The rank first: its digits end at the ':', whatever bytes the group name holds.
  workers_.Post(absl::StrCat(caller.rank, ":", caller.group), std::move(body));
}

}  // namespace flatshard::server
