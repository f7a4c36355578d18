#pragma once
// Helpers for unit tests that drive a GroupManager directly (no gRPC): joining every rank of a
// group and registering the example model on each, the way trainers would.

#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "tests/testing/async_call.h"
#include "tests/testing/files.h"

namespace flatshard::server::testing {

// What JoinAndRegisterExample made: rank r's caller and its shards (empty if it failed).
struct ExampleGroup {
  std::vector<Caller> callers;
  std::vector<std::vector<UnitShard>> shards;
};

// Joins ranks [0, world) of group "g" (token "tok"), attaches their leases and registers the
// example model gpt_tied (zeros) on every rank at once, one thread each. Failures are test
// failures (EXPECT); each wait is bounded by `deadline` and AsyncCall's real-time bound.
inline ExampleGroup JoinAndRegisterExample(GroupManager& gm, int world, absl::Time deadline) {
  using ::flatshard::testing::AsyncCall;
  std::vector<std::unique_ptr<AsyncCall<absl::StatusOr<JoinResult>>>> joins;
  for (int r = 0; r < world; ++r) {
    joins.push_back(std::make_unique<AsyncCall<absl::StatusOr<JoinResult>>>());
    gm.Join(JoinArgs{"g", world, r, "tok", "", -1, {}}, deadline, joins.back()->Callback());
  }
  ExampleGroup out;
  for (int r = 0; r < world; ++r) {
    absl::StatusOr<JoinResult>& j = joins[r]->Wait();
    EXPECT_TRUE(j.ok()) << j.status();
    out.callers.push_back(Caller{"g", r, "tok", j.ok() ? j->session : 0, -1});
    EXPECT_TRUE(gm.AttachLease(out.callers.back()).ok());
  }
  const absl::StatusOr<Manifest> manifest =
      ManifestFromJson(::flatshard::testing::ExampleModelFile("gpt_tied", "manifest"));
  const absl::StatusOr<Policy> policy =
      PolicyFromJson(::flatshard::testing::ExampleModelFile("gpt_tied", "policy"));
  std::vector<std::unique_ptr<AsyncCall<absl::StatusOr<RegisterResult>>>> regs;
  std::vector<std::thread> threads;
  for (const Caller& c : out.callers) {
    regs.push_back(std::make_unique<AsyncCall<absl::StatusOr<RegisterResult>>>());
    threads.emplace_back([&gm, &manifest, &policy, deadline, c, call = regs.back().get()] {
      gm.Register(c, "", manifest, policy, InitMode::kZeros, deadline, call->Callback());
    });
  }
  for (std::thread& t : threads) t.join();
  for (auto& r : regs) {
    absl::StatusOr<RegisterResult>& got = r->Wait();
    EXPECT_TRUE(got.ok()) << got.status();
    out.shards.push_back(got.ok() ? got->shards : std::vector<UnitShard>{});
  }
  return out;
}

}  // namespace flatshard::server::testing
