#include "server/service/request_workers.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flatshard::server {

void RequestWorkers::Post(const Caller& caller, absl::AnyInvocable<void()> body) {
  // The rank first: its digits end at the ':', whatever bytes the group name holds.
  workers_.Post(absl::StrCat(caller.rank, ":", caller.group), std::move(body));
}

void RequestWorkers::Post(absl::string_view strand, absl::AnyInvocable<void()> body) {
  // A letter first: never a caller's strand.
  workers_.Post(absl::StrCat("op:", strand), std::move(body));
}

}  // namespace flatshard::server
