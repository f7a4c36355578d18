#include "server/service/answer_interceptor.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/grpc_status.h"
#include "common/limits.h"

namespace flatshard::server {
namespace {

// The services whose answers are the daemon's (the health service is gRPC's own).
constexpr absl::string_view kOurServices[] = {"/flatshard.v1.ShardService/",
                                              "/flatshard.v1.AdminService/"};

class AnswerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit AnswerInterceptor(std::string method) : method_(std::move(method)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = true;  // gRPC could not deserialize the request
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status status = methods->GetSendStatus();
      // The callback API answers a request it could not parse with UNIMPLEMENTED and no
      // message before any handler runs; the daemon's handlers never answer that way.
      if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
          status.error_message().empty()) {
        status = grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat(method_, ": the request could not be parsed as the method's message",
                         unparsed_ ? "" : " (or the method is not served)"));
        methods->ModifySendStatus(status);
      } else if (status.error_message().size() > kMaxErrorMessageBytes) {
        methods->ModifySendStatus(grpc::Status(
            status.error_code(), Truncated(status.error_message(), kMaxErrorMessageBytes),
            status.error_details()));
      }
      methods->GetSendTrailingMetadata()->emplace(kDaemonAnswerKey, "1");
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  bool unparsed_ = false;
};

class AnswerInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const absl::string_view method = info->method() == nullptr ? "" : info->method();
    for (absl::string_view service : kOurServices) {
      if (absl::StartsWith(method, service)) return new AnswerInterceptor(std::string(method));
    }
    return nullptr;
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewAnswerInterceptorFactory() {
  return std::make_unique<AnswerInterceptorFactory>();
}

}  // namespace flatshard::server
