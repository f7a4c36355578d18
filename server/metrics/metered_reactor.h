#pragma once
// MeteredReactor: a unary callback reactor that records flatshard_rpcs_total{method,code} and
// flatshard_rpc_latency_seconds{method} when it finishes. A ShardService handler uses it in
// place of ctx->DefaultReactor():
//
//   MeteredReactor* reactor = MeteredReactor::New(ctx, "JoinGroup");
//   ... [reactor](...) { reactor->Finish(status); } ...
//   return reactor;
//
// Finish hides grpc::ServerUnaryReactor::Finish, so callers must hold a MeteredReactor* (as
// the handlers' lambdas do). The reactor deletes itself in OnDone.
// Thread safety: as grpc::ServerUnaryReactor (Finish once, from any thread).

#include <string>

#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/metrics/daemon_metrics.h"

namespace flatshard::metrics {

class MeteredReactor final : public grpc::ServerUnaryReactor {
 public:
  // `method` must outlive the reactor (a string literal). `ctx` is the call's context; it is
  // only taken so that every handler's first line keeps the shape of ctx->DefaultReactor().
  static MeteredReactor* New(grpc::CallbackServerContext* /*ctx*/, absl::string_view method) {
    return new MeteredReactor(method);
  }

  void Finish(grpc::Status status) {
    RecordRpc(method_, static_cast<absl::StatusCode>(status.error_code()), absl::Now() - start_);
    grpc::ServerUnaryReactor::Finish(std::move(status));
  }
  void OnDone() override { delete this; }

 private:
  explicit MeteredReactor(absl::string_view method) : method_(method), start_(absl::Now()) {}

  const absl::string_view method_;
  const absl::Time start_;
};

}  // namespace flatshard::metrics
