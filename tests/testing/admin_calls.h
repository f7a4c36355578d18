#pragma once
// Admin calls that integration tests make on real daemons.

#include <chrono>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace flatshard::testing {

// Removes a finished trial's group (and its state record, if any) from the daemon at
// `address`: DeleteGroup once its ranks' leases have closed (FAILED_PRECONDITION is retried for
// up to 10 s; NOT_FOUND counts as done). Trials that share daemons delete their groups: a group
// left behind keeps its UCX tag hash (16 bits of group and epoch) live, and a later trial whose
// re-formed epoch hashes alike is refused. Failures are test failures (ADD_FAILURE).
inline void DeleteTrialGroup(const std::string& address, const std::string& group) {
  auto admin =
      v1::AdminService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::DeleteGroupRequest req;
    req.set_group(group);
    v1::DeleteGroupResponse resp;
    const grpc::Status s = admin->DeleteGroup(&ctx, req, &resp);
    if (s.ok() || s.error_code() == grpc::StatusCode::NOT_FOUND) return;
    if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION || absl::Now() > deadline) {
      ADD_FAILURE() << "DeleteGroup " << group << " at " << address << ": " << s.error_message();
      return;
    }
    absl::SleepFor(absl::Milliseconds(50));  // a rank's lease is still closing
  }
}

}  // namespace flatshard::testing
