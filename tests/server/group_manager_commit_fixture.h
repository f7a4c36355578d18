#pragma once
// A GroupManager over a real ShardStore for unit tests of commits and rollbacks (no gRPC):
// join every rank, register the example model, fill and check shards, commit on every rank.

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/testing/async_call.h"
#include "tests/testing/files.h"

namespace flatshard::server::testing {

class GroupManagerCommitFixture : public ::testing::Test {
 protected:
  template <typename T>
  using Async = ::flatshard::testing::AsyncCall<T>;

  explicit GroupManagerCommitFixture(const char* segment_prefix)
      : store_(ShardStoreOptions{segment_prefix}), gm_(&store_) {}

  absl::Time Deadline(absl::Duration d = absl::Seconds(10)) { return absl::Now() + d; }

  // Joins ranks [0, world) of `group`; returns their callers.
  std::vector<Caller> JoinAll(const std::string& group, int world) {
    std::vector<std::unique_ptr<Async<absl::StatusOr<JoinResult>>>> joins;
    for (int r = 0; r < world; ++r) {
      joins.push_back(std::make_unique<Async<absl::StatusOr<JoinResult>>>());
      gm_.Join(JoinArgs{group, world, r, "tok", "", -1, {}}, Deadline(), joins.back()->Callback());
    }
    std::vector<Caller> callers;
    for (int r = 0; r < world; ++r) {
      absl::StatusOr<JoinResult>& j = joins[r]->Wait();
      EXPECT_TRUE(j.ok()) << j.status();
      callers.push_back(Caller{group, r, "tok", j.ok() ? j->session : 0, -1});
    }
    return callers;
  }
  Caller Rejoin(const std::vector<Caller>& others, int rank) {
    Async<absl::StatusOr<JoinResult>> j;
    gm_.Join(JoinArgs{others[0].group, static_cast<int32_t>(others.size()), rank, "tok", "", -1, {}},
             Deadline(), j.Callback());
    absl::StatusOr<JoinResult>& r = j.Wait();
    EXPECT_TRUE(r.ok()) << r.status();
    return Caller{others[0].group, rank, "tok", r.ok() ? r->session : 0, -1};
  }

  // Every caller registers the example model with `init`; returns their results.
  std::vector<absl::StatusOr<RegisterResult>> RegisterAll(const std::vector<Caller>& callers,
                                                          InitMode init) {
    const absl::StatusOr<Manifest> manifest = ManifestFromJson(::flatshard::testing::ExampleModelFile("gpt_tied", "manifest"));
    const absl::StatusOr<Policy> policy = PolicyFromJson(::flatshard::testing::ExampleModelFile("gpt_tied", "policy"));
    std::vector<std::unique_ptr<Async<absl::StatusOr<RegisterResult>>>> calls;
    std::vector<std::thread> threads;
    for (const Caller& c : callers) {
      calls.push_back(std::make_unique<Async<absl::StatusOr<RegisterResult>>>());
      threads.emplace_back([&, c, call = calls.back().get()] {
        gm_.Register(c, "", manifest, policy, init, Deadline(), call->Callback());
      });
    }
    for (std::thread& t : threads) t.join();
    std::vector<absl::StatusOr<RegisterResult>> out;
    for (auto& c : calls) out.push_back(std::move(c->Wait()));
    return out;
  }

  // Fills every shard of `r` with `value` (an in-place optimizer write).
  static void FillShards(const RegisterResult& r, float value) {
    for (const UnitShard& s : r.shards) {
      float* data = static_cast<float*>(s.shard->data());
      for (int64_t i = 0; i < s.shard->bytes() / 4; ++i) data[i] = value;
    }
  }
  static bool ShardsHold(const RegisterResult& r, float value) {
    for (const UnitShard& s : r.shards) {
      const float* data = static_cast<const float*>(s.shard->data());
      for (int64_t i = 0; i < s.shard->bytes() / 4; ++i) {
        if (data[i] != value) return false;
      }
    }
    return true;
  }

  std::vector<absl::StatusOr<uint64_t>> CommitAll(const std::vector<Caller>& callers) {
    std::vector<std::unique_ptr<Async<absl::StatusOr<uint64_t>>>> calls;
    for (const Caller& c : callers) {
      calls.push_back(std::make_unique<Async<absl::StatusOr<uint64_t>>>());
      gm_.Commit(c, "", Deadline(), calls.back()->Callback());
    }
    std::vector<absl::StatusOr<uint64_t>> out;
    for (auto& c : calls) out.push_back(std::move(c->Wait()));
    return out;
  }

  ShardStore store_;
  GroupManager gm_;
};

}  // namespace flatshard::server::testing
