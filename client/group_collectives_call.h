#pragma once
// Client::AllReduce and Client::Broadcast: the group collectives' RPCs (README "Group
// collectives") for the session `caller`, deadline `timeout`.

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "flatshard/v1/shard_service.grpc.pb.h"

namespace flatshard::client::internal {

// `values` (`count` values of `item_bytes` = 4 or 8 bytes) replaced by their reduction.
absl::Status AllReduceCall(const std::shared_ptr<grpc::Channel>& channel, const v1::Caller& caller,
                           void* values, size_t count, size_t item_bytes, ValuesReduceOp op,
                           absl::Duration timeout);

// `data` (`bytes`) replaced by rank `root`'s.
absl::Status BroadcastCall(const std::shared_ptr<grpc::Channel>& channel, const v1::Caller& caller,
                           void* data, size_t bytes, int root, absl::Duration timeout);

}  // namespace flatshard::client::internal
