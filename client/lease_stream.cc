#include "client/lease_stream.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace flatshard::client::internal {

std::string SessionLabel(const v1::Caller& c) {
  return absl::StrCat("group=", c.group(), " rank=", c.rank(), " session=", c.session());
}

void LeaseStream::Run() {
  std::unique_ptr<grpc::ClientReaderWriter<v1::LeaseRequest, v1::LeaseResponse>> stream =
      stub_->Lease(&context_);
  v1::LeaseRequest first;
  *first.mutable_caller() = caller_;
  if (stream->Write(first)) {
    {
      absl::MutexLock lock(&mu_);
      written_ = true;
    }
    // The daemon sends nothing, or acknowledgements we need not act on; Read returns false
    // when the stream ends (the daemon finished it, the connection broke, or Stop()).
    v1::LeaseResponse response;
    while (stream->Read(&response)) {
    }
  }
  const grpc::Status s = stream->Finish();
  absl::MutexLock lock(&mu_);
  done_ = true;
  if (stopping_) {
    end_status_ = absl::FailedPreconditionError("the lease was closed by this client");
  } else if (s.ok()) {
    end_status_ = absl::UnavailableError("the daemon closed the lease");
  } else {
    end_status_ = FromGrpcStatus(s);
  }
  if (!stopping_) {
    FS_LOG(WARNING) << "lease of " << SessionLabel(caller_) << " ended: " << end_status_;
  }
}

}  // namespace flatshard::client::internal
