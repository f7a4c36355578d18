#pragma once
// A server interceptor on every call of the daemon's ShardService and AdminService, applied
// to what the daemon answers (the status it sends):
//
//  * Marks the answer with the trailing metadata kDaemonAnswerKey (common/grpc_status.h): the
//    call reached the daemon, so a client must not retry it (only failures that never reached
//    a daemon are retried; client.h "Errors").
//  * Answers a request gRPC could not parse with INVALID_ARGUMENT naming the method (the
//    callback API's own answer is a bare UNIMPLEMENTED, which reads as "no such method").
//  * Bounds the status message to kMaxErrorMessageBytes (common/limits.h): an error quoting a
//    huge input must not outgrow gRPC's metadata limit, which tears the connection down (and
//    the caller's lease with it) instead of delivering the error.
//
// Thread-safe (one interceptor per call; the factory is stateless).

#include <memory>

#include <grpcpp/support/server_interceptor.h>

namespace flatshard::server {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewAnswerInterceptorFactory();

}  // namespace flatshard::server
