#include "client/group_collectives_call.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace flatshard::client::internal {
namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

v1::ValuesReduceOp ToProto(ValuesReduceOp op) {
  switch (op) {
    case ValuesReduceOp::kSum:
      return v1::VALUES_REDUCE_OP_SUM;
    case ValuesReduceOp::kMax:
      return v1::VALUES_REDUCE_OP_MAX;
    case ValuesReduceOp::kMin:
      return v1::VALUES_REDUCE_OP_MIN;
  }
  return v1::VALUES_REDUCE_OP_UNSPECIFIED;  // the daemon names it on every rank
}

}  // namespace

absl::Status AllReduceCall(const std::shared_ptr<grpc::Channel>& channel, const v1::Caller& caller,
                           void* values, size_t count, size_t item_bytes, ValuesReduceOp op,
                           absl::Duration timeout) {
  if (values == nullptr && count > 0) {
    return absl::InvalidArgumentError("AllReduce: values is null with a count of " +
                                      std::to_string(count));
  }
  v1::AllReduceValuesRequest request;
  *request.mutable_caller() = caller;
  request.set_dtype(item_bytes == 8 ? v1::DTYPE_FLOAT64 : v1::DTYPE_FLOAT32);
  request.set_op(ToProto(op));
  const size_t bytes = count * item_bytes;
  if (bytes > 0) request.set_values(static_cast<const char*>(values), bytes);
  auto stub = v1::ShardService::NewStub(channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::AllReduceValuesResponse response;
  FS_RETURN_IF_ERROR(FromGrpcStatus(stub->AllReduceValues(&ctx, request, &response)));
  if (response.values().size() != bytes) {
    return absl::InternalError(absl::StrCat("AllReduce: the daemon answered ",
                                            response.values().size(), " bytes for ", bytes));
  }
  if (bytes > 0) std::memcpy(values, response.values().data(), bytes);
  return absl::OkStatus();
}

absl::Status BroadcastCall(const std::shared_ptr<grpc::Channel>& channel, const v1::Caller& caller,
                           void* data, size_t bytes, int root, absl::Duration timeout) {
  if (data == nullptr && bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Broadcast: data is null with ", bytes, " bytes"));
  }
  v1::BroadcastBytesRequest request;
  *request.mutable_caller() = caller;
  request.set_root(root);
  // Every rank sends its bytes: the daemon checks the sizes; only the root's travel on.
  if (bytes > 0) request.set_data(static_cast<const char*>(data), bytes);
  auto stub = v1::ShardService::NewStub(channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::BroadcastBytesResponse response;
  FS_RETURN_IF_ERROR(FromGrpcStatus(stub->BroadcastBytes(&ctx, request, &response)));
  if (response.data().size() != bytes) {
    return absl::InternalError(absl::StrCat("Broadcast: the daemon answered ",
                                            response.data().size(), " bytes for ", bytes));
  }
  if (bytes > 0) std::memcpy(data, response.data().data(), bytes);
  return absl::OkStatus();
}

}  // namespace flatshard::client::internal
