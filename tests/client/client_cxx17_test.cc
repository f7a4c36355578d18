// The public header compiles as C++17 and stands alone (this file is built with
// CXX_STANDARD 17 and includes nothing else of the project).
#include "flatshard/client.h"

#if __cplusplus >= 202002L
#error "this test must be compiled as C++17"
#endif

#include "gtest/gtest.h"

namespace {

using flatshard::client::Client;
using flatshard::client::ClientOptions;
using flatshard::client::ParamViews;
using flatshard::client::ShardViews;
using flatshard::client::SummonOptions;

TEST(ClientCxx17Test, DefaultsAreThoseOfTheSpec) {
  const ClientOptions o;
  EXPECT_EQ(o.call_timeout, absl::Seconds(30));
  EXPECT_EQ(o.join_timeout, absl::Seconds(60));
  const SummonOptions s;
  EXPECT_TRUE(s.recurse);
  EXPECT_TRUE(s.writeback);
  EXPECT_FALSE(s.rank0_only);
  EXPECT_FALSE(s.offload_to_cpu);
  EXPECT_FALSE(s.with_grads);
}

TEST(ClientCxx17Test, EmptyViewsFindNothing) {
  const ParamViews views;
  EXPECT_TRUE(views.empty());
  EXPECT_EQ(views.Find("w"), nullptr);
  const ShardViews shards;
  EXPECT_EQ(shards.Find(0), nullptr);
}

TEST(ClientCxx17Test, ConnectValidatesOptions) {
  ClientOptions o;  // no address
  const absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
